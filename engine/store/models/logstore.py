"""Log lines, written and read (engine/store/logstore.py)."""

from __future__ import annotations

import datetime as dt

import msgspec

__all__ = [
    "LogLine",
    "LoggedTry",
    "TaskLogRow",
    "TaskLogs",
    "TriggerLogRow",
    "TriggerLogs",
]


class LogLine(msgspec.Struct, frozen=True, kw_only=True):
    """One stored log line of a trigger or a task try. ``seq`` orders the lines (pass the
    last one seen as ``after_seq`` to read on); ``at`` is when the process logged it;
    ``stream`` is ``log`` for a logging record, ``stdout``/``stderr`` for what a task
    printed."""

    seq: int
    at: dt.datetime
    level: str
    logger: str
    message: str
    stream: str = "log"


class LoggedTry(msgspec.Struct, frozen=True, kw_only=True):
    """One try of a task instance, by its names (a try that waited on a trigger that logged)."""

    dag_id: str
    run_id: str
    task_id: str
    try_number: int


class TriggerLogs(msgspec.Struct, frozen=True, kw_only=True):
    """A page of a trigger's log lines (``Store.trigger_logs``). ``waiting``: the trigger
    still waits (its row exists); once it is False, every line the trigger logged before it
    fired is stored. ``next_seq``: the ``after_seq`` of the next page (lines logged later
    come after it). ``tasks``: the tries that waited on it while it logged."""

    trigger_id: int
    waiting: bool
    classpath: str | None
    lines: list[LogLine]
    next_seq: int
    tasks: list[LoggedTry]


class TaskLogs(msgspec.Struct, frozen=True, kw_only=True):
    """A page of a task try's log lines (``Store.task_logs``). ``try_number``: the try shown
    (the latest when none was asked; 0: none has started). ``state`` and ``latest_try``: the
    task instance's now (None: no such task instance). ``ended``: this try is over, and every
    line it logged before its outcome is stored. ``next_seq``: the ``after_seq`` of the next
    page. ``trigger_ids``: the triggers this try waited on that logged (read their lines with
    ``Store.trigger_logs``)."""

    dag_id: str
    run_id: str
    task_id: str
    try_number: int
    state: str | None
    latest_try: int | None
    ended: bool
    lines: list[LogLine]
    next_seq: int
    trigger_ids: list[int]


class TriggerLogRow(msgspec.Struct, frozen=True, array_like=True):
    """A trigger log line waiting to be written."""

    trigger_id: int
    at: float
    level: str
    logger: str
    message: str


class TaskLogRow(msgspec.Struct, frozen=True, array_like=True):
    """A task log line waiting to be written."""

    dag_id: str
    run_id: str
    task_id: str
    try_number: int
    at: float
    level: str
    stream: str
    logger: str
    message: str
