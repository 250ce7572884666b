"""The store's reads for the status page's views (engine/web/): the runs a page at a time with
filters, the grid's cells, each try of a task instance, a run's tries for its Gantt view, the
triggers by class and owner, a pool's tasks. Mixed into :class:`engine.store.store.Store`
(through :class:`engine.store.status.StatusReads`); none of it is on a hot path.

The rows are frozen structs, defined here with the reads that make them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import asyncpg
import msgspec

__all__ = [
    "BrowseReads",
    "GridCellCounts",
    "GridRun",
    "PoolTask",
    "RunFilter",
    "TriggerGroup",
    "TryRecord",
]


class RunFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Which runs a listing shows: a state, a run type, logical dates in [since, until)."""

    state: str | None = None
    run_type: str | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None


class GridRun(msgspec.Struct, frozen=True, kw_only=True):
    """A run as a column of the grid and a row of the runs list."""

    id: int
    dag_id: str
    run_id: str
    run_type: str
    state: str
    logical_date: dt.datetime
    data_interval_start: dt.datetime | None
    data_interval_end: dt.datetime | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    ended_at: dt.datetime | None


class GridCellCounts(msgspec.Struct, frozen=True, kw_only=True):
    """The task instances of one task in one run (one, until tasks are mapped): how many are
    in each state, and the latest try among them."""

    dag_run_id: int
    task_id: str
    instances: int
    states: dict[str, int]
    try_number: int


class TryRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One try of a task instance: a kept one (``current`` false) or its current one.

    ``started_at`` is when the try first ran, ``resumed_at`` its latest claim (a resume or a
    reschedule), ``deferred_at`` its latest deferral and ``fired_at`` when that deferral's
    trigger fired; ``queued_at`` when it became due. A current row that was cleared and not
    claimed since has ``started`` false: it holds nothing of a try (its kept copy does)."""

    try_number: int
    state: str
    queued_at: dt.datetime | None
    started_at: dt.datetime | None
    resumed_at: dt.datetime | None
    deferred_at: dt.datetime | None
    fired_at: dt.datetime | None
    ended_at: dt.datetime | None
    current: bool
    started: bool
    #: A current row's run_after (a waiting task is due from then).
    run_after: dt.datetime | None
    db_now: dt.datetime
    error: str | None = None
    rendered_fields: dict[str, Any] | None = None
    #: The task instance (run_tries only) and its task.
    ti_id: int | None = None
    task_id: str | None = None


class TriggerGroup(msgspec.Struct, frozen=True, kw_only=True):
    """The triggers of one class held by one triggerer (None: unowned)."""

    classpath: str
    triggerer_id: int | None
    triggers: int
    waiting: int
    oldest_since: dt.datetime
    oldest_age_s: float


class PoolTask(msgspec.Struct, frozen=True, kw_only=True):
    """A task instance a pool holds or will admit."""

    id: int
    dag_id: str
    run_id: str
    task_id: str
    state: str
    try_number: int
    pool_slots: int
    priority: int
    run_after: dt.datetime
    started_at: dt.datetime | None
    worker_id: int | None
    trigger_id: int | None


def _run_args(flt: RunFilter) -> tuple[Any, ...]:
    return (flt.state, flt.run_type, flt.since, flt.until)


def _rows(records: Sequence[asyncpg.Record], type_: type[Any]) -> list[Any]:
    return msgspec.convert([dict(r) for r in records], list[type_])  # type: ignore[valid-type]


class BrowseReads:
    """Store methods for the status page's views. Expects the Store's pool and queries."""

    _pool: asyncpg.Pool
    _q: dict[str, str]

    async def count_runs(self, dag_id: str | None, flt: RunFilter) -> int:
        """How many runs ``flt`` lets through: of DAG ``dag_id``, or of every DAG (None)."""
        if dag_id is None:
            return int(await self._pool.fetchval(self._q["count_runs"], *_run_args(flt)))
        return int(await self._pool.fetchval(self._q["count_dag_runs"], dag_id, *_run_args(flt)))

    async def runs_page(
        self, dag_id: str | None, flt: RunFilter, *, limit: int, offset: int = 0
    ) -> list[GridRun]:
        """``limit`` of the runs ``flt`` lets through after ``offset``, newest first (by
        logical date, then as created): of DAG ``dag_id``, or of every DAG (None)."""
        if dag_id is None:
            rows = await self._pool.fetch(self._q["runs_page"], *_run_args(flt), limit, offset)
        else:
            rows = await self._pool.fetch(
                self._q["dag_runs_page"], dag_id, *_run_args(flt), limit, offset
            )
        return _rows(rows, GridRun)

    async def grid_cells(
        self, run_pks: Sequence[int], task_ids: Sequence[str] | None = None
    ) -> list[GridCellCounts]:
        """The grid's cells of runs ``run_pks``: one per run and task (of ``task_ids`` only;
        None: every task)."""
        rows = await self._pool.fetch(
            self._q["grid_cells"], list(run_pks), None if task_ids is None else list(task_ids)
        )
        return _rows(rows, GridCellCounts)

    async def task_tries(self, dag_id: str, run_id: str, task_id: str) -> list[TryRecord]:
        """Every recorded try of a task instance, oldest first (the current one last)."""
        rows = await self._pool.fetch(self._q["task_tries"], dag_id, run_id, task_id)
        return _rows(rows, TryRecord)

    async def run_tries(
        self, dag_run_pk: int, dag_id: str, run_id: str, *, limit: int, offset: int = 0
    ) -> list[TryRecord]:
        """The tries of ``limit`` of a run's task instances (in the DAG's order, after
        ``offset``), each task's oldest first."""
        rows = await self._pool.fetch(
            self._q["run_tries"], dag_run_pk, dag_id, run_id, limit, offset
        )
        return _rows(rows, TryRecord)

    async def trigger_groups(self) -> list[TriggerGroup]:
        """The triggers counted by class and owner."""
        return _rows(await self._pool.fetch(self._q["trigger_groups"]), TriggerGroup)

    async def count_pool_tasks(self, pool: str, states: Sequence[str], *, due_only: bool) -> int:
        """How many of pool ``pool``'s task instances are in ``states`` (due now only, when
        ``due_only``: runnable tasks waiting for admission)."""
        return int(
            await self._pool.fetchval(self._q["count_pool_tasks"], pool, list(states), due_only)
        )

    async def pool_tasks(
        self, pool: str, states: Sequence[str], *, due_only: bool, limit: int, offset: int = 0
    ) -> list[PoolTask]:
        """``limit`` of those task instances after ``offset``, in admission order."""
        rows = await self._pool.fetch(
            self._q["pool_tasks"], pool, list(states), due_only, limit, offset
        )
        return _rows(rows, PoolTask)
