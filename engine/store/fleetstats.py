"""The store's reads for the fleet's numbers: what holds back the runnable task instances no
worker claimed (the status page's backlog, ``deferral status``) and the facts behind the
scheduler's metrics (runs by DAG and state, the durations of the runs it ended and of their
tasks). Mixed into :class:`engine.store.store.Store`; none of it is on a hot path."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import asyncpg
import msgspec

from engine.store.core import StoreCore
from engine.store.models.fleetstats import BacklogGroup, BacklogSplit, EndedRunFacts

__all__ = [
    "BacklogGroup",
    "BacklogSplit",
    "EndedRunFacts",
    "FleetStats",
    "read_backlog_split",
    "split_backlog",
]


def split_backlog(groups: Sequence[BacklogGroup]) -> BacklogSplit:
    """How many of the groups' task instances each hold-back keeps, as a claim would admit
    them: a pool's room first (slots per task), then its DAG's and its task's room; the rest
    wait for a worker. (A claim admits by priority; which of one pool's tasks it takes is not
    asked here, only how many.)"""
    pool_left: dict[str, int | None] = {}
    dag_left: dict[str, int | None] = {}
    task_left: dict[tuple[str, str], int | None] = {}
    pool = limit = worker = 0
    for g in groups:
        admitted = g.n
        room = pool_left.setdefault(g.pool, g.pool_room)
        if room is not None:
            admitted = min(g.n, g.resuming + max(0, room) // max(1, g.pool_slots))
            pool_left[g.pool] = room - max(0, admitted - g.resuming) * g.pool_slots
        runs = admitted
        dag_cap = dag_left.setdefault(g.dag_id, g.dag_room)
        task_cap = task_left.setdefault((g.dag_id, g.task_id), g.task_room)
        for cap in (dag_cap, task_cap):
            if cap is not None:
                runs = min(runs, max(0, cap))
        if dag_cap is not None:
            dag_left[g.dag_id] = dag_cap - runs
        if task_cap is not None:
            task_left[g.dag_id, g.task_id] = task_cap - runs
        pool += g.n - admitted
        limit += admitted - runs
        worker += runs
    return BacklogSplit(held_by_pool=pool, held_by_limit=limit, waiting_for_worker=worker)


async def read_backlog_split(
    conn: asyncpg.pool.PoolConnectionProxy, queries: dict[str, str]
) -> BacklogSplit:
    """The backlog's split, read on ``conn`` (the status page reads it with the fleet)."""
    rows = await conn.fetch(queries["backlog_groups"])
    return split_backlog(msgspec.convert([dict(r) for r in rows], list[BacklogGroup]))


class FleetStats(StoreCore):
    """Store methods for the fleet's numbers. Expects the Store's pool and queries."""

    async def backlog_split(self) -> BacklogSplit:
        async with self._pool.acquire() as conn:
            return await read_backlog_split(conn, self._q)

    async def active_runs_by_dag(self) -> dict[tuple[str, str], int]:
        """Runs queued or running, by (DAG, state)."""
        rows = await self._pool.fetch(self._q["active_runs_by_dag"])
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for r in rows:
            counts[r["dag_id"], r["state"]] += r["n"]
        return dict(counts)

    async def ended_run_facts(self, run_ids: Sequence[int]) -> list[EndedRunFacts]:
        if not run_ids:
            return []
        rows = await self._pool.fetch(self._q["ended_run_facts"], list(run_ids))
        return msgspec.convert([dict(r) for r in rows], list[EndedRunFacts])
