"""Why is this task not running?" as the store reads it (engine/store/why.py);
engine/client/why.py words the answer."""

from __future__ import annotations

import datetime as dt

import msgspec

__all__ = [
    "RunWait",
    "TaskWait",
    "WhyTask",
]


class TaskWait(msgspec.Struct, frozen=True, kw_only=True):
    """One task instance with everything that may hold it back (query ``why_tasks``)."""

    id: int
    dag_id: str
    run_id: str
    task_id: str
    state: str
    try_number: int
    retries: int
    run_after: dt.datetime
    try_started_at: dt.datetime | None
    ended_at: dt.datetime | None
    error: str | None
    trigger_rule: str
    #: The task's upstream task ids, in the DAG's order.
    upstream: list[str]
    #: Upstream task id -> its state; None unless the task is pending.
    upstream_states: dict[str, str] | None
    pool: str
    pool_slots: int
    pool_exists: bool
    #: The pool's slots; None when it does not exist.
    pool_total: int | None
    include_deferred: bool
    #: Slots of the pool held by running tries.
    pool_running: int
    #: Slots of the pool held by deferred tasks (counted against it only with include_deferred).
    pool_deferred: int
    max_active_tasks: int | None
    #: Running tries of the task's DAG.
    dag_running: int
    max_active_tis_per_dag: int | None
    #: Running tries of this task across the DAG's runs.
    task_running: int
    #: Running tries across all workers (against the ``parallelism`` setting).
    fleet_running: int
    queue: str
    #: Live workers (recent heartbeat) that serve the task's queue.
    live_workers: int
    #: When a worker serving the queue was last seen (registered or heartbeating); None: never.
    worker_last_seen: dt.datetime | None
    #: The worker of a running try.
    worker_id: int | None
    worker_hostname: str | None
    worker_pid: int | None
    trigger_id: int | None
    #: Whether a deferred task's trigger row is there (gone: it fired a moment ago).
    trigger_found: bool
    trigger_classpath: str | None
    trigger_created_at: dt.datetime | None
    #: The deferral's deadline and which one it is (engine/states.py DeadlineKind).
    trigger_timeout_at: dt.datetime | None
    deadline_kind: str | None
    trigger_queue: str
    triggerer_id: int | None
    triggerer_hostname: str | None
    triggerer_pid: int | None
    #: A try of it told to stop (its task was marked or cleared) that its worker has not seen
    #: end yet: the try, the worker, why and since when (None: none).
    stopping_try: int | None = None
    stopping_worker_id: int | None = None
    stopping_reason: str | None = None
    stopping_since: dt.datetime | None = None
    #: Live triggerers (lease not expired) serving the trigger queue, and how many have room.
    live_triggerers: int
    triggerers_with_room: int
    #: When a triggerer serving the trigger queue was last seen; None: never.
    triggerer_last_seen: dt.datetime | None
    db_now: dt.datetime


class RunWait(msgspec.Struct, frozen=True, kw_only=True):
    """A run, as "why is a task of it not running?" sees it (query ``why_run``)."""

    id: int
    dag_id: str
    run_id: str
    state: str
    run_type: str
    created_at: dt.datetime
    #: None when the DAG is no longer recorded.
    max_active_runs: int | None
    #: The DAG's runs counted against max_active_runs (running, not backfills).
    active_runs: int
    #: Queued runs of the DAG that start before this one.
    queued_before: int
    #: Whether the DAG has the task asked about.
    has_task: bool
    #: The task instance; None while the run is queued (created when it starts).
    ti_id: int | None
    db_now: dt.datetime


class WhyTask(msgspec.Struct, frozen=True, kw_only=True):
    """A run and, when it exists, the task instance asked about."""

    run: RunWait
    task: TaskWait | None
