"""The structs of engine/store/browse.py: the status page's views (runs a page at a time, the
grid's cells, each try, triggers by class and owner, a pool's tasks)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

__all__ = ["GridCellCounts", "GridRun", "PoolTask", "RunFilter", "TriggerGroup", "TryRecord"]


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
