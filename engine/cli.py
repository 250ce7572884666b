"""The ``deferral`` command."""

from __future__ import annotations

import datetime as dt
import logging
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import asyncpg
import click
import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engine import __version__, logs
from engine.config import ConfigError, Settings, load_settings
from engine.dagbag import DagBag, error_summary
from engine.runner import run_async
from engine.store.embedded import EmbeddedServerError
from triggers.base import import_object

if TYPE_CHECKING:
    from engine.store.models import DagSummary, TaskInstance, TriggererRow, TriggerRow

T = TypeVar("T")
console = Console()
err_console = Console(stderr=True)
log = logging.getLogger(__name__)


class _Text(click.ParamType):  # type: ignore[type-arg]
    """A string the database and the logs can hold: no NUL character and, unless it names a
    file, valid UTF-8 (bytes that are not UTF-8 reach Python as lone surrogates). Rejected here
    with a usage error naming the argument, rather than as a database error or a traceback."""

    name = "text"

    def __init__(self, *, utf8: bool = True) -> None:
        self.utf8 = utf8

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            value = str(value)
        problem = _text_problem(value, utf8=self.utf8)
        if problem:
            self.fail(problem, param, ctx)
        return value


def _text_problem(value: str, *, utf8: bool = True) -> str | None:
    if "\x00" in value:
        return "must not contain a NUL character"
    if utf8:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "is not valid UTF-8 text"
    return None


def _json_text_problem(value: Any) -> str | None:
    """The first string (key or value) of a decoded JSON document that jsonb cannot hold."""
    if isinstance(value, str):
        return _text_problem(value)
    if isinstance(value, dict):
        items: list[Any] = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        items = value
    else:
        return None
    return next((p for p in map(_json_text_problem, items) if p), None)


