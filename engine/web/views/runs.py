"""The Runs page: every DAG's runs, newest first, a page at a time, filtered by state, run type
and logical date (the same filters as a DAG's grid)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from engine.states import RUN_STATES
from engine.store import Store
from engine.store.models import GridRun, RunFilter
from engine.web.paging import Pager
from engine.web.render import _age, _when
from engine.web.views.common import Column, Link, Table, dag_url, run_url, state_square, url
from engine.web.views.grid import interval_text

__all__ = ["RUNS_PAGE_ROWS", "RUN_TYPES", "RunQuery", "runs_page"]

#: Runs a page of the list shows.
RUNS_PAGE_ROWS = 50
#: How runs come to be (the ``run_type`` column's CHECK constraint).
RUN_TYPES = ("scheduled", "manual", "backfill")


@dataclass(frozen=True)
class RunQuery:
    """The runs a page asks for, as its form says: ``since`` and ``until`` as typed (shown in
    the form again, kept in the pages' links) and as the times they mean."""

    state: str | None = None
    run_type: str | None = None
    since: str | None = None
    until: str | None = None
    since_at: dt.datetime | None = None
    until_at: dt.datetime | None = None

    @property
    def filter(self) -> RunFilter:
        return RunFilter(
            state=self.state, run_type=self.run_type, since=self.since_at, until=self.until_at
        )

    @property
    def params(self) -> dict[str, str | None]:
        """The query parameters that ask for these runs again (for links to other pages)."""
        return {
            "state": self.state,
            "run_type": self.run_type,
            "since": self.since,
            "until": self.until,
        }

    @property
    def active(self) -> bool:
        return any(self.params.values())


def form(query: RunQuery) -> dict[str, Any]:
    """What a page's run filter form shows: the choices and the values asked for."""
    return {"query": query, "run_states": sorted(RUN_STATES), "run_types": RUN_TYPES}


def _duration(r: GridRun) -> str:
    if r.started_at is None or r.ended_at is None:
        return "-"
    return _age((r.ended_at - r.started_at).total_seconds())


RUN_COLUMNS: list[Column] = [
    Column("DAG", lambda r: Link(r.dag_id, dag_url(r.dag_id))),
    Column("run", lambda r: Link(r.run_id, run_url(r.dag_id, r.run_id))),
    Column("state", lambda r: state_square(r.state, run_url(r.dag_id, r.run_id))),
    Column("type", lambda r: r.run_type),
    Column("logical date", lambda r: _when(r.logical_date)),
    Column("data interval", interval_text),
    Column("started", lambda r: _when(r.started_at)),
    Column("ended", lambda r: _when(r.ended_at)),
    Column("duration", _duration, numeric=True),
]


async def runs_page(store: Store, query: RunQuery, page: int | None = None) -> dict[str, Any]:
    total = await store.count_runs(None, query.filter)
    pager = Pager.of(
        page,
        total,
        lambda n: url("/runs", **query.params, page=n),
        size=RUNS_PAGE_ROWS,
        noun="runs",
    )
    runs = await store.runs_page(None, query.filter, limit=pager.size, offset=pager.offset)
    return {
        "title": "Runs",
        **form(query),
        "runs": Table(RUN_COLUMNS, runs),
        "pager": pager,
    }
