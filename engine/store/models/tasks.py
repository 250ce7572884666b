"""What the worker's statements take and return (engine/store/tasks.py): claims, outcomes,
deferrals, heartbeats."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

from engine.states import TaskOutcomeKind

__all__ = [
    "ClaimedTask",
    "Deferral",
    "Heartbeat",
    "StopRequest",
    "TaskClaim",
    "TaskOutcome",
    "ti_name",
]


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
    #: The instance of a mapped task (0..n-1); -1: not mapped, or a mapped task not yet
    #: expanded (the worker expands it).
    map_index: int = -1
    #: A mapped instance's own arguments as its expansion read them (encoded; None: not
    #: mapped, or read from the upstream values again).
    map_value: bytes | None = None

    @property
    def name(self) -> str:
        """The task instance's name where rows are keyed by names (tries, log lines): its
        task id, or ``TASK[i]`` for mapped instance i."""
        return ti_name(self.task_id, self.map_index)


def ti_name(task_id: str, map_index: int) -> str:
    """``task_id``, or ``task_id[map_index]`` for a mapped instance (the store's
    ``deferral_ti_name``; how the CLI and the status page address it)."""
    return task_id if map_index < 0 else f"{task_id}[{map_index}]"


class TaskOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """How a running try ended: ``success`` / ``skipped`` (with its encoded result) or
    ``failed`` (with the error; ``no_retry`` ends the task whatever retries remain), written
    only while ``worker_id`` still holds try ``try_number`` of the task. ``skip``: the tasks
    of its run a branching task's success skips (those still pending), written with it."""

    ti_id: int
    worker_id: int
    try_number: int
    kind: TaskOutcomeKind
    result: bytes | None = None
    error: str | None = None
    no_retry: bool = False
    #: The asset events a success records with it (``[{"asset": name, "extra": {...}}]``;
    #: None: none).
    asset_events: list[dict[str, Any]] | None = None
    skip: tuple[str, ...] = ()


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
    #: The try's log line about this deferral, written with it (None: none).
    line: str | None = None


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


class TaskClaim(msgspec.Struct, frozen=True, kw_only=True):
    """What ``claim_tasks`` (or ``unacknowledged_claims``) took for a worker.

    ``claimed``: the tries to run. ``refused``: tries it took that cannot run anywhere as they
    are (a resume no configured key opens, a pool that does not exist), as the failed
    outcomes the worker writes through its outbox like any other (nothing is written for them
    yet: until then they hold their slots, and a worker that dies first leaves them to the
    reaper). ``next_in``: with nothing claimed, in how many seconds the next waiting task
    becomes runnable (None: none waits for a time; 0.0: claim again now). ``held``: with
    nothing claimed, tasks of those queues are runnable now all the same (a limit holds them
    back, or another claim took them as this one looked)."""

    claimed: list[ClaimedTask]
    refused: list[TaskOutcome] = []
    next_in: float | None = None
    held: bool = False
