"""``deferral scheduler|worker|triggerer|standalone``: the engine's processes."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import msgspec
from rich.markup import escape

from engine.cli.common import (
    _dags_option,
    _run,
    _settings,
    _usage_exit,
    console,
    log,
    migrate,
    require_dags_folder,
)
from engine.config import STANDALONE_METRICS_PORT, ConfigError, Settings
from engine.runtime import logs


def _metrics_port_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    fn = click.option(
        "--no-metrics",
        is_flag=True,
        help="No metrics server, whatever the setting metrics_port says.",
    )(fn)
    return click.option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        help="Serve /metrics, /livez and /readyz on this port (setting metrics_port; "
        "default: none; 0: a free port, which `deferral status` shows).",
    )(fn)


def _with_metrics(settings: Settings, no_metrics: bool) -> Settings:
    return msgspec.structs.replace(settings, metrics_port=None) if no_metrics else settings


@click.command()
@_dags_option
@_metrics_port_option
@click.pass_context
def scheduler(
    ctx: click.Context, dags_folder: str | None, metrics_port: int | None, no_metrics: bool
) -> None:
    """Run the scheduler: ends runs, resolves dependencies, reaps dead workers.

    It also records the DAGs of the DAGs folder, scanned every dag_rescan_interval_s (and at
    once when `dags trigger` asks for a DAG it does not know)."""
    from engine.launch.app import run_component

    logs.set_process_name("scheduler")  # every line names its process, the first ones too
    settings = _settings(ctx).replace(dags_folder=dags_folder, metrics_port=metrics_port)
    settings = _with_metrics(settings, no_metrics)
    require_dags_folder(settings, "scheduler")
    _run(run_component, "scheduler", settings)


def _queues_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--queues",
        metavar="Q1,Q2",
        callback=_parse_queues,
        help=f"Run the {what} of these queues, comma-separated (default: default).",
    )


def _parse_queues(
    _ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[str, ...] | None:
    if value is None:
        return None
    queues = tuple(dict.fromkeys(q.strip() for q in value.split(",") if q.strip()))
    if not queues:
        raise click.BadParameter("name at least one queue, e.g. --queues default", param=param)
    return queues


@click.command()
@_dags_option
@click.option("--slots", type=click.IntRange(min=1), help="Tasks run at once (default 16).")
@_queues_option("tasks")
@_metrics_port_option
@click.pass_context
def worker(
    ctx: click.Context,
    dags_folder: str | None,
    slots: int | None,
    queues: tuple[str, ...] | None,
    metrics_port: int | None,
    no_metrics: bool,
) -> None:
    """Run a worker: claims and runs task instances in SLOTS slots, those of its QUEUES."""
    from engine.launch.app import run_component

    logs.set_process_name("worker")  # every line names its process, the first ones too
    settings = _settings(ctx).replace(
        dags_folder=dags_folder, worker_slots=slots, worker_queues=queues, metrics_port=metrics_port
    )
    settings = _with_metrics(settings, no_metrics)
    require_dags_folder(settings, "worker")
    _run(run_component, "worker", settings)


@click.command()
@_dags_option
@click.option(
    "--capacity", type=click.IntRange(min=1), help="Triggers held at once (default 1000)."
)
@_queues_option("triggers")
@_metrics_port_option
@click.pass_context
def triggerer(
    ctx: click.Context,
    dags_folder: str | None,
    capacity: int | None,
    queues: tuple[str, ...] | None,
    metrics_port: int | None,
    no_metrics: bool,
) -> None:
    """Run a triggerer: one event loop running up to CAPACITY trigger coroutines.

    Without a DAGs folder it starts with a warning: only triggers importable without one (the
    built-in triggers.*) can run there."""
    from engine.launch.app import run_component

    logs.set_process_name("triggerer")  # every line names its process, the first ones too
    settings = _settings(ctx).replace(
        dags_folder=dags_folder,
        triggerer_capacity=capacity,
        triggerer_queues=queues,
        metrics_port=metrics_port,
    )
    settings = _with_metrics(settings, no_metrics)
    if not settings.dags_folder:
        log.warning(
            "triggerer: no DAGs folder (--dags or DEFERRAL_DAGS_FOLDER): only triggers "
            "importable without one, such as the built-in triggers.*, can run here; a trigger "
            "defined next to the DAG files fails with 'No module named ...'"
        )
    else:
        require_dags_folder(settings, "triggerer")
    _run(run_component, "triggerer", settings)


@click.command()
@_dags_option
@click.option("--slots", type=click.IntRange(min=1), help="Worker slots (default 16).")
@click.option("--capacity", type=click.IntRange(min=1), help="Triggerer capacity (default 1000).")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65533),
    help="First of the three metrics ports: the scheduler's, the worker's (+1) and the "
    f"triggerer's (+2) (default: setting metrics_port, else {STANDALONE_METRICS_PORT}; "
    "0: three free ports).",
)
@click.option("--no-metrics", is_flag=True, help="No metrics servers.")
@click.option(
    "--webserver-port",
    type=click.IntRange(min=0, max=65535),
    help="Port of the status page (default 8793, setting webserver_port; 0: a free port; it "
    "listens on webserver_host, 127.0.0.1 by default).",
)
@click.option("--no-webserver", is_flag=True, help="Do not start the status page.")
@click.pass_context
def standalone(
    ctx: click.Context,
    dags_folder: str | None,
    slots: int | None,
    capacity: int | None,
    webserver_port: int | None,
    no_webserver: bool,
    metrics_port: int | None,
    no_metrics: bool,
) -> None:
    """Scheduler, worker and triggerer (one process each) on one machine, and the status
    page (read-only; `deferral webserver` for actions) as a fourth process.

    The ports are bound before anything starts: a port another process holds is an error
    (exit 2) naming the flag to change, and the addresses printed are the ones served.

    Ctrl-C (or SIGTERM) once: stop gracefully (running tasks finish within
    worker_shutdown_grace_s, triggers are released); twice: cancel; three times: kill.
    """
    from engine.launch.standalone import bind_listeners, run_standalone

    logs.set_process_name("standalone")  # every line names its process, the first ones too
    settings = _settings(ctx).replace(
        dags_folder=dags_folder,
        worker_slots=slots,
        triggerer_capacity=capacity,
        webserver_port=webserver_port,
        metrics_port=metrics_port,
    )
    require_dags_folder(settings, "standalone")
    try:
        listeners = bind_listeners(settings, webserver=not no_webserver, metrics=not no_metrics)
    except ConfigError as exc:
        _usage_exit(str(exc))
    try:
        _run(migrate, settings)
        page, metrics = listeners.urls(settings)
        console.print(
            f"[bold]deferral standalone[/]: scheduler, worker ({settings.worker_slots} slots), "
            f"triggerer (capacity {settings.triggerer_capacity}); DAGs from "
            f"{escape(str(Path(str(settings.dags_folder)).expanduser().resolve()))}. "
            "Ctrl-C: stop gracefully; twice: cancel.",
            soft_wrap=True,
            highlight=False,
        )
        if metrics:
            console.print(
                "metrics and health: "
                + ", ".join(f"{kind} {url}" for kind, url in metrics.items()),
                highlight=False,
                soft_wrap=True,
            )
        if page is not None:
            console.print(f"[bold]status page[/]: {page}", highlight=False, soft_wrap=True)
        code = run_standalone(
            settings,
            config_file=ctx.obj["loaded"].file,
            webserver=not no_webserver,
            listeners=listeners,
        )
    finally:
        listeners.close()
    sys.exit(code)
