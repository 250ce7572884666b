"""A DAG's grid: its runs as columns (newest first) and its tasks as rows, each cell the state
of the task in the run, colored, a link to its try.

A cell stands for every task instance of a task in a run: one today, several once tasks are
mapped (the store groups them by run and task, :meth:`engine.store.browse.BrowseReads.
grid_cells`); a cell of several shows how many there are and the state that needs a look
first (:data:`~engine.web.views.common.LEGEND` order), its title the count in each state.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from engine.store.models import GridCellCounts, GridRun
from engine.web.render import _when
from engine.web.views.common import LEGEND, run_url, task_url

__all__ = [
    "Grid",
    "GridCell",
    "GridColumn",
    "GridRow",
    "build_grid",
    "first_state",
    "interval_text",
    "short",
]

#: One letter per run type, as the grid's column heads show it.
RUN_TYPE_MARKS = {"scheduled": "S", "manual": "M", "backfill": "B"}


@dataclass(frozen=True)
class GridColumn:
    """A run, as the head of its column."""

    run: GridRun
    href: str
    mark: str
    interval: str
    title: str


@dataclass(frozen=True)
class GridCell:
    state: str
    href: str
    title: str
    #: Task instances in the cell (one until tasks are mapped); shown when more than one.
    count: int


@dataclass(frozen=True)
class GridRow:
    task_id: str
    cells: list[GridCell | None]
    #: Said beside the task id: e.g. that the DAG no longer has it.
    note: str = ""


@dataclass(frozen=True)
class Grid:
    columns: list[GridColumn]
    rows: list[GridRow]


def short(value: dt.datetime | None) -> str:
    """A time as a column head shows it: to the minute, or to the second when it has any."""
    if value is None:
        return "-"
    at = value.astimezone(dt.UTC)
    return at.strftime("%Y-%m-%d %H:%M:%S" if at.second or at.microsecond else "%Y-%m-%d %H:%M")


def interval_text(run: GridRun) -> str:
    """A run's data interval (its logical date alone when the interval is empty)."""
    start, end = run.data_interval_start, run.data_interval_end
    if start is None or end is None or start == end:
        return short(run.logical_date)
    return f"{short(start)} → {short(end)}"


def _column(run: GridRun) -> GridColumn:
    title = (
        f"{run.run_id}: {run.state}, {run.run_type} run, logical date {_when(run.logical_date)}"
        f", data interval {_when(run.data_interval_start)} to {_when(run.data_interval_end)}"
    )
    return GridColumn(
        run,
        run_url(run.dag_id, run.run_id),
        RUN_TYPE_MARKS.get(run.run_type, run.run_type[:1].upper()),
        interval_text(run),
        title,
    )


def first_state(states: dict[str, int]) -> str:
    """Of the states of a cell's task instances, the one that needs a look first."""
    ranked = [s for s in LEGEND if states.get(s)]
    return ranked[0] if ranked else next(iter(states), "none")


def _cell(run: GridRun, counts: GridCellCounts) -> GridCell:
    state = first_state(counts.states)
    where = f"{counts.task_id} in {run.run_id}"
    if counts.instances == 1:
        title = f"{where}: {state}" + (f", try {counts.try_number}" if counts.try_number else "")
    else:
        listed = ", ".join(f"{n} {s}" for s, n in sorted(counts.states.items()))
        title = f"{where}: {counts.instances} task instances: {listed}"
    return GridCell(
        state, task_url(run.dag_id, run.run_id, counts.task_id), title, counts.instances
    )


def build_grid(
    runs: Sequence[GridRun],
    task_ids: Sequence[str],
    cells: Sequence[GridCellCounts],
    *,
    others: bool,
) -> Grid:
    """The grid of ``runs`` (columns, in the order given) by ``task_ids`` (rows); with
    ``others``, tasks the runs have that ``task_ids`` does not name (the DAG no longer has
    them) are rows too, after the others."""
    by_pk = {r.id: r for r in runs}
    found: dict[tuple[int, str], GridCellCounts] = {(c.dag_run_id, c.task_id): c for c in cells}
    rows_ids = list(task_ids)
    notes: dict[str, str] = {}
    if others:
        known = set(task_ids)
        extra = sorted({c.task_id for c in cells if c.task_id not in known})
        rows_ids += extra
        notes = dict.fromkeys(extra, "not in the DAG now")
    rows = []
    for task_id in rows_ids:
        row: list[GridCell | None] = []
        for run in runs:
            counts = found.get((run.id, task_id))
            row.append(None if counts is None else _cell(by_pk[run.id], counts))
        rows.append(GridRow(task_id, row, notes.get(task_id, "")))
    return Grid([_column(r) for r in runs], rows)
