"""Rows that cross from the store to the processes: frozen structs, not database records."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

from engine.states import TaskOutcomeKind, TriggerOutcomeKind

__all__ = [
    "ClaimedTask",
    "ClaimedTrigger",
    "Dag",
    "DagRun",
    "DagSummary",
    "Deferral",
    "EndedRun",
    "FinishedTask",
    "FiredTriggers",
    "LogLine",
    "MovedTask",
    "TaskInstance",
    "TaskLogs",
    "TaskOutcome",
    "TaskTry",
    "TimedOutTask",
    "TriggerLogs",
    "TriggerOutcome",
    "TriggerRow",
    "TriggerWaiters",
    "TriggererRow",
    "WorkLeft",
]

# Every read of the store returns these (converted from the database's records by msgspec,
# whole rows at a time); no asyncpg.Record leaves engine/store/. Field names and order are
# the named query's columns: the CLI's --json output encodes them as they are.


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


# -- rows moved by a write (the caller resolves their downstreams: engine/store/downstream.py)


class MovedTask(msgspec.Struct, frozen=True, kw_only=True):
    """A task instance a committed write moved to ``state`` (resolve_pending, reap_zombie_tasks,
    fire_triggers)."""

    id: int
    dag_run_id: int
    task_id: str
    state: str
    is_leaf: bool


class FinishedTask(MovedTask, frozen=True, kw_only=True):
    """A try finish_tasks ended, with the worker that ran it."""

    worker_id: int


class TimedOutTask(MovedTask, frozen=True, kw_only=True):
    """A deferral timeout_deferrals ended, with the trigger it waited on."""

    trigger_id: int | None


class FiredTriggers(msgspec.Struct, frozen=True, kw_only=True):
    """What fire_triggers wrote: the triggers whose outcome was accepted (the others were
    refused by the fencing check), the task instances that moved, and whether the statement
    already woke the workers."""

    accepted: frozenset[int]
    moved: list[MovedTask]
    woke: bool


# -- reads ---------------------------------------------------------------------------------


class DagSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A DAG in ``list_dags``: its task count and latest run."""

    dag_id: str
    fileloc: str
    tasks: int
    description: str | None
    updated_at: dt.datetime
    last_run_id: str | None
    last_run_state: str | None


class Dag(msgspec.Struct, frozen=True, kw_only=True):
    """A DAG's stored structure (``get_dag``)."""

    dag_id: str
    fileloc: str
    tasks: list[dict[str, Any]]
    description: str | None


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


class EndedRun(msgspec.Struct, frozen=True, kw_only=True):
    """A run ``finish_dag_runs`` ended."""

    id: int
    dag_id: str
    run_id: str
    state: str


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


class WorkLeft(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine has left to do now (``work_left``)."""

    runnable: int
    deferred_due: int
    runs_to_end: int


class TriggerWaiters(msgspec.Struct, frozen=True, kw_only=True):
    """How many task instances still wait on a trigger, their earliest deadline, and the
    database's clock when read (``trigger_waiters``)."""

    id: int
    waiting: int
    timeout_at: dt.datetime | None
    db_now: dt.datetime


class TriggerRow(msgspec.Struct, frozen=True, kw_only=True):
    """A trigger in ``list_triggers``, with its owner and how many task instances wait on it."""

    id: int
    classpath: str
    triggerer_id: int | None
    fence: int
    timeout_at: dt.datetime | None
    created_at: dt.datetime
    waiting: int


class TriggererRow(msgspec.Struct, frozen=True, kw_only=True):
    """A triggerer in ``list_triggerers``, with the number of triggers it holds."""

    id: int
    hostname: str
    pid: int
    capacity: int
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    lease_expires_at: dt.datetime
    expired: bool
    held: int


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


class TaskTry(msgspec.Struct, frozen=True, kw_only=True):
    """One try of a task instance, by its names."""

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
    tasks: list[TaskTry]


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
