"""``deferral runs``: inspect DAG runs."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

import click
import msgspec
from rich.table import Table

from engine.cli.common import TEXT, _json, _run, _settings, console

if TYPE_CHECKING:
    from engine.store.models import RunRow

#: The states a run can be in.
RUN_STATES = ("queued", "running", "success", "failed")


class _ListedRun(msgspec.Struct, frozen=True, kw_only=True):
    """A run in ``runs list --json``: these keys."""

    dag_id: str
    run_id: str
    run_type: str
    logical_date: dt.datetime
    data_interval_start: dt.datetime | None
    data_interval_end: dt.datetime | None
    state: str


@click.group()
def runs() -> None:
    """Inspect DAG runs."""


def _when(value: dt.datetime | None) -> str:
    return "" if value is None else value.astimezone(dt.UTC).isoformat()


@runs.command("list")
@click.option("--dag", "dag_id", type=TEXT, help="Only this DAG.")
@click.option("--state", type=click.Choice(RUN_STATES), help="Only runs in this state.")
@click.option("--limit", type=click.IntRange(min=0), default=10_000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@click.pass_context
def runs_list(
    ctx: click.Context, dag_id: str | None, state: str | None, limit: int, as_json: bool
) -> None:
    """List runs, latest logical date first: type (scheduled, manual, backfill), logical
    date, data interval and state."""
    settings = _settings(ctx)

    async def main() -> list[RunRow]:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            return await store.list_runs(dag_id=dag_id, state=state, limit=limit)
        finally:
            await store.close()

    rows = _run(main)
    if as_json:
        _json([msgspec.convert(row, _ListedRun, from_attributes=True) for row in rows])
        return
    table = Table(
        "dag_id", "run_id", "run_type", "logical_date", "data_interval_start",
        "data_interval_end", "state",
    )  # fmt: skip
    for row in rows:
        table.add_row(
            row.dag_id,
            row.run_id,
            row.run_type,
            _when(row.logical_date),
            _when(row.data_interval_start),
            _when(row.data_interval_end),
            row.state,
        )
    console.print(table)
