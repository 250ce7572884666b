"""What ``deferral tasks test`` records of its one task (engine/testing/tasktest.py): the
records the task and its trigger log, each deferral and resume, how a trigger ended the task,
as a :class:`TaskTestReport` and as text lines while they happen. Everything recorded is
masked (:func:`mask_secrets`, engine.masking)."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

from engine import masking
from engine.runtime import logs
from engine.store import Store
from engine.store.models import (
    ClaimedTask,
    Deferral,
    FiredTriggers,
    TaskClaim,
    TimedOutTask,
    TriggerOutcome,
)
from engine.usercode import logsink
from operators.defaults import DEFAULT_QUEUE
from triggers.base import decode_value

__all__ = [
    "Capture",
    "LogLine",
    "Quiet",
    "Recorder",
    "RecordingStore",
    "SeenDeferral",
    "SeenResume",
    "TaskTestReport",
    "capturing",
    "mask_secrets",
    "show",
]

_MASK = masking.MASK


class LogLine(msgspec.Struct, frozen=True, kw_only=True):
    """One log record of the task or its trigger."""

    ts: float
    level: str
    logger: str
    message: str
    #: ``task`` (logged while the task ran) or ``trigger`` (by its trigger, on the triggerer).
    source: str
    exc: str | None = None


class SeenDeferral(msgspec.Struct, frozen=True, kw_only=True):
    """The task deferred: on this trigger, to resume at ``method_name``."""

    classpath: str
    #: The trigger's kwargs, secret-looking values masked (:func:`mask_secrets`).
    kwargs: Any
    method_name: str
    timeout_s: float | None


class SeenResume(msgspec.Struct, frozen=True, kw_only=True):
    """The task resumed at ``method_name`` with the trigger's event payload."""

    method_name: str
    event: Any


class TaskTestReport(msgspec.Struct, frozen=True, kw_only=True):
    """How the task's one try went (``deferral tasks test --json`` prints this object)."""

    dag_id: str
    task_id: str
    run_id: str
    logical_date: dt.datetime
    #: The scratch database the task ran on (dropped since).
    database: str
    state: str
    try_number: int
    result: Any
    error: str | None
    log: list[LogLine]
    deferrals: list[SeenDeferral]
    resumes: list[SeenResume]
    #: How a trigger ended the task itself (``TaskSuccessEvent`` ...) or its deferral timed
    #: out: ``{"kind": ..., "payload" | "error": ...}``; empty otherwise.
    trigger_ends: list[dict[str, Any]]


def mask_secrets(value: Any) -> Any:
    """``value`` with its secrets masked (:func:`engine.masking.redact`, the one
    masking function of the engine: registered secrets, sensitive key names such as
    ``password``, ``token``, ``api_key``, and secret shapes in text such as URL passwords)."""
    return masking.redact(value)


def show(value: Any) -> str:
    """A value as JSON text when it is plain data, else its repr."""
    try:
        return msgspec.json.encode(value).decode()
    except (TypeError, ValueError, OverflowError):
        return repr(value)


class Recorder:
    """What happened, in order: the report's lists, and ``on_line`` as it happens."""

    def __init__(self, on_line: Callable[[str], None] | None) -> None:
        self.on_line = on_line
        self.log: list[LogLine] = []
        self.deferrals: list[SeenDeferral] = []
        self.resumes: list[SeenResume] = []
        self.trigger_ends: list[dict[str, Any]] = []

    def say(self, line: str) -> None:
        if self.on_line is not None:
            # Called from the task's own context too: shown here, not stored as its log.
            with logsink.unbound():
                self.on_line(masking.redact_text(line))

    def deferred(self, deferral: Deferral) -> None:
        try:
            kwargs = mask_secrets(decode_value(deferral.kwargs))
        except (TypeError, ValueError, msgspec.DecodeError):
            kwargs = _MASK
        item = SeenDeferral(
            classpath=deferral.classpath,
            kwargs=kwargs,
            method_name=deferral.method_name,
            timeout_s=deferral.timeout_s,
        )
        self.deferrals.append(item)
        # A sensor defers with what is left of its timeout (59.9997 s of 60): rounded to 0.1 s.
        timeout = f" (timeout {round(item.timeout_s, 1):g}s)" if item.timeout_s is not None else ""
        self.say(f"deferred on {item.classpath} {show(item.kwargs)}{timeout}")

    def resumed(self, ti: ClaimedTask) -> None:
        assert ti.next_method is not None
        event = mask_secrets(decode_value(ti.next_event)) if ti.next_event else None
        self.resumes.append(SeenResume(method_name=ti.next_method, event=event))
        self.say(f"resumed at {ti.next_method} with {show(event)}")

    def trigger_ended(self, outcome: TriggerOutcome) -> None:
        end: dict[str, Any] = {"kind": outcome.kind}
        if outcome.kind == "failed":
            end["error"] = mask_secrets(outcome.error)
            self.say(f"the trigger failed the task: {outcome.error}")
        else:
            payload = decode_value(outcome.payload) if outcome.payload else None
            end["payload"] = mask_secrets(payload)
            self.say(f"the trigger ended the task as {outcome.kind} with {show(end['payload'])}")
        self.trigger_ends.append(end)

    def timed_out(self, moved: TimedOutTask) -> None:
        end = {"kind": "timeout", "error": f"the deferral timed out (now {moved.state})"}
        self.trigger_ends.append(end)
        self.say(end["error"])