class _Seconds(click.FloatRange):
    """A duration in seconds: a finite number > 0 (FloatRange alone lets nan through)."""

    def __init__(self) -> None:
        super().__init__(min=0, min_open=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{seconds} is not a finite number of seconds", param, ctx)
        return seconds


class _Folder(click.Path):
    """An existing folder; a NUL in the name is a usage error (os.stat raises ValueError)."""

    def __init__(self) -> None:
        super().__init__(file_okay=False, exists=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and "\x00" in value:
            self.fail("must not contain a NUL character", param, ctx)
        return super().convert(value, param, ctx)


TEXT = _Text()
PATH_TEXT = _Text(utf8=False)
SECONDS = _Seconds()


def _settings(ctx: click.Context) -> Settings:
    settings: Settings = ctx.obj["settings"]
    return settings


def _run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    ctx = click.get_current_context(silent=True)
    settings: Settings | None = ctx.obj["settings"] if ctx is not None and ctx.obj else None
    try:
        return run_async(fn, *args, loop=settings.event_loop if settings else "uvloop")
    except ConfigError as exc:
        err_console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False)
        sys.exit(2)
    except (OSError, asyncpg.PostgresError, EmbeddedServerError) as exc:
        where = (
            "DEFERRAL_DATABASE_URL"
            if settings is not None and settings.database_url
            else "the embedded server"
        )
        err_console.print(
            f"[red]error[/]: cannot use the database ({where}): {type(exc).__name__}: {exc}"
        )
        sys.exit(2)


class _LazyGroup(click.Group):
    """A command group some of whose commands are imported by path when first used: the
    benchmarks (``deferral bench``) are not part of the runtime, which never imports them at
    import time (an import-linter contract and tests/test_layers.py say so)."""

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            command = import_object(
                self.lazy[cmd_name],
                "command",
                accept=lambda obj: isinstance(obj, click.Command),
                wanted="a click command",
            )
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(
    cls=_LazyGroup,
    lazy={"bench": "benchmarks.cli.bench"},
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, "--version", prog_name="deferral")
@click.option(
    "--database-url",
    envvar="DEFERRAL_DATABASE_URL",
    type=TEXT,
    help="PostgreSQL URL (default: the embedded server).",
)
@click.option(
    "--home", envvar="DEFERRAL_HOME", type=PATH_TEXT, help="Folder for the embedded database."
)
@click.option(
    "--log-level", envvar="DEFERRAL_LOG_LEVEL", type=TEXT, help="DEBUG, INFO, WARNING, ERROR."
)
@click.option("--log-format", envvar="DEFERRAL_LOG_FORMAT", type=click.Choice(["text", "json"]))
@click.option(
    "--insecure-dev",
    is_flag=True,
    default=None,
    help="With an external database and no key, store plaintext (development only).",
)
@click.pass_context
def cli(
    ctx: click.Context,
    database_url: str | None,
    home: str | None,
    log_level: str | None,
    log_format: str | None,
    insecure_dev: bool | None,
) -> None:
    """deferral: tasks that wait hand their wait to a triggerer and free their worker slot."""
    try:
        settings = load_settings(
            database_url=database_url,
            home=home,
            log_level=log_level,
            log_format=log_format,
            insecure_dev=insecure_dev or None,
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    logs.configure_logging(settings.log_level, settings.log_format)
    ctx.obj = {"settings": settings}


def _dags_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--dags`` of the process commands."""
    return click.option(
        "--dags",
        "dags_folder",
        envvar="DEFERRAL_DAGS_FOLDER",
        type=_Folder(),
        help="Folder of DAG files (also on sys.path for trigger classes). The scheduler, "
        "worker and standalone refuse to start without one (exit 2); the triggerer warns.",
    )(fn)


def _parse_dags_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--dags`` of the commands that parse the folder themselves (``dags ...``)."""
    return click.option(
        "--dags",
        "dags_folder",
        envvar="DEFERRAL_DAGS_FOLDER",
        type=_Folder(),
        help="Folder of DAG files to parse (and record) first.",
    )(fn)


def _usage_exit(problem: str) -> NoReturn:
    err_console.print(f"[red]error[/]: {escape(problem)}", highlight=False, soft_wrap=True)
    sys.exit(2)


def check_dags_folder(settings: Settings) -> None:
    """Exit 2 when the DAGs folder the settings name (perhaps in deferral.toml, which click
    does not check) is not an existing folder."""
    folder = settings.dags_folder
    if folder and not Path(folder).expanduser().is_dir():
        _usage_exit(f"the DAGs folder {folder} (setting dags_folder) is not an existing folder")


def require_dags_folder(settings: Settings, command: str) -> None:
    """Exit 2 unless the settings name an existing DAGs folder (``--dags``,
    ``DEFERRAL_DAGS_FOLDER`` or ``dags_folder`` in deferral.toml); log the folder used. A
    scheduler, worker or standalone without one would start and then fail every run."""
    if not settings.dags_folder:
        _usage_exit(
            f"deferral {command} needs a DAGs folder: pass --dags FOLDER or set "
            "DEFERRAL_DAGS_FOLDER (or dags_folder in deferral.toml)"
        )
    check_dags_folder(settings)
    log.info("%s: DAGs folder %s", command, Path(settings.dags_folder).expanduser().resolve())


# -- processes ---------------------------------------------------------------------------


@cli.command()
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


@cli.command()
@_dags_option
@click.option("--slots", type=click.IntRange(min=1), help="Tasks run at once (default 16).")
@click.pass_context
def worker(ctx: click.Context, dags_folder: str | None, slots: int | None) -> None:
    """Run a worker: claims and runs task instances in SLOTS slots."""
    from engine.app import run_component

    settings = _settings(ctx).replace(dags_folder=dags_folder, worker_slots=slots)
    require_dags_folder(settings, "worker")
    _run(run_component, "worker", settings)


@cli.command()
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


@cli.command()
@_dags_option
@click.option("--slots", type=click.IntRange(min=1), help="Worker slots (default 16).")
@click.option("--capacity", type=click.IntRange(min=1), help="Triggerer capacity (default 1000).")
@click.pass_context
def standalone(
    ctx: click.Context, dags_folder: str | None, slots: int | None, capacity: int | None
) -> None:
    """Scheduler, worker and triggerer (one process each) on one machine.

    Ctrl-C (or SIGTERM) once: stop gracefully (running tasks finish within
    worker_shutdown_grace_s, triggers are released); twice: cancel; three times: kill.
    """
    from engine.standalone import run_standalone

    settings = _settings(ctx).replace(
        dags_folder=dags_folder, worker_slots=slots, triggerer_capacity=capacity
    )
    require_dags_folder(settings, "standalone")
    _run(_migrate, settings)
    console.print(
        f"[bold]deferral standalone[/]: scheduler, worker ({settings.worker_slots} slots), "
        f"triggerer (capacity {settings.triggerer_capacity}); DAGs from "
        f"{settings.dags_folder or '(none)'}. Ctrl-C: stop gracefully; twice: cancel."
    )
    sys.exit(run_standalone(settings))


async def _migrate(settings: Settings) -> list[int]:
    from engine.store import open_store

    store = await open_store(settings, migrate=False)
    try:
        return await store.migrate()
    finally:
        await store.close()


# -- inspecting --------------------------------------------------------------------------


def _json(rows: Sequence[object]) -> None:
    """Rows (structs or dicts) as one JSON array of objects."""
    click.echo(msgspec.json.encode(rows).decode())


class _ListedTask(msgspec.Struct, frozen=True, kw_only=True):
    """A task instance in ``tasks list --json``: these keys, the result decoded."""

    dag_id: str
    run_id: str
    task_id: str
    state: str
    try_number: int
    result: Any
    error: str | None
    trigger_id: int | None
    started_at: dt.datetime | None
    ended_at: dt.datetime | None


def _decode_result(raw: bytes | None) -> Any:
    from triggers.base import decode_value

    return None if raw is None else decode_value(raw)


@cli.group()
def dags() -> None:
    """List and trigger DAGs."""


@dags.command("list")
@_parse_dags_option
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@click.pass_context
def dags_list(ctx: click.Context, dags_folder: str | None, as_json: bool) -> None:
    """List the DAGs known to the database (parsing --dags first, if given)."""
    settings = _settings(ctx).replace(dags_folder=dags_folder)
    check_dags_folder(settings)

    async def main() -> tuple[list[DagSummary], dict[str, str]]:
        from engine.scheduler import sync_dags
        from engine.store import open_store

        store = await open_store(settings)
        try:
            errors: dict[str, str] = {}
            if settings.dags_folder:
                bag = DagBag(
                    settings.dags_folder,
                    processor_timeout_s=settings.dag_file_processor_timeout_s,
                )
                await sync_dags(store, bag)
                errors = dict(bag.import_errors)
            return await store.list_dags(), errors
        finally:
            await store.close()

    rows, errors = _run(main)
    if as_json:
        _json(rows)
    else:
        table = Table("dag_id", "tasks", "last run", "state", "file")
        for row in rows:
            table.add_row(
                row.dag_id,
                str(row.tasks),
                row.last_run_id or "",
                row.last_run_state or "",
                row.fileloc,
            )
        console.print(table)
    for path, error in errors.items():
        err_console.print(
            f"[red]DAG file {escape(path)} failed to import[/]: {escape(error_summary(error))}",
            highlight=False,
            soft_wrap=True,
        )
    if errors:
        sys.exit(1)


@dags.command("trigger")
@click.argument("dag_id", type=TEXT)
@_parse_dags_option
@click.option("--run-id", type=TEXT, help="Default: manual__<time>.")
@click.option("--conf", type=TEXT, help="JSON object handed to tasks as context['conf'].")
@click.option(
    "--wait",
    is_flag=True,
    help="Wait for the run to end; exit 0 on success, 1 when it failed.",
)
@click.option(
    "--timeout", type=SECONDS, help="With --wait: give up after this many seconds (exit 3)."
)
@click.pass_context
def dags_trigger(
    ctx: click.Context,
    dag_id: str,
    dags_folder: str | None,
    run_id: str | None,
    conf: str | None,
    wait: bool,
    timeout: float | None,
) -> None:
    """Create a run of DAG_ID.

    With --dags (or DEFERRAL_DAGS_FOLDER) the folder is parsed here first, and a DAG missing
    from it is reported with the files that failed to import. Without one, a DAG the database
    does not know yet makes the running scheduler rescan its folder at once.

    Exit codes: 0 the run was created (with --wait: it succeeded), 1 it failed, 2 it could
    not be created (unknown DAG, duplicate run id, bad --conf), 3 --timeout passed first.
    """
    settings = _settings(ctx).replace(dags_folder=dags_folder)
    check_dags_folder(settings)
    try:
        conf_obj = msgspec.json.decode(conf) if conf else {}
    except msgspec.DecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--conf") from None
    if not isinstance(conf_obj, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--conf")
    problem = _json_text_problem(conf_obj)
    if problem:
        raise click.BadParameter(f"a string in it {problem}", param_hint="--conf")
    from engine.client import trigger_dag

    try:
        outcome = _run(trigger_dag, settings, dag_id, run_id, conf_obj, wait, timeout)
    except (LookupError, ValueError) as exc:
        # Not wrapped: the message names files, which must stay whole to be copied.
        message = str(exc.args[0] if exc.args else exc)
        err_console.print(f"[red]error[/]: {escape(message)}", highlight=False, soft_wrap=True)
        sys.exit(2)
    console.print(f"run [bold]{dag_id}/{outcome.run_id}[/]: {outcome.state}")
    if outcome.tasks:
        table = Table("task_id", "state", "try", "error")
        for task in outcome.tasks:
            error = (task.error or "").strip().splitlines()
            table.add_row(
                task.task_id, task.state, str(task.try_number), error[-1] if error else ""
            )
        console.print(table)
    if wait:
        sys.exit({"success": 0, "failed": 1}.get(outcome.state, 3))


@cli.group()
def tasks() -> None:
    """Inspect task instances."""


@tasks.command("list")
@click.option("--dag", "dag_id", type=TEXT, help="Only this DAG.")
@click.option("--run", "run_id", type=TEXT, help="Only this run id.")
@click.option("--state", type=TEXT, help="Only this state.")
@click.option("--limit", type=click.IntRange(min=0), default=10_000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@click.pass_context
def tasks_list(
    ctx: click.Context,
    dag_id: str | None,
    run_id: str | None,
    state: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List task instances with their state, try number and result."""
    settings = _settings(ctx)

    async def main() -> list[TaskInstance]:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            return await store.list_task_instances(
                dag_id=dag_id, run_id=run_id, state=state, limit=limit
            )
        finally:
            await store.close()

    rows = _run(main)
    results = [_decode_result(row.result) for row in rows]
    if as_json:
        _json(
            [
                msgspec.structs.replace(
                    msgspec.convert(row, _ListedTask, from_attributes=True), result=result
                )
                for row, result in zip(rows, results, strict=True)
            ]
        )
        return
    table = Table("dag_id", "run_id", "task_id", "state", "try", "result")
    for row, value in zip(rows, results, strict=True):
        result = "" if value is None else repr(value)
        table.add_row(
            row.dag_id,
            row.run_id,
            row.task_id,
            row.state,
            str(row.try_number),
            result[:60],
        )
    console.print(table)


@cli.group()
def triggers() -> None:
    """Inspect triggers and triggerers."""


@triggers.command("list")
@click.option("--limit", type=click.IntRange(min=0), default=10_000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@click.pass_context
def triggers_list(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List waiting triggers, their owner and how many tasks wait on each."""
    settings = _settings(ctx)

    async def main() -> tuple[list[TriggerRow], list[TriggererRow]]:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            return await store.list_triggers(limit), await store.list_triggerers()
        finally:
            await store.close()

    rows, triggerers_ = _run(main)
    if as_json:
        _json(rows)
        return
    table = Table("id", "classpath", "triggerer", "waiting", "timeout_at")
    for row in rows:
        table.add_row(
            str(row.id),
            row.classpath,
            str(row.triggerer_id or "-"),
            str(row.waiting),
            str(row.timeout_at or ""),
        )
    console.print(table)
    summary = Table("triggerer", "host", "pid", "capacity", "held", "lease")
    for t in triggerers_:
        summary.add_row(
            str(t.id),
            t.hostname,
            str(t.pid),
            str(t.capacity),
            str(t.held),
            "expired" if t.expired else "live",
        )
    console.print(summary)


@cli.group()
def db() -> None:
    """The database."""


@db.command("migrate")
@click.pass_context
def db_migrate(ctx: click.Context) -> None:
    """Create or upgrade the schema."""
    applied = _run(_migrate, _settings(ctx))
    console.print(f"applied migrations: {applied}" if applied else "schema is up to date")


@db.command("url")
@click.pass_context
def db_url(ctx: click.Context) -> None:
    """Print the database URL (starting the embedded server if needed)."""
    from engine.store import database_url

    click.echo(database_url(_settings(ctx)))


# -- demo and benchmarks -------------------------------------------------------------------


@cli.command()
@click.option(
    "--sensors",
    type=click.IntRange(min=1),
    default=300,
    show_default=True,
    help="Deferrable timer sensors in the demo DAG.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="Submit-and-wait tasks on a local job API.",
)
@click.option(
    "--slots", type=click.IntRange(min=1), default=4, show_default=True, help="Worker slots."
)
@click.option(
    "--window",
    type=SECONDS,
    default=10.0,
    show_default=True,
    help="Timers fire between WINDOW and 2*WINDOW seconds after the start.",
)
@click.pass_context
def demo(ctx: click.Context, sensors: int, jobs: int, slots: int, window: float) -> None:
    """Run the bundled demo DAG on the embedded database and print a summary."""
    from engine.demo.run import run_demo

    ok = run_demo(_settings(ctx), sensors=sensors, jobs=jobs, slots=slots, window_s=window)
    sys.exit(0 if ok else 1)


def _add_keys() -> None:
    from engine.cli_keys import keys

    cli.add_command(keys, "keys")


_add_keys()


def main() -> None:
    cli(prog_name="deferral")


if __name__ == "__main__":  # pragma: no cover
    main()
