"""``deferral dags``: list and trigger DAGs."""

from __future__ import annotations

import datetime as dt
import shlex
import sys
from typing import TYPE_CHECKING

import click
import msgspec
from rich.markup import escape

from engine.cli.common import (
    SECONDS,
    TEXT,
    _json_text_problem,
    _parse_dags_option,
    _run,
    _settings,
    check_dags_folder,
    console,
    err_console,
)
from engine.cli.listing import (
    WAIT_EXIT,
    interrupted_wait,
    show_outcome,
    wait_ends_on_interrupt,
    wide_option,
)
from engine.dags.dagbag import DagBag
from engine.store import DuplicateRun

if TYPE_CHECKING:
    from engine.client.runs import RunOutcome


class _IsoTime(click.ParamType):  # type: ignore[type-arg]
    """An ISO 8601 date or date and time (naive: in the DAG's time zone)."""

    name = "ISO"

    def convert(self, value: object, param: click.Parameter | None, ctx: object) -> dt.datetime:
        if isinstance(value, dt.datetime):
            return value
        try:
            return dt.datetime.fromisoformat(str(value))
        except ValueError:
            self.fail(
                f"{value!r} is not an ISO 8601 date or time (2024-01-31, 2024-01-31T03:00, "
                "2024-01-31T03:00:00+01:00)",
                param,
                None,
            )


ISO_TIME = _IsoTime()


def _when(value: dt.datetime | None) -> str:
    return "" if value is None else value.astimezone(dt.UTC).isoformat()


@click.group()
def dags() -> None:
    """List, trigger, pause and backfill DAGs."""


