"""A DAG's page: its grid (runs x tasks, newest runs first, every run reachable a page at a
time, filtered by state, run type and logical date), its graph colored by the newest run the
grid shows, and for a DAG too large to draw, its tasks listed a page at a time."""

from __future__ import annotations

from typing import Any

from engine.store import Store
from engine.web.graph import MAX_DRAWN_TASKS, graph, ordered
from engine.web.paging import PAGE_ROWS, Pager, shortened
from engine.web.views.common import LEGEND, Column, NotFound, Table, run_url, task_url, url
from engine.web.views.grid import build_grid, first_state
from engine.web.views.runs import RunQuery, form

__all__ = ["GRID_RUNS", "GRID_TASKS", "dag_page"]

#: Runs (columns) a page of the grid shows.
GRID_RUNS = 25
#: Tasks (rows) a page of the grid shows; the DAG's task list pages with it.
GRID_TASKS = PAGE_ROWS

#: The DAG's tasks, listed (paged) when its graph is too large to draw.
TASK_COLUMNS: list[Column] = [
    Column("task", lambda t: str(t["task_id"])),
    Column("upstream", lambda t: shortened([str(u) for u in t.get("upstream", [])])),
    Column("trigger rule", lambda t: t.get("trigger_rule", "")),
    Column("pool", lambda t: t.get("pool", "")),
    Column("retries", lambda t: t.get("retries", ""), numeric=True),
]


async def dag_page(
    store: Store,
    dag_id: str,
    page: int | None = None,
    *,
    query: RunQuery | None = None,
    run_page: int | None = None,
) -> dict[str, Any]:
    """The DAG ``dag_id``: page ``run_page`` of its runs (those ``query`` asks for) by page
    ``page`` of its tasks."""
    query = query or RunQuery()
    dag = await store.get_dag(dag_id)
    if dag is None:
        raise NotFound(f"no DAG {dag_id!r}")

    def href(**changed: Any) -> str:
        params: dict[str, Any] = {**query.params, "run_page": run_page, "page": page, **changed}
        return url("/dag", dag_id=dag_id, **params)

    total_runs = await store.count_runs(dag_id, query.filter)
    runs_pager = Pager.of(
        run_page, total_runs, lambda n: href(run_page=n), size=GRID_RUNS, noun="runs"
    )
    runs = await store.runs_page(
        dag_id, query.filter, limit=runs_pager.size, offset=runs_pager.offset
    )
    task_ids = ordered(dag.tasks)
    tasks = None
    tasks_pager = None
    shown = task_ids
    if len(task_ids) > GRID_TASKS:
        tasks_pager = Pager.of(page, len(task_ids), lambda n: href(page=n), size=GRID_TASKS)
        shown = task_ids[tasks_pager.offset : tasks_pager.offset + tasks_pager.size]
        by_id = {str(t["task_id"]): t for t in dag.tasks}
        tasks = Table(TASK_COLUMNS, [by_id[t] for t in shown])
    whole = tasks_pager is None
    cells = await store.grid_cells([r.id for r in runs], None if whole else shown)
    newest = runs[0] if runs else None
    states: dict[str, str] = {}
    counts: dict[str, int] | None = None
    if newest is not None:
        states = {c.task_id: first_state(c.states) for c in cells if c.dag_run_id == newest.id}
        if len(task_ids) > MAX_DRAWN_TASKS:
            counts = await store.run_task_counts(newest.id)
    return {
        "title": f"DAG {dag_id}",
        "dag": dag,
        **form(query),
        "filter_href": url("/dag", dag_id=dag_id),
        "runs_pager": runs_pager,
        "grid": build_grid(runs, shown, cells, others=whole),
        "legend_states": LEGEND,
        "graph_run": newest,
        "graph_run_href": run_url(dag_id, newest.run_id) if newest else "",
        "graph": graph(
            dag.tasks,
            states,
            (lambda t: task_url(dag_id, newest.run_id, t)) if newest else None,
            counts=counts,
        ),
        "tasks": tasks,
        "pager": tasks_pager,
    }
