"""The rows of engine/store/fleetstats.py."""

from __future__ import annotations

import msgspec

__all__ = ["BacklogGroup", "BacklogSplit", "EndedRunFacts"]


class BacklogGroup(msgspec.Struct, frozen=True, kw_only=True):
    """Runnable task instances of one pool, DAG, task and slot count (query backlog_groups)."""

    pool: str
    dag_id: str
    task_id: str
    pool_slots: int
    n: int
    #: Of them, deferred tasks resuming in a pool that counts deferred tasks: their slot is
    #: theirs already.
    resuming: int
    #: Slots the pool has left (None: no such pool: the claim fails them at once).
    pool_room: int | None
    #: Running tries the DAG (max_active_tasks) and the task (max_active_tis_per_dag) may
    #: still add (None: no limit).
    dag_room: int | None
    task_room: int | None


class BacklogSplit(msgspec.Struct, frozen=True, kw_only=True):
    """The runnable task instances no worker claimed, by what they wait for: a pool's slots, a
    limit (the DAG's max_active_tasks, the task's max_active_tis_per_dag), or a worker (a free
    slot of one serving their queue)."""

    held_by_pool: int = 0
    held_by_limit: int = 0
    waiting_for_worker: int = 0


class EndedRunFacts(msgspec.Struct, frozen=True, kw_only=True):
    """A run the scheduler ended: how long it took, how late it started (scheduled runs:
    after its data interval ended), and its tasks' durations by their state."""

    dag_id: str
    state: str
    run_type: str
    duration_s: float | None
    delay_s: float | None
    #: ``[state, seconds]`` of each task instance that ran.
    tasks: list[tuple[str, float]]