@dags.command("trigger")
@click.argument("dag_id", type=TEXT)
@_parse_dags_option
@click.option("--run-id", type=TEXT, help="Default: manual__<logical date>.")
@click.option(
    "--logical-date",
    type=ISO_TIME,
    help="The run's logical date (ISO 8601; naive: in the DAG's time zone). Default: now. "
    "Its data interval is inferred from the schedule.",
)
@click.option(
    "--conf",
    type=TEXT,
    help="JSON object handed to tasks as context['conf']; a key overrides the DAG's param of "
    "the same name.",
)
@click.option(
    "--wait",
    is_flag=True,
    help="Wait for the run to end; exit 0 on success, 1 when it failed.",
)
@click.option(
    "--timeout", type=SECONDS, help="With --wait: give up after this many seconds (exit 3)."
)
@wide_option
@click.pass_context
def dags_trigger(
    ctx: click.Context,
    dag_id: str,
    dags_folder: str | None,
    run_id: str | None,
    logical_date: dt.datetime | None,
    conf: str | None,
    wait: bool,
    timeout: float | None,
    wide: bool,
) -> None:
    """Create a manual run of DAG_ID. It waits as queued while the DAG has max_active_runs
    runs running.

    With --dags (or DEFERRAL_DAGS_FOLDER) the folder is parsed here first, and a DAG missing
    from it is reported with the files that failed to import. Without one, a DAG the database
    does not know yet makes the running scheduler rescan its folder at once.

    With --wait, Ctrl-C stops only the wait: the run goes on, and `deferral runs wait DAG_ID
    RUN_ID` follows it again.

    Exit codes: 0 the run was created (with --wait: it succeeded), 1 it failed, 2 it could
    not be created (unknown DAG, duplicate run id, bad --conf), 3 --timeout passed first,
    130 interrupted while waiting.
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
    from engine.client.runs import trigger_dag, wait_run

    # Created first, then waited for: a Ctrl-C once the run exists names the run to follow.
    created: RunOutcome | None = None
    try:
        created = _run(trigger_dag, settings, dag_id, run_id, conf_obj, False, None, logical_date)
        if not wait:
            show_outcome(dag_id, created)
            return
        with wait_ends_on_interrupt(dag_id, created.run_id):
            outcome = _run(wait_run, settings, dag_id, created.run_id, timeout)
    except (LookupError, ValueError) as exc:
        # Not wrapped: the message names files, which must stay whole to be copied.
        message = str(exc.args[0] if exc.args else exc)
        if isinstance(exc, DuplicateRun) and run_id:
            message += (
                f"; to wait for it: deferral runs wait {shlex.quote(dag_id)} {shlex.quote(run_id)}"
            )
        err_console.print(f"[red]error[/]: {escape(message)}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        if created is None or not wait:
            raise
        interrupted_wait(dag_id, created.run_id)
    show_outcome(dag_id, outcome, wide=wide)
    sys.exit(WAIT_EXIT.get(outcome.state, 3))


def _set_paused(ctx: click.Context, dag_id: str, paused: bool) -> None:
    settings = _settings(ctx)

    async def main() -> bool:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            return await store.set_dag_paused(dag_id, paused)
        finally:
            await store.close()

    if not _run(main):
        err_console.print(
            f"[red]error[/]: unknown DAG {escape(dag_id)!r}: no DAG of that id has been recorded",
            highlight=False,
        )
        sys.exit(2)
    console.print(f"DAG [bold]{escape(dag_id)}[/] {'paused' if paused else 'unpaused'}")


@dags.command("pause")
@click.argument("dag_id", type=TEXT)
@click.pass_context
def dags_pause(ctx: click.Context, dag_id: str) -> None:
    """Pause DAG_ID: the scheduler creates no runs of it (manual triggers still run)."""
    _set_paused(ctx, dag_id, True)


@dags.command("unpause")
@click.argument("dag_id", type=TEXT)
@click.pass_context
def dags_unpause(ctx: click.Context, dag_id: str) -> None:
    """Unpause DAG_ID: scheduled runs resume (with catchup, the missed intervals too)."""
    _set_paused(ctx, dag_id, False)


@dags.command("backfill")
@click.argument("dag_id", type=TEXT)
@_parse_dags_option
@click.option("--start-date", type=ISO_TIME, required=True, help="First logical date (ISO 8601).")
@click.option(
    "--end-date", type=ISO_TIME, required=True, help="Last logical date (ISO 8601, included)."
)
@click.option(
    "--reprocess-behavior",
    type=click.Choice(["none", "failed", "completed"]),
    default="none",
    show_default=True,
    help="Dates that have a run already: leave them (none), run the failed ones again "
    "(failed), or run every ended one again (completed).",
)
@click.option(
    "--max-active-runs",
    type=click.IntRange(min=1),
    help="Runs of the backfill queued or running at once. Default: the DAG's max_active_runs.",
)
@click.option("--wait", is_flag=True, help="Wait until every run has ended; exit 1 if any failed.")
@click.pass_context
def dags_backfill(
    ctx: click.Context,
    dag_id: str,
    dags_folder: str | None,
    start_date: dt.datetime,
    end_date: dt.datetime,
    reprocess_behavior: str,
    max_active_runs: int | None,
    wait: bool,
) -> None:
    """Create a backfill run of DAG_ID for every logical date of its schedule from
    --start-date to --end-date (both included; naive times are in the DAG's time zone).

    Resumable: run the same command again after an interruption and it creates only the
    runs still missing. Without --wait it returns once every run is created (it creates them
    as earlier ones end, --max-active-runs at a time).

    Exit codes: 0 done, 1 a run failed (with --wait), 2 bad arguments or unknown DAG.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from engine.scheduler.backfill import BackfillProgress, backfill
    from engine.store import UnknownDag

    settings = _settings(ctx).replace(dags_folder=dags_folder)
    check_dags_folder(settings)

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        console=err_console,
        transient=False,
    ) as bar:
        task = bar.add_task(f"backfill {dag_id}", total=None, detail="")

        def show(p: BackfillProgress) -> None:
            done = p.ended + p.skipped if wait else p.created + p.skipped
            detail = f"created {p.created}, skipped {p.skipped}, ended {p.ended}"
            if p.failed:
                detail += f", [red]failed {p.failed}[/]"
            bar.update(task, total=p.total, completed=done, detail=detail)

        async def main() -> BackfillProgress:
            from engine.scheduler.dagsync import sync_dags
            from engine.store import open_store

            store = await open_store(settings)
            try:
                if settings.dags_folder:
                    await sync_dags(
                        store,
                        DagBag(
                            settings.dags_folder,
                            processor_timeout_s=settings.dag_file_processor_timeout_s,
                        ),
                    )
                return await backfill(
                    store,
                    dag_id,
                    start_date,
                    end_date,
                    reprocess=reprocess_behavior,  # type: ignore[arg-type]
                    max_active_runs=max_active_runs,
                    wait=wait,
                    on_progress=show,
                )
            finally:
                await store.close()

        try:
            result = _run(main)
        except (UnknownDag, ValueError) as exc:
            bar.stop()
            message = str(exc.args[0] if exc.args else exc)
            err_console.print(f"[red]error[/]: {escape(message)}", highlight=False, soft_wrap=True)
            sys.exit(2)
    console.print(
        f"backfill [bold]{escape(dag_id)}[/]: {result.total} logical date(s), "
        f"{result.created} run(s) created or queued again, {result.skipped} left as they were"
        + (f", {result.ended} ended, {result.failed} failed" if wait else "")
    )
    if wait and result.failed:
        sys.exit(1)
