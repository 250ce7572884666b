"""The DAGs page: every DAG with its latest runs, searched by name (or tag), the state of its
latest run and paused or not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.states import RUN_STATES
from engine.store import Store
from engine.store.models import DagOverview
from engine.web.render import _when
from engine.web.views.common import Column, Link, Square, Squares, Table, dag_url, run_url

__all__ = ["DagQuery", "dags_page"]


@dataclass(frozen=True)
class DagQuery:
    """The DAGs asked for: ``name`` in the id (or a tag), the latest run's ``state``,
    ``paused`` ("yes" / "no")."""

    name: str | None = None
    state: str | None = None
    paused: str | None = None

    @property
    def active(self) -> bool:
        return any((self.name, self.state, self.paused))


def _last_runs(d: DagOverview) -> Squares:
    return Squares(
        [
            Square(f"{r.run_id}: {r.state}", r.state, run_url(d.dag_id, r.run_id))
            for r in d.last_runs
        ]
    )


def _next_run(d: DagOverview) -> str:
    if not d.is_active:
        return "none: no longer in the DAGs folder"
    if d.is_paused or d.next_dagrun is None:
        return ""
    # The logical date is the interval's start (past while it runs): say when it is created.
    return f"{_when(d.next_dagrun)} (created at {_when(d.next_dagrun_create_after)})"


DAG_COLUMNS: list[Column] = [
    Column("DAG", lambda d: Link(d.dag_id, dag_url(d.dag_id))),
    Column("schedule", lambda d: d.schedule or "None"),
    Column("paused", lambda d: "yes" if d.is_paused else "no"),
    Column("next run", _next_run),
    Column("tasks", lambda d: d.tasks, numeric=True),
    Column("last runs (newest first)", _last_runs),
    Column("description", lambda d: d.description or ""),
    Column("file", lambda d: d.fileloc),
]


async def dags_page(store: Store, query: DagQuery | None = None) -> dict[str, Any]:
    query = query or DagQuery()
    paused = None if query.paused is None else query.paused == "yes"
    dags = await store.dags_overview(name=query.name, state=query.state, paused=paused)
    return {
        "title": "DAGs",
        "query": query,
        "run_states": sorted(RUN_STATES),
        "dags": Table(DAG_COLUMNS, dags),
    }
