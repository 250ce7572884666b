"""The structs of engine/store/callbacks.py: callback requests (migration 0022)."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

import msgspec

__all__ = ["CallbackKind", "CallbackRequest", "ClaimedCallback"]

#: What a callback request is for: a task instance's outcome (``success``, ``failure``,
#: ``retry``, ``skipped``), its run's end (``dag_success``, ``dag_failure``), or a deadline
#: alert of its run that fired (``deadline``).
CallbackKind = Literal[
    "success", "failure", "retry", "skipped", "dag_success", "dag_failure", "deadline"
]


class ClaimedCallback(msgspec.Struct, frozen=True, kw_only=True):
    """A callback request a worker claimed, with its try and its run."""

    id: int
    kind: CallbackKind
    dag_id: str
    run_id: str
    logical_date: dt.datetime
    conf: dict[str, Any]
    db_now: dt.datetime
    #: How many times it was claimed, this claim included (more than one: a worker that held
    #: it died).
    claims: int
    created_at: dt.datetime
    #: The task instance and try whose outcome it is (None: a run's).
    ti_id: int | None = None
    task_id: str | None = None
    #: The mapped instance's index (-1: not mapped, or a run's request).
    map_index: int | None = -1
    try_number: int | None = None
    first_try_at: dt.datetime | None = None
    try_started_at: dt.datetime | None = None
    execution_timeout_s: float | None = None
    #: The outcome's error, as written with it.
    error: str | None = None
    deadline_index: int | None = None
    deadline_at: dt.datetime | None = None
    data_interval_start: dt.datetime | None = None
    data_interval_end: dt.datetime | None = None
    run_type: str = "manual"
    run_state: str = "running"
    queued_at: dt.datetime | None = None


class CallbackRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A callback request not run yet."""

    id: int
    kind: CallbackKind
    dag_id: str
    ti_id: int | None
    try_number: int | None
    error: str | None
    deadline_index: int | None
    deadline_at: dt.datetime | None
    worker_id: int | None
    lease_until: dt.datetime | None
    claims: int
    created_at: dt.datetime
