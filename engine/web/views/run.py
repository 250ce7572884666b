"""A run's pages: the run (its tasks a page at a time, by state, and its graph) and its Gantt
view (each try's queued, running and deferred spans on one time axis)."""

from __future__ import annotations

from typing import Any

from engine.store import Store
from engine.store.models import AssetEventRow, DagRun, GridCell
from engine.web.graph import MAX_DRAWN_TASKS, graph
from engine.web.paging import Pager, shortened
from engine.web.render import _age, _when, masked, pretty
from engine.web.views.common import Column, Link, NotFound, Table, state_square, task_url, url
from engine.web.views.gantt import gantt
from engine.web.views.tries import SPAN_KINDS

__all__ = ["gantt_page", "run_page"]


def _duration(c: GridCell) -> str:
    return "-" if c.duration_s is None else _age(c.duration_s)


TASK_COLUMNS: list[Column] = [
    Column("task", lambda c: c.name),
    Column("state", lambda c: state_square(c.state)),
    Column("try", lambda c: c.try_number, numeric=True),
    Column("started", lambda c: _when(c.started_at)),
    Column("ended", lambda c: _when(c.ended_at)),
    Column("duration", _duration, numeric=True),
    Column("upstream", lambda c: shortened(c.upstream)),
]


#: The triggering asset events an asset-triggered run's page lists at most.
MAX_EVENTS_SHOWN = 100


def _source(e: AssetEventRow) -> str:
    if e.source_kind == "task":
        task = e.source_task_id or "?"
        if e.source_map_index is not None and e.source_map_index >= 0:
            task = f"{task}[{e.source_map_index}]"
        return f"task {e.source_dag_id}/{e.source_run_id}/{task}"
    return e.source_kind + (f" {e.source_name}" if e.source_name else "")


EVENT_COLUMNS: list[Column] = [
    Column("asset", lambda e: e.asset),
    Column("event", lambda e: e.id, numeric=True),
    Column("time", lambda e: _when(e.timestamp)),
    Column("source", _source),
    Column("extra", lambda e: pretty(masked(e.extra)) if e.extra else "-"),
]


async def _run(store: Store, dag_id: str, run_id: str) -> DagRun:
    run = await store.get_dag_run(dag_id, run_id)
    if run is None:
        raise NotFound(f"no run {run_id!r} of DAG {dag_id!r}")
    return run


def _links(dag_id: str, run_id: str) -> dict[str, str]:
    return {
        "run_href": url("/run", dag_id=dag_id, run_id=run_id),
        "gantt_href": url("/gantt", dag_id=dag_id, run_id=run_id),
        "dag_href": url("/dag", dag_id=dag_id),
    }


async def run_page(
    store: Store, dag_id: str, run_id: str, *, state: str | None = None, page: int | None = None
) -> dict[str, Any]:
    """The run, its tasks a page at a time (those in ``state`` only, when given) and its graph
    (summarized for a large DAG)."""
    run = await _run(store, dag_id, run_id)
    counts = await store.run_task_counts(run.id)
    shown = sum(counts.values()) if state is None else counts.get(state, 0)
    pager = Pager.of(
        page, shown, lambda n: url("/run", dag_id=dag_id, run_id=run_id, state=state, page=n)
    )
    cells = await store.run_task_grid(run.id, state=state, limit=pager.size, offset=pager.offset)
    dag = await store.get_dag(dag_id)
    every = None
    if dag is None or sum(counts.values()) <= MAX_DRAWN_TASKS:
        every = await store.run_task_grid(run.id)
    columns = [
        Column("task", lambda c: Link(c.name, task_url(dag_id, run_id, c.name))),
        *TASK_COLUMNS[1:],
    ]
    events = (
        await store.triggering_asset_events(dag_id, run_id)
        if run.run_type == "asset_triggered"
        else []
    )
    return {
        "asset_events": Table(EVENT_COLUMNS, events[:MAX_EVENTS_SHOWN]) if events else None,
        "asset_events_count": len(events),
        "title": f"Run {run_id}",
        "run": run,
        **_links(dag_id, run_id),
        "conf": pretty(masked(run.conf)),
        "grid": Table(columns, cells),
        "pager": pager,
        "state": state,
        "states": [
            (s, n, url("/run", dag_id=dag_id, run_id=run_id, state=s))
            for s, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        ],
        "graph": graph(
            dag.tasks
            if dag
            else [{"task_id": c.task_id, "upstream": c.upstream} for c in every or []],
            {c.task_id: c.state for c in every or []},
            lambda task_id: task_url(dag_id, run_id, task_id),
            counts=counts,
        ),
    }


async def gantt_page(
    store: Store, dag_id: str, run_id: str, *, page: int | None = None
) -> dict[str, Any]:
    """The run's Gantt view, its task instances a page at a time (in the DAG's order)."""
    run = await _run(store, dag_id, run_id)
    total = sum((await store.run_task_counts(run.id)).values())
    pager = Pager.of(page, total, lambda n: url("/gantt", dag_id=dag_id, run_id=run_id, page=n))
    records = await store.run_tries(run.id, dag_id, run_id, limit=pager.size, offset=pager.offset)
    order = list(dict.fromkeys(r.task_id or "" for r in records))
    return {
        "title": f"Gantt of run {run_id}",
        "run": run,
        **_links(dag_id, run_id),
        "pager": pager,
        "gantt": gantt(records, lambda t, n: task_url(dag_id, run_id, t, n), order),
        "span_kinds": SPAN_KINDS,
    }
