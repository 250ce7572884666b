"""The store's reads for the status page's views (engine/web/): the runs a page at a time with
filters, the grid's cells, each try of a task instance, a run's tries for its Gantt view, the
triggers by class and owner, a pool's tasks. A reader of :class:`engine.store.Store` (through
:class:`engine.store.status.StatusQueries`); none of it is on a hot path. Its structs:
engine/store/models/browse.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.store.core import StoreCore, structs
from engine.store.models import (
    GridCellCounts,
    GridRun,
    PoolTask,
    RunFilter,
    TriggerGroup,
    TryRecord,
)

__all__ = ["BrowseReads"]


def _run_args(flt: RunFilter) -> tuple[Any, ...]:
    return (flt.state, flt.run_type, flt.since, flt.until)


class BrowseReads(StoreCore):
    """The statements of the status page's views."""

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
        return structs(rows, GridRun)

    async def grid_cells(
        self, run_pks: Sequence[int], task_ids: Sequence[str] | None = None
    ) -> list[GridCellCounts]:
        """The grid's cells of runs ``run_pks``: one per run and task (of ``task_ids`` only;
        None: every task)."""
        rows = await self._pool.fetch(
            self._q["grid_cells"], list(run_pks), None if task_ids is None else list(task_ids)
        )
        return structs(rows, GridCellCounts)

    async def task_tries(self, dag_id: str, run_id: str, task_id: str) -> list[TryRecord]:
        """Every recorded try of a task instance, oldest first (the current one last)."""
        rows = await self._pool.fetch(self._q["task_tries"], dag_id, run_id, task_id)
        return structs(rows, TryRecord)

    async def run_tries(
        self, dag_run_pk: int, dag_id: str, run_id: str, *, limit: int, offset: int = 0
    ) -> list[TryRecord]:
        """The tries of ``limit`` of a run's task instances (in the DAG's order, after
        ``offset``), each task's oldest first."""
        rows = await self._pool.fetch(
            self._q["run_tries"], dag_run_pk, dag_id, run_id, limit, offset
        )
        return structs(rows, TryRecord)

    async def trigger_groups(self) -> list[TriggerGroup]:
        """The triggers counted by class and owner."""
        return structs(await self._pool.fetch(self._q["trigger_groups"]), TriggerGroup)

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
        return structs(rows, PoolTask)
