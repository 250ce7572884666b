"""``deferral tasks``: inspect task instances."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from engine.cli.common import TEXT, _json, _run, _settings
from engine.cli.listing import TASK_STATE, listed_task, print_table, task_table, wide_option

if TYPE_CHECKING:
    from engine.store.models import TaskInstance


@click.group()
def tasks() -> None:
    """Inspect task instances."""


@tasks.command("list")
@click.option("--dag", "dag_id", type=TEXT, help="Only this DAG.")
@click.option("--run", "run_id", type=TEXT, help="Only this run id.")
@click.option("--state", type=TASK_STATE, help="Only this state.")
@click.option("--limit", type=click.IntRange(min=0), default=10_000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@wide_option
@click.pass_context
def tasks_list(
    ctx: click.Context,
    dag_id: str | None,
    run_id: str | None,
    state: str | None,
    limit: int,
    as_json: bool,
    wide: bool,
) -> None:
    """List task instances: state (and when a retry is due), try, when the first try started,
    how long the task has taken, its result as JSON and the current try's error.

    --json keys: dag_id, run_id, task_id, state, try_number, result, error (the current
    try's; null until it fails), trigger_id, started_at (the first try's start, kept across
    deferrals and retries), ended_at, retry_at (null unless up_for_retry or
    up_for_reschedule), try_started_at, duration_s, previous_error (the try before's error).
    """
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

    listed = [listed_task(row) for row in _run(main)]
    if as_json:
        _json(listed)
        return
    print_table(task_table(listed, with_run=True, wide=wide), wide=wide)
