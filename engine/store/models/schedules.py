"""What the schedule and admission statements take and return (engine/store/schedules.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

__all__ = [
    "DueDag",
    "NewRun",
    "NextRun",
    "RunRow",
    "StartedRun",
]


class DueDag(msgspec.Struct, frozen=True, kw_only=True):
    """A DAG whose next scheduled run may be created now (``due_dags``), locked."""

    dag_id: str
    timetable: dict[str, Any]
    start_date: dt.datetime | None
    end_date: dt.datetime | None
    catchup: bool
    next_dagrun_data_interval_start: dt.datetime
    next_dagrun_data_interval_end: dt.datetime
    next_dagrun_create_after: dt.datetime
    db_now: dt.datetime


class RunRow(msgspec.Struct, frozen=True, kw_only=True):
    """A run in ``list_runs`` / ``runs_at``."""

    id: int
    dag_id: str
    run_id: str
    run_type: str
    logical_date: dt.datetime
    data_interval_start: dt.datetime | None
    data_interval_end: dt.datetime | None
    state: str
    conf: dict[str, Any]
    created_at: dt.datetime
    started_at: dt.datetime | None
    ended_at: dt.datetime | None


class NewRun(msgspec.Struct, frozen=True, kw_only=True):
    """A run to insert (``queued``): scheduled, manual or backfill."""

    dag_id: str
    run_id: str
    logical_date: dt.datetime
    data_interval_start: dt.datetime
    data_interval_end: dt.datetime
    run_type: str
    conf: dict[str, Any] = {}


class StartedRun(msgspec.Struct, frozen=True, kw_only=True):
    """A run ``start_queued_runs`` moved from queued to running."""

    id: int
    dag_id: str
    run_id: str
    task_count: int


class NextRun(msgspec.Struct, frozen=True, kw_only=True):
    """The next scheduled run of a DAG (all None: none)."""

    dag_id: str
    logical_date: dt.datetime | None
    interval_end: dt.datetime | None
    create_after: dt.datetime | None
