"""``deferral tasks test``: run one task in this process on a scratch database
(:mod:`engine.testing.tasktest`). Added to the ``tasks`` group by root.py."""

from __future__ import annotations

import contextlib
import datetime as dt
import difflib
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import click
import msgspec

from engine.cli.common import (
    TEXT,
    _Folder,
    _json_text_problem,
    _run,
    _settings,
    _usage_exit,
    require_dags_folder,
)
from engine.dags.dagbag import DagBag
from engine.dags.importerrors import error_summary

if TYPE_CHECKING:
    from engine.testing.tasktest import TaskTestReport


def _close_names(name: str, known: Iterable[str]) -> str:
    """``; did you mean a, b?`` (or the known names when none is close), for an error."""
    names = sorted(known)
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    if close:
        return f"; did you mean {', '.join(close)}?"
    if not names:
        return ""
    shown = ", ".join(names[:10]) + (f" (and {len(names) - 10} more)" if len(names) > 10 else "")
    return f"; known: {shown}"


def _parse_logical_date(value: str | None) -> dt.datetime | None:
    if value is None:
        return None
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not an ISO 8601 date or time (2026-01-31, 2026-01-31T06:00:00+00:00)",
            param_hint="--logical-date",
        ) from None
    return when  # (naive: in the DAG's time zone, as `dags trigger --logical-date` reads it)


def _parse_conf(value: str | None) -> dict[str, Any]:
    try:
        conf = msgspec.json.decode(value) if value else {}
    except msgspec.DecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--conf") from None
    if not isinstance(conf, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--conf")
    problem = _json_text_problem(conf)
    if problem:
        raise click.BadParameter(f"a string in it {problem}", param_hint="--conf")
    return conf


def _load(folder: str, dag_id: str, task_id: str, timeout_s: float) -> DagBag:
    """The parsed folder; exit 2 naming close names when the DAG or task is not there."""
    bag = DagBag(folder, processor_timeout_s=timeout_s)
    dags = bag.collect()
    if dag_id not in dags:
        problem = f"no DAG {dag_id!r} in {bag.folder}{_close_names(dag_id, dags)}"
        for path, error in sorted(bag.import_errors.items()):
            problem += f"\n  {path} failed to import: {error_summary(error)}"
        _usage_exit(problem)
    tasks = dags[dag_id].tasks
    if task_id not in tasks:
        _usage_exit(f"DAG {dag_id!r} has no task {task_id!r}{_close_names(task_id, tasks)}")
    if hasattr(tasks[task_id], "unmap"):
        _usage_exit(
            f"task {task_id!r} is mapped (expand): tasks test runs one task instance of an "
            "unmapped task; trigger a run of the DAG instead (deferral dags trigger --wait)"
        )
    return bag


@click.command("test")
@click.argument("dag_id", type=TEXT)
@click.argument("task_id", type=TEXT)
@click.option(
    "--dags",
    "dags_folder",
    envvar="DEFERRAL_DAGS_FOLDER",
    type=_Folder(),
    help="Folder of DAG files (also on sys.path for trigger classes).",
)
@click.option(
    "--logical-date",
    type=TEXT,
    help="ISO 8601 date or time of the run (naive: in the DAG's time zone); default: now. "
    "Its data interval is inferred from the schedule, as `dags trigger` infers it.",
)
@click.option("--conf", type=TEXT, help="JSON object handed to the task as context['conf'].")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: log, deferrals, outcome.")
@click.pass_context
def tasks_test(
    ctx: click.Context,
    dag_id: str,
    task_id: str,
    dags_folder: str | None,
    logical_date: str | None,
    conf: str | None,
    as_json: bool,
) -> None:
    """Run TASK_ID of DAG_ID once, in this process, on a scratch database.

    The DAGs folder is parsed, a fresh database is created (on the embedded server, or next to
    DEFERRAL_DATABASE_URL) and dropped afterwards, and a worker and a triggerer run here until
    the task ends: a deferral is handed to the triggerer and resumed at once when its trigger
    fires. Upstream tasks are ignored and retries are not used (one try). Prints what the task
    and its trigger log, each deferral ("deferred on CLASSPATH KWARGS", secret-looking values
    masked) and resume ("resumed at METHOD with EVENT"), then the state, try, result (JSON) and
    the error with its traceback.

    Exit codes: 0 the task succeeded (or was skipped), 1 it failed, 2 usage errors (no DAGs
    folder, unknown DAG or task, bad --logical-date or --conf, no scratch database), 130
    interrupted (Ctrl-C or SIGTERM) before the task ended.
    """
    settings = _settings(ctx).replace(dags_folder=dags_folder)
    when = _parse_logical_date(logical_date)
    conf_obj = _parse_conf(conf)
    require_dags_folder(settings, "tasks test")
    assert settings.dags_folder is not None
    folder = str(Path(settings.dags_folder).expanduser())
    bag = _load(folder, dag_id, task_id, settings.dag_file_processor_timeout_s)

    from engine.testing.tasktest import ScratchDatabaseError, run_task_test, show

    async def until_signalled() -> TaskTestReport | None:
        """The report, or None when SIGINT or SIGTERM came first: the run is cancelled, and
        the scratch database dropped, before the command exits."""
        found: list[TaskTestReport] = []
        failed: list[Exception] = []
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for signum in signals:
                        interrupted.append(signal.Signals(signum).name)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            try:
                found.append(
                    await run_task_test(
                        settings,
                        bag,
                        dag_id,
                        task_id,
                        logical_date=when,
                        conf=conf_obj,
                        on_line=None if as_json else click.echo,
                    )
                )
            except Exception as exc:
                # Raised after the group, unwrapped: the task group would put it in an
                # ExceptionGroup, which the handlers of usage and database errors miss.
                failed.append(exc)
            tg.cancel_scope.cancel()
        if failed:
            raise failed[0]
        return found[0] if found else None

    interrupted: list[str] = []
    # With --json, stdout is the report alone: what the task prints goes to stderr.
    redirect = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    try:
        with redirect:
            report = _run(until_signalled)
    except ScratchDatabaseError as exc:
        _usage_exit(str(exc))
    if report is None:
        click.echo(
            f"interrupted ({', '.join(interrupted)}) before the task ended; the scratch "
            "database was dropped",
            err=True,
        )
        sys.exit(130)
    if as_json:
        click.echo(msgspec.json.encode(report).decode())
    else:
        click.echo(f"state: {report.state}")
        click.echo(f"try: {report.try_number}")
        click.echo(f"result: {show(report.result)}")
        if report.error:
            click.echo(f"error:\n{report.error}")
    sys.exit(1 if report.state == "failed" else 0)
