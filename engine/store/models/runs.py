"""DAGs, runs and task instances as the runs reader returns them (engine/store/runs.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

__all__ = [
    "Dag",
    "DagRun",
    "DagRunSummary",
    "DagSummary",
    "EndedRun",
    "TaskInstance",
    "WorkLeft",
]


class DagSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A DAG in ``list_dags``: its task count and latest run."""

    dag_id: str
    fileloc: str
    tasks: int
    description: str | None
    updated_at: dt.datetime
    last_run_id: str | None
    last_run_state: str | None
    is_paused: bool = False
    schedule: str | None = None
    #: The next scheduled run's logical date, and when it may be created.
    next_dagrun: dt.datetime | None = None
    next_dagrun_create_after: dt.datetime | None = None
    tags: list[str] = []
    #: False once a scan of the DAGs folder no longer finds it: no more scheduled runs.
    is_active: bool = True


class Dag(msgspec.Struct, frozen=True, kw_only=True):
    """A DAG's stored structure and schedule (``get_dag``)."""

    dag_id: str
    fileloc: str
    tasks: list[dict[str, Any]]
    description: str | None
    timetable: dict[str, Any] = {}
    schedule: str | None = None
    start_date: dt.datetime | None = None
    end_date: dt.datetime | None = None
    catchup: bool = False
    max_active_runs: int = 16
    is_paused: bool = False
    params: dict[str, Any] = {}
    tags: list[str] = []
    next_dagrun: dt.datetime | None = None
    next_dagrun_create_after: dt.datetime | None = None
    is_active: bool = True


class DagRun(msgspec.Struct, frozen=True, kw_only=True):
    """One run (``get_dag_run``)."""

    id: int
    dag_id: str
    run_id: str
    logical_date: dt.datetime
    conf: dict[str, Any]
    state: str
    created_at: dt.datetime
    ended_at: dt.datetime | None
    run_type: str = "manual"
    data_interval_start: dt.datetime | None = None
    data_interval_end: dt.datetime | None = None
    #: When it left ``queued`` (its task instances were created then).
    started_at: dt.datetime | None = None


class EndedRun(msgspec.Struct, frozen=True, kw_only=True):
    """A run ``finish_dag_runs`` ended."""

    id: int
    dag_id: str
    run_id: str
    state: str
    run_type: str = "manual"


class TaskInstance(msgspec.Struct, frozen=True, kw_only=True):
    """A task instance in ``list_task_instances`` (``result``: decrypted, still encoded; None
    when no configured key opens it)."""

    id: int
    dag_id: str
    run_id: str
    task_id: str
    state: str
    try_number: int
    result: bytes | None
    error: str | None
    trigger_id: int | None
    next_method: str | None
    first_try_at: dt.datetime | None
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    trigger_timeout_at: dt.datetime | None
    run_after: dt.datetime
    #: The start of the current try (``first_try_at``: of the first; ``started_at``: of the
    #: latest claim, which a resume or reschedule renews).
    try_started_at: dt.datetime | None = None
    #: The error of the try before the current one (``error`` is the current try's).
    previous_error: str | None = None
    #: When an ``up_for_retry`` / ``up_for_reschedule`` task becomes runnable; None otherwise.
    retry_at: dt.datetime | None = None
    #: Seconds from the start of the first try to the end of the last (to now if not ended).
    duration_s: float | None = None
    #: What the templated fields rendered to at the start of the latest try (field → value);
    #: None when nothing was rendered.
    rendered_fields: dict[str, Any] | None = None
    #: The instance of a mapped task (0..n-1); -1: not mapped.
    map_index: int = -1


class DagRunSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A run in ``list_dag_runs``, with how many of its task instances are in each state
    (field order: ``runs list --json`` keys)."""

    dag_id: str
    run_id: str
    run_type: str
    logical_date: dt.datetime
    data_interval_start: dt.datetime | None
    data_interval_end: dt.datetime | None
    state: str
    conf: dict[str, Any]
    created_at: dt.datetime
    ended_at: dt.datetime | None
    tasks: dict[str, int]


class WorkLeft(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine has left to do now (``work_left``)."""

    runnable: int
    deferred_due: int
    runs_to_end: int
