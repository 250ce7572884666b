"""The statements of schedules and run admission. A reader of :class:`engine.store.Store`.

Runs made by the scheduler, ``dags trigger`` and ``dags backfill`` are inserted as ``queued``
and started by ``start_queued_runs`` while the DAG's ``max_active_runs`` lets them: right
after their creation (the scheduler's, once every due DAG's runs are created; a manual run's
in the same transaction) and again whenever a run of the DAG ends. The DAG's row is locked
first, so creation and admission of one DAG take turns whichever process does them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Sequence
from typing import Any

from engine.store.connection import CHANNEL_TASKS
from engine.store.core import StoreCore, structs
from engine.store.models import DueDag, NewRun, NextRun, RunRow, StartedRun

__all__ = ["DuplicateRun", "ScheduleQueries"]


class DuplicateRun(ValueError):
    """The DAG already has a run of that id (or, for a scheduled or backfill run, a run at
    that logical date)."""


class ScheduleQueries(StoreCore):
    """The statements of schedules and run admission."""

    # -- the next run of each DAG ----------------------------------------------------------

    async def last_scheduled_interval(self, dag_id: str) -> tuple[dt.datetime, dt.datetime] | None:
        row = await self._pool.fetchrow(self._q["last_scheduled_interval"], dag_id)
        if row is None or row["start"] is None or row["end"] is None:
            return None
        return row["start"], row["end"]

    async def set_next_dagruns(self, nexts: Sequence[NextRun], conn: Any = None) -> None:
        await (conn or self._pool).execute(
            self._q["set_next_dagruns"],
            [n.dag_id for n in nexts],
            [n.logical_date for n in nexts],
            [n.interval_end for n in nexts],
            [n.create_after for n in nexts],
        )

    async def next_due_in(self) -> float | None:
        """Seconds until the next scheduled run of any unpaused DAG may be created."""
        value: float | None = await self._pool.fetchval(self._q["next_due"])
        return value

    @contextlib.asynccontextmanager
    async def due_dags(self, limit: int) -> AsyncIterator[tuple[Any, list[DueDag]]]:
        """A transaction holding up to ``limit`` due DAGs locked: the caller inserts their runs
        and sets their next run in it (``insert_runs``, ``set_next_dagruns`` with ``conn=``)."""
        async with self._tx() as conn:
            rows = await conn.fetch(self._q["due_dags"], limit)
            yield conn, structs(rows, DueDag)

    # -- creating and starting runs --------------------------------------------------------

    async def insert_runs(self, runs: Sequence[NewRun], conn: Any = None) -> list[tuple[int, str]]:
        """Insert runs as queued (an interval or run id that exists already is skipped);
        returns ``(id, run_id)`` of those created."""
        if not runs:
            return []
        rows = await (conn or self._pool).fetch(
            self._q["insert_runs"],
            [r.dag_id for r in runs],
            [r.run_id for r in runs],
            [r.logical_date for r in runs],
            [r.data_interval_start for r in runs],
            [r.data_interval_end for r in runs],
            [r.run_type for r in runs],
            [r.conf for r in runs],
        )
        return [(r["id"], r["run_id"]) for r in rows]

    async def start_queued_runs(
        self, dag_ids: Sequence[str] | None = None, conn: Any = None
    ) -> list[StartedRun]:
        """Start the queued runs of these DAGs (None: of every DAG with queued runs) that
        max_active_runs admits, creating their task instances; wakes the workers."""
        if conn is None:
            async with self._tx() as tx:
                return await self.start_queued_runs(dag_ids, tx)
        if dag_ids is None:
            dag_ids = [r["dag_id"] for r in await conn.fetch(self._q["dags_with_queued_runs"])]
        if not dag_ids:
            return []
        await conn.execute(self._q["lock_dags"], sorted(set(dag_ids)))
        rows = await conn.fetch(self._q["start_queued_runs"], list(dag_ids))
        if any(r["task_count"] for r in rows):
            await conn.execute(self._q["notify"], CHANNEL_TASKS, "")
        return [StartedRun(**dict(r)) for r in rows]

    async def create_queued_run(self, run: NewRun) -> tuple[int, str] | None:
        """Create one run behind the DAG's max_active_runs (it starts now if admitted);
        returns ``(id, state)``, or None when the DAG is unknown. Raises ValueError when the
        DAG has a run of that id (or, for a backfill, at that logical date) already."""
        async with self._tx() as conn:
            if not await conn.fetch(self._q["lock_dags"], [run.dag_id]):
                return None
            created = await self.insert_runs([run], conn)
            if not created:
                raise DuplicateRun(
                    f"DAG {run.dag_id} already has a run {run.run_id!r}"
                    + (
                        f" or a run at {run.logical_date.isoformat()}"
                        if run.run_type != "manual"
                        else ""
                    )
                )
            run_pk = created[0][0]
            started = await self.start_queued_runs([run.dag_id], conn)
        return run_pk, "running" if any(s.id == run_pk for s in started) else "queued"

    async def reset_dag_runs(self, run_pks: Sequence[int]) -> list[int]:
        """Queue ended runs again, without their task instances (a backfill reprocessing)."""
        rows = await self._pool.fetch(self._q["reset_dag_runs"], list(run_pks))
        return [r["id"] for r in rows]

    # -- reads and flags -------------------------------------------------------------------

    async def set_dag_paused(self, dag_id: str, paused: bool) -> bool:
        """Pause or unpause a DAG; False when it is unknown."""
        return await self._pool.fetchrow(self._q["set_dag_paused"], dag_id, paused) is not None

    async def runs_at(self, dag_id: str, logical_dates: Sequence[dt.datetime]) -> list[RunRow]:
        rows = await self._pool.fetch(self._q["runs_at"], dag_id, list(logical_dates))
        return structs(rows, RunRow)

    async def list_runs(
        self, *, dag_id: str | None = None, state: str | None = None, limit: int = 10_000
    ) -> list[RunRow]:
        rows = await self._pool.fetch(self._q["list_runs"], dag_id, state, limit)
        return structs(rows, RunRow)

    async def count_dags(self) -> int:
        n: int = await self._pool.fetchval(self._q["count_dags"])
        return n

    async def schedule_delays(self, since: dt.datetime, until: dt.datetime) -> list[float]:
        """Interval end -> run created, in seconds, of the scheduled runs whose interval
        ended in ``[since, until)``."""
        rows = await self._pool.fetch(self._q["schedule_delays"], since, until)
        return [float(r["delay"]) for r in rows]
