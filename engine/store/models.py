"""Rows that cross from the store to the processes: frozen structs, not database records."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

from engine.states import TaskOutcomeKind, TriggerOutcomeKind

__all__ = [
    "AuditRow",
    "Backlog",
    "ClaimedTask",
    "ClaimedTrigger",
    "Dag",
    "DagOverview",
    "DagRun",
    "DagRunSummary",
    "DagSummary",
    "Deferral",
    "DueDag",
    "EndedRun",
    "FinishedTask",
    "FiredTriggers",
    "Fleet",
    "FleetTriggerer",
    "GridCell",
    "Heartbeat",
    "LogLine",
    "LoggedTry",
    "MovedTask",
    "OldestWait",
    "PoolRow",
    "RunRow",
    "RunSquare",
    "RunSummary",
    "SchedulerRow",
    "StopRequest",
    "TaskInstance",
    "TaskLogs",
    "TaskOutcome",
    "TaskTry",
    "TimedOutTask",
    "TriggerClassCount",
    "TriggerListing",
    "TriggerLogs",
    "TriggerOutcome",
    "TriggerRow",
    "TriggerWaiters",
    "TriggererHealth",
    "TriggererRow",
    "WaitingTask",
    "WorkLeft",
    "WorkerRow",
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
    #: When the task became runnable; for a resume, when its trigger's event was written.
    run_after: dt.datetime | None = None
    #: The run's data interval and how it came to be (scheduled, manual, backfill).
    data_interval_start: dt.datetime | None = None
    data_interval_end: dt.datetime | None = None
    run_type: str = "manual"


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
    """A deferral timeout_deferrals ended, with the trigger it waited on (its classpath: None
    when the trigger row was gone already)."""

    trigger_id: int | None
    classpath: str | None = None


class FiredTriggers(msgspec.Struct, frozen=True, kw_only=True):
    """What fire_triggers wrote: the triggers whose outcome was accepted (the others were
    refused by the fencing check), the task instances that moved, and whether the statement
    already woke the workers."""

    accepted: frozenset[int]
    moved: list[MovedTask]
    woke: bool


# -- reads ---------------------------------------------------------------------------------


class StopRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A try a worker was told to stop (a mark or a clear), and why."""

    ti_id: int
    try_number: int
    reason: str


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker's heartbeat learned: whether the worker is still registered, how many
    tries it was told to stop were settled as ended (their slots free), and the tries it runs
    that it must stop."""

    alive: bool
    stopped: int
    stop: list[StopRequest]


class PoolRow(msgspec.Struct, frozen=True, kw_only=True):
    """A pool and what it holds: ``running`` (running tries, and tries told to stop that have
    not stopped yet) and ``deferred`` in pool slots, ``queued``
    runnable tasks waiting for admission, ``open`` slots left (deferred ones count only with
    ``include_deferred``; negative once the pool is shrunk below what runs in it)."""

    name: str
    slots: int
    include_deferred: bool
    description: str | None
    running: int
    queued: int
    deferred: int
    open: int


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


class TriggerWaiters(msgspec.Struct, frozen=True, kw_only=True):
    """How many task instances still wait on a trigger, their earliest deadline, and the
    database's clock when read (``trigger_waiters``)."""

    id: int
    waiting: int
    timeout_at: dt.datetime | None
    db_now: dt.datetime


class WaitingTask(msgspec.Struct, frozen=True, kw_only=True):
    """A task instance waiting on a trigger."""

    dag_id: str
    run_id: str
    task_id: str


class TriggerRow(msgspec.Struct, frozen=True, kw_only=True):
    """A trigger in ``list_triggers`` / ``get_trigger``: its owner, how many task instances
    wait on it and which (the first few in a list, all of them for one trigger), its kwargs
    (decrypted, still encoded; None when no configured key opens them) and, for one trigger,
    the owner's host and pid and which deadline ``timeout_at`` is."""

    id: int
    classpath: str
    triggerer_id: int | None
    fence: int
    timeout_at: dt.datetime | None
    created_at: dt.datetime
    waiting: int
    kwargs: bytes | None = None
    tasks: list[WaitingTask] = msgspec.field(default_factory=list)
    triggerer_hostname: str | None = None
    triggerer_pid: int | None = None
    deadline_kind: str | None = None


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


# -- the status page (engine/web/; reads in engine/store/status.py) ------------------------


class TriggererHealth(msgspec.Struct, frozen=True, kw_only=True):
    """How a triggerer's event loop fares, written with its lease renewals: the p99 of its lag
    over the recent watchdog ticks, the blocks seen since it started and the longest one's
    trigger class."""

    loop_lag_p99_ms: float | None = None
    blocked_loops: int = 0
    worst_blocker: str | None = None
    worst_block_ms: float | None = None


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


class RunSummary(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    dag_id: str
    run_id: str
    logical_date: dt.datetime
    conf: dict[str, Any]
    state: str
    created_at: dt.datetime
    ended_at: dt.datetime | None
    task_counts: dict[str, int]


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


class TriggerClassCount(msgspec.Struct, frozen=True, kw_only=True):
    classpath: str
    triggers: int
    held: int
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
