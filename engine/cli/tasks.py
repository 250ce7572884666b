"""``deferral tasks``: inspect task instances."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from engine.cli.common import TEXT, _json, _run, _settings, _usage_exit, console
from engine.cli.listing import (
    TASK_STATE,
    filtered,
    listed_task,
    print_table,
    task_table,
    wide_option,
)
from engine.client.runsel import SELECTOR_HELP, resolve_run, resolve_runs

if TYPE_CHECKING:
    from engine.store.models import TaskInstance


@click.group()
def tasks() -> None:
    """Inspect task instances; clear and mark them."""


@tasks.command("list")
@click.option("--dag", "dag_id", type=TEXT, help="Only this DAG.")
@click.option(
    "--run",
    "run_id",
    type=TEXT,
    metavar="RUN",
    help=f"Only this run: {SELECTOR_HELP} (with --dag: of that DAG).",
)
@click.option("--state", type=TASK_STATE, help="Only this state.")
@click.option(
    "--task",
    "task",
    type=TEXT,
    metavar="TASK",
    help="Only this task's instances (all of a mapped task's; TASK[3]: instance 3 alone).",
)
@click.option(
    "--map-index",
    "map_index",
    type=click.IntRange(min=0),
    help="Only this instance of mapped tasks (the same as --task TASK[N]).",
)
@click.option("--limit", type=click.IntRange(min=0), default=10_000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@wide_option
@click.pass_context
def tasks_list(
    ctx: click.Context,
    dag_id: str | None,
    run_id: str | None,
    state: str | None,
    task: str | None,
    map_index: int | None,
    limit: int,
    as_json: bool,
    wide: bool,
) -> None:
    """List task instances: state (and when a retry is due), try, when the first try started,
    how long the task has taken, its result as JSON and the current try's error.

    --json keys: dag_id, run_id, task_id, state, try_number, result, error (the current
    try's; null until it fails), trigger_id, started_at (the first try's start, kept across
    deferrals and retries), ended_at, retry_at (null unless up_for_retry or
    up_for_reschedule), try_started_at, duration_s, previous_error (the try before's error),
    waiting_reason (why a waiting task is not running, as `tasks why` says it; null for a task
    that runs or has ended), xcom (the current try's XComs by key, each
    {"bytes": n, "preview": "..."}; `tasks xcom` prints them in full), map_index (the
    instance of a mapped task, 0..n-1; -1: not mapped). The table names a mapped instance
    TASK[3].
    """
    settings = _settings(ctx)
    from engine.client.mapaddr import BadAddress, parse_task

    wanted: tuple[str | None, int | None] = (None, map_index)
    if task is not None:
        try:
            task_id, index = parse_task(task, map_index)
        except BadAddress as exc:
            _usage_exit(str(exc))
        # (TASK alone: all its instances, mapped or not)
        wanted = (task_id, None if index < 0 and map_index is None else index)

    def chosen(row: TaskInstance) -> bool:
        return (wanted[0] is None or row.task_id == wanted[0]) and (
            wanted[1] is None or row.map_index == wanted[1]
        )

    async def main() -> tuple[list[TaskInstance], dict[int, str], dict[int, Any]]:
        from engine.client.why import WAITING_STATES, waiting_reasons
        from engine.client.xcoms import summaries
        from engine.store import open_store

        store = await open_store(settings)
        try:
            run = run_id
            if run_id is not None:
                run = (await resolve_runs(store, dag_id, run_id))[0].run_id
            rows = await store.list_task_instances(
                dag_id=dag_id,
                run_id=run,
                state=state,
                limit=limit if wanted == (None, None) else 10**9,
            )
            rows = [row for row in rows if chosen(row)][:limit]
            # One statement for all the waiting ones, and only with --json (the table has no
            # column for it); one more for the XComs of them all.
            waiting = [row.id for row in rows if row.state in WAITING_STATES]
            reasons = await waiting_reasons(store, waiting, settings) if as_json else {}
            xcoms: dict[int, Any] = await summaries(store, rows) if as_json else {}
            return rows, reasons, xcoms
        finally:
            await store.close()

    try:
        rows, reasons, xcoms = _run(main)
    except LookupError as exc:  # (a RUN that names no run, or several)
        _usage_exit(str(exc))
    listed = [
        listed_task(row, waiting_reason=reasons.get(row.id), xcom=xcoms.get(row.id)) for row in rows
    ]
    if as_json:
        _json(listed)
        return
    print_table(
        task_table(listed, with_run=True, wide=wide),
        wide=wide,
        empty=filtered(
            "task instances",
            dag_id=dag_id,
            run_id=run_id,
            state=state,
            task=task,
            map_index=map_index,
        ),
    )


#: ``--map-index N``: which instance of a mapped task (the same as TASK[N]).
map_index_option = click.option(
    "--map-index",
    "map_index",
    type=click.IntRange(min=0),
    help="Which instance of a mapped task (the same as writing TASK[N]).",
)


@tasks.command("why")
@click.argument("dag_id", type=TEXT, metavar="DAG")
@click.argument("run_id", type=TEXT, metavar="RUN")
@click.argument("task_id", type=TEXT, metavar="TASK")
@map_index_option
@click.pass_context
def tasks_why(
    ctx: click.Context, dag_id: str, run_id: str, task_id: str, map_index: int | None
) -> None:
    """Say why a task instance is not running: the first reason that holds of upstream tasks
    not done, the run not started (max_active_runs), its pool (missing, too small, full), the
    DAG's max_active_tasks, the task's max_active_tis_per_dag, the global parallelism, no live
    worker serving its queue, a retry not due yet, the trigger it is deferred on (its
    triggerer, since when, its next deadline) or no triggerer taking that trigger; else it
    waits for a free worker slot. For a task that runs or has ended: its state.

    RUN is a run id, a unique prefix of one, a logical date (2026-11-20, 2026-11-20T06:00) or
    `latest`. The answer starts with a label naming the reason (`pool full:`, `retry not
    due:`, ...).
    The parallelism compared with is this command's setting (give it the workers' value).
    TASK[3] (or --map-index 3) asks about instance 3 of a mapped task.
    Exit code 2: no such run, task or mapped instance.
    """
    settings = _settings(ctx)
    from engine.client.mapaddr import BadAddress, check_instance, parse_task
    from engine.client.why import why_not_running

    try:
        task_id, index = parse_task(task_id, map_index)
    except BadAddress as exc:
        _usage_exit(str(exc))

    async def main() -> str:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            run = await resolve_run(store, dag_id, run_id)
            await check_instance(store, dag_id, run.run_id, task_id, index)
            return await why_not_running(
                store, dag_id, run.run_id, task_id, settings, map_index=index
            )
        finally:
            await store.close()

    try:
        answer = _run(main)
    except LookupError as exc:  # (no such run or task: NoSuchTask, NoSuchRun, ...)
        _usage_exit(str(exc))
    console.print(answer, markup=False, highlight=False, soft_wrap=True)
