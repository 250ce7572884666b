"""``deferral scheduler|worker|triggerer|standalone``: the engine's processes."""

from __future__ import annotations

import sys

import click

from engine.cli.common import (
    _dags_option,
    _run,
    _settings,
    console,
    log,
    migrate,
    require_dags_folder,
)


@click.command()
@_dags_option
@click.pass_context
def scheduler(ctx: click.Context, dags_folder: str | None) -> None:
    """Run the scheduler: ends runs, resolves dependencies, reaps dead workers.

    It also records the DAGs of the DAGs folder, scanned every dag_rescan_interval_s (and at
    once when `dags trigger` asks for a DAG it does not know)."""
    from engine.app import run_component

    settings = _settings(ctx).replace(dags_folder=dags_folder)
    require_dags_folder(settings, "scheduler")
    _run(run_component, "scheduler", settings)


@click.command()
@_dags_option
@click.option("--slots", type=click.IntRange(min=1), help="Tasks run at once (default 16).")
@click.pass_context
def worker(ctx: click.Context, dags_folder: str | None, slots: int | None) -> None:
    """Run a worker: claims and runs task instances in SLOTS slots."""
    from engine.app import run_component

    settings = _settings(ctx).replace(dags_folder=dags_folder, worker_slots=slots)
    require_dags_folder(settings, "worker")
    _run(run_component, "worker", settings)


@click.command()
@_dags_option
@click.option(
    "--capacity", type=click.IntRange(min=1), help="Triggers held at once (default 1000)."
)
@click.pass_context
def triggerer(ctx: click.Context, dags_folder: str | None, capacity: int | None) -> None:
    """Run a triggerer: one event loop running up to CAPACITY trigger coroutines.

    Without a DAGs folder it starts with a warning: only triggers importable without one (the
    built-in triggers.*) can run there."""
    from engine.app import run_component

    settings = _settings(ctx).replace(dags_folder=dags_folder, triggerer_capacity=capacity)
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
    "--webserver-port",
    type=click.IntRange(min=1, max=65535),
    help="Port of the status page (default 8793, setting webserver_port; it listens on "
    "webserver_host, 127.0.0.1 by default).",
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
) -> None:
    """Scheduler, worker and triggerer (one process each) on one machine, and the status
    page (read-only; `deferral webserver` for actions) as a fourth process.

    Ctrl-C (or SIGTERM) once: stop gracefully (running tasks finish within
    worker_shutdown_grace_s, triggers are released); twice: cancel; three times: kill.
    """
    from engine.standalone import run_standalone
    from engine.web.server import status_url

    settings = _settings(ctx).replace(
        dags_folder=dags_folder,
        worker_slots=slots,
        triggerer_capacity=capacity,
        webserver_port=webserver_port,
    )
    require_dags_folder(settings, "standalone")
    _run(migrate, settings)
    console.print(
        f"[bold]deferral standalone[/]: scheduler, worker ({settings.worker_slots} slots), "
        f"triggerer (capacity {settings.triggerer_capacity}); DAGs from "
        f"{settings.dags_folder or '(none)'}. Ctrl-C: stop gracefully; twice: cancel."
    )
    if not no_webserver:
        url = status_url(settings.webserver_host, settings.webserver_port)
        console.print(f"[bold]status page[/]: {url}", highlight=False, soft_wrap=True)
    sys.exit(run_standalone(settings, webserver=not no_webserver))
