"""The status page's reads (engine/store/status.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

__all__ = [
    "AuditRow",
    "Backlog",
    "DagOverview",
    "Fleet",
    "FleetTriggerer",
    "GridCell",
    "OldestWait",
    "RunSquare",
    "SchedulerRow",
    "TaskTry",
    "TriggerListing",
    "WorkerRow",
]


class SchedulerRow(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    hostname: str
    pid: int
    version: str | None
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    heartbeat_age_s: float


class WorkerRow(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    hostname: str
    pid: int
    version: str | None
    slots: int
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    heartbeat_age_s: float
    running: int


class FleetTriggerer(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    hostname: str
    pid: int
    version: str | None
    capacity: int
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    heartbeat_age_s: float
    expired: bool
    held: int
    loop_lag_p99_ms: float | None
    blocked_loops: int
    worst_blocker: str | None
    worst_block_ms: float | None


class Backlog(msgspec.Struct, frozen=True, kw_only=True):
    """Work no process holds yet: runnable task instances, unowned triggers."""

    runnable: int
    unowned_triggers: int
    #: Of the runnable ones: held back by their pool's slots, by a limit (max_active_tasks,
    #: max_active_tis_per_dag), or waiting for a worker's free slot (engine/store/fleetstats.py).
    held_by_pool: int = 0
    held_by_limit: int = 0
    waiting_for_worker: int = 0


class Fleet(msgspec.Struct, frozen=True, kw_only=True):
    schedulers: list[SchedulerRow]
    workers: list[WorkerRow]
    triggerers: list[FleetTriggerer]
    backlog: Backlog


class RunSquare(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    state: str


class DagOverview(msgspec.Struct, frozen=True, kw_only=True):
    """A DAG on the status page's DAGs list, with its latest runs (newest first)."""

    dag_id: str
    fileloc: str
    tasks: int
    description: str | None
    updated_at: dt.datetime
    #: The schedule as written (None: manual runs only).
    schedule: str | None = None
    is_paused: bool = False
    #: The next scheduled run's logical date, and when it may be created (None: none).
    next_dagrun: dt.datetime | None = None
    next_dagrun_create_after: dt.datetime | None = None
    is_active: bool = True
    last_runs: list[RunSquare]


class GridCell(msgspec.Struct, frozen=True, kw_only=True):
    """A task instance in a run's grid."""

    id: int
    task_id: str
    state: str
    try_number: int
    first_try_at: dt.datetime | None
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    duration_s: float | None
    trigger_id: int | None
    upstream: list[str]
    #: The instance of a mapped task (0..n-1); -1: not mapped.
    map_index: int = -1

    @property
    def name(self) -> str:
        """``task_id``, or ``TASK[i]`` for a mapped instance (its page's address)."""
        return self.task_id if self.map_index < 0 else f"{self.task_id}[{self.map_index}]"


class TaskTry(msgspec.Struct, frozen=True, kw_only=True):
    """One task instance in full for its page (``next_kwargs``, ``result`` and
    ``trigger_kwargs`` decrypted, still encoded; None when absent or no key opens them)."""

    id: int
    dag_run_id: int
    dag_id: str
    run_id: str
    task_id: str
    state: str
    try_number: int
    retries: int
    priority: int
    pool: str
    trigger_rule: str
    upstream: list[str]
    worker_id: int | None
    run_after: dt.datetime
    first_try_at: dt.datetime | None
    try_started_at: dt.datetime | None
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    heartbeat_at: dt.datetime | None
    execution_timeout_s: float | None
    next_method: str | None
    next_kwargs: bytes | None
    result: bytes | None
    error: str | None
    trigger_id: int | None
    trigger_timeout_at: dt.datetime | None
    deadline_kind: str | None
    trigger_classpath: str | None
    trigger_kwargs: bytes | None
    triggerer_id: int | None
    trigger_created_at: dt.datetime | None
    triggerer_hostname: str | None
    triggerer_pid: int | None
    db_now: dt.datetime
    #: What the templated fields rendered to at the start of the latest try (field → value);
    #: None when nothing was rendered.
    rendered_fields: dict[str, Any] | None = None
    #: The instance of a mapped task (0..n-1); -1: not mapped.
    map_index: int = -1

    @property
    def name(self) -> str:
        """``task_id``, or ``TASK[i]`` for a mapped instance (its page's address, and the name
        its tries and log lines are kept under)."""
        return self.task_id if self.map_index < 0 else f"{self.task_id}[{self.map_index}]"


class TriggerListing(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    classpath: str
    triggerer_id: int | None
    triggerer_hostname: str | None
    triggerer_pid: int | None
    timeout_at: dt.datetime | None
    created_at: dt.datetime
    age_s: float
    waiting: int


class OldestWait(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    dag_id: str
    run_id: str
    task_id: str
    try_number: int
    trigger_id: int
    trigger_timeout_at: dt.datetime | None
    classpath: str
    triggerer_id: int | None
    waiting_since: dt.datetime
    age_s: float


class AuditRow(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    at: dt.datetime
    who: str
    action: str
    target: str
    detail: dict[str, Any]
