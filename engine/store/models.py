"""Rows that cross from the store to the processes: frozen structs, not database records."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

from engine.states import TaskOutcomeKind, TriggerOutcomeKind

__all__ = ["ClaimedTask", "ClaimedTrigger", "Deferral", "TaskOutcome", "TriggerOutcome"]


class ClaimedTask(msgspec.Struct, frozen=True, kw_only=True):
    """A task instance a worker claimed: what it needs to run it or resume it."""

    id: int
    dag_id: str
    run_id: str
    task_id: str
    try_number: int
    logical_date: dt.datetime
    conf: dict[str, Any]
    first_try_at: dt.datetime
    try_started_at: dt.datetime
    execution_timeout_s: float | None
    db_now: dt.datetime
    next_method: str | None = None
    next_kwargs: bytes | None = None
    next_event: bytes | None = None


class TaskOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """How a running try ended: ``success`` / ``skipped`` (with its encoded result) or
    ``failed`` (with the error; ``no_retry`` ends the task whatever retries remain), written
    only while ``worker_id`` still holds try ``try_number`` of the task."""

    ti_id: int
    worker_id: int
    try_number: int
    kind: TaskOutcomeKind
    result: bytes | None = None
    error: str | None = None
    no_retry: bool = False


class Deferral(msgspec.Struct, frozen=True, kw_only=True):
    """A running try handing its wait to a trigger. ``try_number``: only that try may defer
    (a write replayed by a claim that no longer holds the task changes nothing); None: any."""

    classpath: str
    kwargs: bytes
    dedup_key: str
    method_name: str
    method_kwargs: bytes
    timeout_s: float | None
    try_number: int | None = None


class ClaimedTrigger(msgspec.Struct, frozen=True, kw_only=True):
    """A trigger a triggerer claimed, with the fencing token its writes must present."""

    id: int
    classpath: str
    kwargs: bytes
    fence: int
    timeout_at: dt.datetime | None
    db_now: dt.datetime


class TriggerOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """How a trigger ended: ``event`` (resume), ``success`` / ``skipped`` / ``failed`` (end)."""

    trigger_id: int
    fence: int
    kind: TriggerOutcomeKind
    payload: bytes | None = None
    error: str | None = None
