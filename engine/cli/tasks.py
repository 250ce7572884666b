"""``deferral tasks``: inspect task instances."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

import click
import msgspec
from rich.table import Table

from engine.cli.common import TEXT, _json, _run, _settings, console, decode_result

if TYPE_CHECKING:
    from engine.store.models import TaskInstance


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
    #: What the templated fields rendered to at the start of the latest try; None: nothing.
    rendered: dict[str, Any] | None = None


@click.group()
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
    results = [decode_result(row.result) for row in rows]
    if as_json:
        _json(
            [
                msgspec.structs.replace(
                    msgspec.convert(row, _ListedTask, from_attributes=True),
                    result=result,
                    rendered=row.rendered_fields,
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