class RecordingStore(Store):
    """The store of the scratch database, noting deferrals, resumes and trigger outcomes on
    their way to the database (the only task there is the one under test)."""

    recorder: Recorder

    async def defer_tasks(
        self, worker_id: int, deferrals: Sequence[tuple[int, Deferral]]
    ) -> set[int]:
        parked = await super().defer_tasks(worker_id, deferrals)
        for ti_id, deferral in deferrals:
            if ti_id in parked:
                self.recorder.deferred(deferral)
        return parked

    async def reschedule_task(
        self, ti_id: int, worker_id: int, at: dt.datetime, *, try_number: int
    ) -> bool:
        ok = await super().reschedule_task(ti_id, worker_id, at, try_number=try_number)
        if ok:
            self.recorder.say(f"rescheduled to {at.isoformat()}")
        return ok

    async def claim_tasks(
        self,
        worker_id: int,
        limit: int,
        *,
        queues: Sequence[str] = (DEFAULT_QUEUE,),
        parallelism: int = 0,
    ) -> TaskClaim:
        claim = await super().claim_tasks(worker_id, limit, queues=queues, parallelism=parallelism)
        for ti in claim.claimed:
            if ti.next_method:
                self.recorder.resumed(ti)
        return claim

    async def handed_tasks(self, worker_id: int, limit: int) -> TaskClaim:
        handed = await super().handed_tasks(worker_id, limit)
        for ti in handed.claimed:
            if ti.next_method:
                self.recorder.resumed(ti)
        return handed

    async def fire_triggers(
        self, triggerer_id: int, outcomes: Sequence[TriggerOutcome]
    ) -> FiredTriggers:
        fired = await super().fire_triggers(triggerer_id, outcomes)
        for outcome in outcomes:
            if outcome.trigger_id in fired.accepted and outcome.kind != "event":
                self.recorder.trigger_ended(outcome)
        return fired

    async def timeout_deferrals(
        self, trigger_ids: Sequence[int] | None, *, grace_s: float = 0.0
    ) -> list[TimedOutTask]:
        moved = await super().timeout_deferrals(trigger_ids, grace_s=grace_s)
        for row in moved:
            self.recorder.timed_out(row)
        return moved


class Capture(logging.Handler):
    """Keeps the records logged while the task or its trigger ran (bound ids say which)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__(logging.NOTSET)
        self.recorder = recorder

    @staticmethod
    def source(record: logging.LogRecord) -> str | None:
        ids = logs.bound()
        if "trigger" in ids:
            return "trigger"
        if "task" in ids:
            return "task"
        return None

    @staticmethod
    def shown(record: logging.LogRecord) -> bool:
        """Of the records bound to the task or its trigger: the ones of user code and the
        built-in operators and triggers, and the engine's warnings (a blocked loop, a thread
        past its timeout). The engine's info lines and its errors (the outcome, which the
        report gives) are left out."""
        if record.name == "engine" or record.name.startswith("engine."):
            return record.levelno == logging.WARNING
        return True

    def emit(self, record: logging.LogRecord) -> None:
        source = self.source(record)
        if source is None or not self.shown(record):
            return
        try:
            message = record.getMessage()
        except Exception:  # a bad format string in user code: show it as written
            message = str(record.msg)
        exc = None
        if record.exc_info and record.exc_info[0] is not None:
            exc = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        message = masking.redact_text(message)
        exc = None if exc is None else masking.redact_text(exc)
        line = LogLine(
            ts=record.created,
            level=record.levelname,
            logger=record.name,
            message=message,
            source=source,
            exc=exc,
        )
        self.recorder.log.append(line)
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        text = f"{stamp}.{int(record.msecs):03d} {record.levelname:<7} {record.name}: {message}"
        self.recorder.say(text + (f"\n{exc}" if exc else ""))


class Quiet(logging.Filter):
    """On the process's own log handlers while the test runs: the task's and trigger's records
    are shown by the report (not twice), and the engine's info lines about starting and
    stopping its worker and triggerer are noise here."""

    def filter(self, record: logging.LogRecord) -> bool:
        if Capture.source(record) is not None:
            return False
        is_engine = record.name == "engine" or record.name.startswith("engine.")
        return not (is_engine and record.levelno < logging.WARNING)


@contextlib.contextmanager
def capturing(recorder: Recorder) -> Iterator[None]:
    root = logging.getLogger()
    capture = Capture(recorder)
    quiet = Quiet()
    handlers = [h for h in root.handlers if h is not capture]
    levels = {h: h.level for h in handlers}
    previous = root.level
    for handler in handlers:
        handler.addFilter(quiet)
        # (The process's own lines stay at its level: quiet by default, -v for INFO ...)
        handler.setLevel(max(handler.level, previous))
    # (... while the report records the task's and trigger's INFO lines whatever it is.)
    root.setLevel(min(previous, logging.INFO))
    root.addHandler(capture)
    try:
        yield
    finally:
        root.removeHandler(capture)
        root.setLevel(previous)
        for handler in handlers:
            handler.removeFilter(quiet)
            handler.setLevel(levels[handler])
