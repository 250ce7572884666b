"""``deferral runs``: list DAG runs and wait for one to end."""

from __future__ import annotations

import shlex
import sys
from typing import TYPE_CHECKING, Any

import click
import msgspec
from rich.table import Table

from engine.cli.common import SECONDS, TEXT, _json, _run, _settings, _usage_exit
from engine.cli.listing import (
    RUN_STATE,
    WAIT_EXIT,
    cell,
    filtered,
    fmt_time,
    interrupted_wait,
    mask_secrets,
    print_table,
    show_outcome,
    wait_ends_on_interrupt,
    wide_option,
)
from engine.client.runsel import resolve_run

if TYPE_CHECKING:
    from engine.store.models import DagRunSummary
    from engine.store.runselect import SelectedRun


@click.group()
def runs() -> None:
    """List DAG runs and wait for them; clear and mark them."""


@runs.command("list")
@click.option("--dag", "dag_id", type=TEXT, help="Only this DAG.")
@click.option("--state", type=RUN_STATE, help="Only runs in this state.")
@click.option("--limit", type=click.IntRange(min=0), default=10_000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@wide_option
@click.pass_context
def runs_list(
    ctx: click.Context,
    dag_id: str | None,
    state: str | None,
    limit: int,
    as_json: bool,
    wide: bool,
) -> None:
    """List DAG runs, newest first: type (scheduled, manual, backfill, asset_triggered),
    logical date, data interval, state, and how many of their tasks are in each state.

    --json keys: dag_id, run_id, run_type, logical_date, data_interval_start,
    data_interval_end, state, conf (secrets masked), created_at, ended_at, tasks (task
    instance counts by state), triggering_asset_events (an asset-triggered run's events by
    asset name: lists of {id, asset, uri, timestamp, extra, source_kind, source_dag_id,
    source_run_id, source_task_id, source_map_index, source_name}; {} for other runs).
    """
    settings = _settings(ctx)

    async def main() -> tuple[list[DagRunSummary], dict[tuple[str, str], Any]]:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            found = await store.list_dag_runs(dag_id=dag_id, state=state, limit=limit)
            triggered = [(r.dag_id, r.run_id) for r in found if r.run_type == "asset_triggered"]
            events = await store.runs_asset_events(triggered) if as_json else {}
            return found, events
        finally:
            await store.close()

    # A run's conf is shown with its secrets masked (engine.masking).
    found, events = _run(main)
    rows = [msgspec.structs.replace(row, conf=mask_secrets(row.conf)) for row in found]
    if as_json:
        _json([_with_events(row, events.get((row.dag_id, row.run_id), [])) for row in rows])
        return
    table = Table(
        "dag_id", "run_id", "run_type", "state", "logical_date", "data_interval_start",
        "data_interval_end", "created_at", "ended_at", "tasks",
    )  # fmt: skip
    for row in rows:
        counts = ", ".join(f"{n} {s}" for s, n in sorted(row.tasks.items()))
        table.add_row(
            cell(row.dag_id),
            cell(row.run_id),
            cell(row.run_type),
            cell(row.state),
            cell(fmt_time(row.logical_date)),
            cell(fmt_time(row.data_interval_start)),
            cell(fmt_time(row.data_interval_end)),
            cell(fmt_time(row.created_at)),
            cell(fmt_time(row.ended_at)),
            cell(counts),
        )
    print_table(table, wide=wide, empty=filtered("runs", dag_id=dag_id, state=state))


def _with_events(row: DagRunSummary, events: list[Any]) -> dict[str, Any]:
    """A run's ``--json`` object: its summary and the asset events that triggered it."""
    from engine.cli.assets import listed_event

    by_asset: dict[str, list[Any]] = {}
    for event in events:
        by_asset.setdefault(event.asset, []).append(listed_event(event))
    return {**msgspec.structs.asdict(row), "triggering_asset_events": by_asset}


@runs.command("wait")
@click.argument("ids", nargs=-1, type=TEXT, metavar="[DAG_ID] RUN")
@click.option("--timeout", type=SECONDS, help="Give up after this many seconds (exit 3).")
@wide_option
@click.pass_context
def runs_wait(ctx: click.Context, ids: tuple[str, ...], timeout: float | None, wide: bool) -> None:
    """Wait for run RUN (of DAG_ID) to end, then show its tasks (as `dags trigger --wait`
    does). RUN is a run id, a unique prefix of one, a logical date (2026-11-20,
    2026-11-20T06:00) or `latest`; DAG_ID may be left out when RUN names the run of one DAG
    only. Ctrl-C stops only the wait: the run goes on.

    Exit codes: 0 the run succeeded, 1 it failed, 2 no such run, 3 --timeout passed first,
    130 interrupted.
    """
    if not 1 <= len(ids) <= 2:
        raise click.UsageError(f"expected RUN or DAG_ID RUN, got {len(ids)} argument(s)", ctx=ctx)
    settings = _settings(ctx)
    from engine.client.runs import wait_run

    selector = ids[-1]
    dag_id = ids[0] if len(ids) == 2 else None

    async def find() -> SelectedRun:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            again = f"deferral runs wait DAG_ID {shlex.quote(selector)}"
            return await resolve_run(store, dag_id, selector, with_dag=again)
        finally:
            await store.close()

    run_id = selector
    try:
        run = _run(find)
        dag_id, run_id = run.dag_id, run.run_id
        with wait_ends_on_interrupt(dag_id, run_id):
            outcome = _run(wait_run, settings, dag_id, run_id, timeout)
    except LookupError as exc:
        _usage_exit(str(exc.args[0] if exc.args else exc))
    except KeyboardInterrupt:
        if dag_id is None:
            raise
        interrupted_wait(dag_id, run_id)
    show_outcome(dag_id, outcome, wide=wide)
    sys.exit(WAIT_EXIT.get(outcome.state, 3))
