"""What the triggerer's statements take and return (engine/store/triggers.py), and the
triggers and triggerers the CLI lists."""

from __future__ import annotations

import datetime as dt

import msgspec

from engine.states import TriggerOutcomeKind

__all__ = [
    "ClaimedTrigger",
    "RefusedTrigger",
    "TriggerClaim",
    "TriggerOutcome",
    "TriggerRow",
    "TriggerWaiters",
    "TriggererHealth",
    "TriggererRow",
    "WaitingTask",
]


class ClaimedTrigger(msgspec.Struct, frozen=True, kw_only=True):
    """A trigger a triggerer claimed, with the fencing token its writes must present."""

    id: int
    classpath: str
    kwargs: bytes
    fence: int
    timeout_at: dt.datetime | None
    db_now: dt.datetime
    #: Its kwargs were stored encrypted with a configured key (or no key is configured, and
    #: nothing is): False for a plaintext row while keys exist, which no engine process wrote.
    sealed: bool = True


class TriggerOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """How a trigger ended: ``event`` (resume), ``success`` / ``skipped`` / ``failed`` (end)."""

    trigger_id: int
    fence: int
    kind: TriggerOutcomeKind
    payload: bytes | None = None
    error: str | None = None
    #: The event's payload as the waiting tries' logs show it (masked, cut): written with
    #: the outcome as their line about it (``fire_triggers``). None: a line without it.
    shown: str | None = None


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


class TriggererHealth(msgspec.Struct, frozen=True, kw_only=True):
    """How a triggerer's event loop fares, written with its lease renewals: the p99 of its lag
    over the recent watchdog ticks, the blocks seen since it started and the longest one's
    trigger class."""

    loop_lag_p99_ms: float | None = None
    blocked_loops: int = 0
    worst_blocker: str | None = None
    worst_block_ms: float | None = None


class RefusedTrigger(msgspec.Struct, frozen=True, kw_only=True):
    """A claimed trigger that cannot run: its failed outcome, and its class."""

    classpath: str
    outcome: TriggerOutcome


class TriggerClaim(msgspec.Struct, frozen=True, kw_only=True):
    """What ``claim_triggers`` took for a triggerer: ``claimed``, the triggers to run, and
    ``refused``, the triggers it took that cannot run anywhere with these keys (kwargs no
    configured key opens) as failed outcomes under the fence of this claim, each with its
    classpath. Nothing is written for them yet: the triggerer writes them through its outbox
    like any other outcome (a triggerer that dies first leaves them to the next owner)."""

    claimed: list[ClaimedTrigger]
    refused: list[RefusedTrigger] = []
