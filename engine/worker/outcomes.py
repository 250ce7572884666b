"""How a try ended, as one value: :data:`TryOutcome`.

A try's method either returns or raises; what came of it is classified here, once, into one
of six frozen structs: :class:`Returned` (the encoded result), :class:`Raised` (the error text
to record), :class:`Deferred`, :class:`Rescheduled`, :class:`Skipped` or :class:`Failed` (a
``FailTask``). The same function does it wherever the method ran: :func:`outcome_of_call` in
a worker thread and in an isolated task's child process (which sends the value back over its
pipe as it is: the union is tagged MessagePack), :func:`outcome_of_coroutine` for an
``async def`` on the worker's loop. The recorder (``recorder.py``) then writes it with one
``match``.

What can be checked without the database is checked here, so that every path refuses the
same things the same way: a result that cannot be stored, a deferral's timeout or resume
kwargs, a reschedule time without a timezone. Each ends the try failed, without retries
(the same call would be refused again).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from engine.usercode.tracebacks import format_user_exception
from operators.base import MAX_WAIT_S, FailTask, RescheduleRequested, SkipTask, TaskDeferred
from operators.signals import SkipTasks
from operators.xcom import RETURN_KEY, XComError
from triggers.base import SerializedTrigger, encode_value
from triggers.values import encode_data

if TYPE_CHECKING:
    from engine.store import ClaimedTask

__all__ = [
    "Deferred",
    "ExecutionTimeout",
    "Expanded",
    "Failed",
    "InvalidDeferral",
    "Raised",
    "Rescheduled",
    "Returned",
    "Skipped",
    "TryOutcome",
    "describe",
    "outcome_of_call",
    "outcome_of_coroutine",
    "outcome_of_error",
    "timed_out",
    "worker_cancelled",
    "xcom_size_error",
    "xcom_type_error",
]


class ExecutionTimeout(Exception):
    """The try ran longer than the task's execution_timeout (counted across deferrals)."""


class InvalidDeferral(ValueError):
    """A deferral (or reschedule) the worker will not store: it fails its task, no retry."""


class Returned(msgspec.Struct, frozen=True, tag="returned"):
    """The method returned: ``triggers.values.encode_data`` of its value (None for None), its
    ``return_value`` XCom (the worker checks its size against ``xcom_max_bytes``). ``skip``:
    the tasks of the run a branching task skips (it returned
    :class:`operators.signals.SkipTasks`)."""

    result: bytes | None
    skip: tuple[str, ...] = ()
    #: The asset events its success records (its outlets: ``[{"asset", "extra"}]``; None:
    #: none), written with the success.
    asset_events: list[dict[str, Any]] | None = None


class Raised(msgspec.Struct, frozen=True, tag="raised"):
    """The try failed: the text to record (a traceback, or why); ``no_retry`` when retrying
    cannot help."""

    error: str
    no_retry: bool = False


class Deferred(msgspec.Struct, frozen=True, tag="deferred"):
    """A ``TaskDeferred``, checked: the trigger as stored, the method to resume and its
    encoded kwargs, the trigger's own timeout (seconds, within ``MAX_WAIT_S``)."""

    trigger: SerializedTrigger
    method_name: str
    method_kwargs: bytes
    timeout_s: float | None


class Rescheduled(msgspec.Struct, frozen=True, tag="rescheduled"):
    """A ``RescheduleRequested``: when to run again (timezone-aware, in UTC)."""

    at: dt.datetime


class Skipped(msgspec.Struct, frozen=True, tag="skipped"):
    """A ``SkipTask``, with its message."""

    message: str


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    """A ``FailTask``, with its message: failed whatever retries remain."""

    message: str


class Expanded(msgspec.Struct, frozen=True, tag="expanded"):
    """A mapped task's values are known: it becomes ``count`` task instances (the worker's
    doing, not the task's: no call of the task's own ran), with each one's own arguments
    encoded (None: each instance reads them from the upstream values itself)."""

    count: int
    values: list[bytes] | None = None


TryOutcome = Returned | Raised | Deferred | Rescheduled | Skipped | Failed | Expanded


def outcome_of_call(call: Callable[[], Any], *, task: str = "") -> TryOutcome:
    """Run ``call`` (a task's method, its arguments bound) and say how the try ended. Whatever
    the call raises is the try's, ``SystemExit`` and ``KeyboardInterrupt`` included.
    ``task``: ``dag_id.task_id``, for the error of a return value that cannot be stored."""
    try:
        value = call()
    except BaseException as exc:
        return outcome_of_error(exc)
    return _returned(value, task)


async def outcome_of_coroutine(call: Callable[[], Awaitable[Any]], *, task: str = "") -> TryOutcome:
    """:func:`outcome_of_call` for an ``async def``, awaited on the running loop. The worker's
    own cancellation of the try (a stop, its timeout) passes through; a ``CancelledError`` of
    the task's own is its failure."""
    try:
        value = await call()
    except BaseException as exc:
        if worker_cancelled(exc):
            raise
        return outcome_of_error(exc)
    return _returned(value, task)


def worker_cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is the cancellation of the running asyncio task by its owner (the
    worker stops the try or its time is up), rather than one the task's code met (an inner
    task it awaited was cancelled). Never, outside an event loop (a thread, a child)."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    try:
        current = asyncio.current_task()
    except RuntimeError:
        return False
    return current is None or current.cancelling() > 0


def outcome_of_error(exc: BaseException) -> TryOutcome:
    """What a try that raised ``exc`` comes to."""
    if isinstance(exc, TaskDeferred):
        return _deferred(exc)
    if isinstance(exc, RescheduleRequested):
        return _rescheduled(exc.reschedule_at)
    if isinstance(exc, SkipTask):
        return Skipped(str(exc))
    if isinstance(exc, FailTask):
        return Failed(str(exc))
    if isinstance(exc, XComError):  # a value the store cannot keep: it would fail again
        return Raised(format_user_exception(exc), no_retry=True)
    return Raised(format_user_exception(exc))


def timed_out(ti: ClaimedTask, detail: str = "") -> Raised:
    """The failure of a try past its execution_timeout (retries apply); ``detail``: what
    became of its code."""
    message = (
        f"execution_timeout of {ti.execution_timeout_s}s passed (counted from the start of "
        f"this try, across deferrals){detail}"
    )
    return Raised(format_user_exception(ExecutionTimeout(message)))


def describe(ti: ClaimedTask) -> str:
    """A try, as the worker's log lines name it."""
    return f"{ti.dag_id}.{ti.task_id} (run {ti.run_id}, try {ti.try_number}, task instance {ti.id})"


def xcom_type_error(task: str, key: str, exc: Exception) -> str:
    """Why a value cannot be stored as XCom ``key`` of ``task``: its type (and where it sits)."""
    return (
        f"task {task}: XCom {key!r} cannot be stored as its value: {exc}; return or push "
        "JSON-like data (None, bool, int, float, str, list, dict with str keys) or "
        "datetime, date, time, timedelta, UUID, Decimal, bytes"
    )


def xcom_size_error(task: str, key: str, what: str, size: int, max_bytes: int) -> str:
    """Why a value of ``size`` bytes encoded cannot be stored as XCom ``key`` of ``task``."""
    return (
        f"task {task}: XCom {key!r}: {what} encodes to {size} bytes, over the limit of "
        f"{max_bytes} bytes (setting xcom_max_bytes); write large data to object storage and "
        "pass its path instead"
    )


def _returned(value: Any, task: str) -> Returned | Raised:
    """The return value as its ``return_value`` XCom, or why it cannot be stored (no
    retry: the same value would be refused again). A :class:`SkipTasks` is its value and the
    tasks to skip."""
    skip: tuple[str, ...] = ()
    if isinstance(value, SkipTasks):
        value, skip = value.value, value.task_ids
    if value is None:
        return Returned(None, skip)
    try:
        return Returned(encode_data(value), skip)
    except (TypeError, ValueError, OverflowError) as exc:
        return Raised(xcom_type_error(task or "?", RETURN_KEY, exc), no_retry=True)


def _refused(what: str, exc: Exception) -> Raised:
    """A deferral or reschedule that cannot be stored: failed without retries, saying why."""
    return Raised(f"{what}: {type(exc).__name__}: {exc}", no_retry=True)


def _deferred(deferred: TaskDeferred) -> Deferred | Raised:
    """The deferral to store, or why it cannot be. (A TaskDeferred may be built by hand,
    bypassing the checks of ``defer()``.) The stored deadline is not computed here:
    defer_tasks takes the earliest of this timeout and the task's execution_timeout, on the
    database clock, when it writes the deferral."""
    try:
        timeout_s = deferred.timeout_s
        if timeout_s is not None and not (
            isinstance(timeout_s, int | float)
            and not isinstance(timeout_s, bool)
            and math.isfinite(timeout_s)
            and 0 <= timeout_s <= MAX_WAIT_S
        ):
            raise InvalidDeferral(
                f"the deferral timeout must be a finite number of seconds from 0 to "
                f"{MAX_WAIT_S:.0f}; got a {type(timeout_s).__name__} outside that range"
            )
        method_kwargs = deferred.encoded_kwargs
        if not isinstance(method_kwargs, bytes):  # built by hand: not encoded by defer()
            try:
                method_kwargs = encode_value(deferred.kwargs)
            except (TypeError, ValueError, OverflowError) as exc:
                raise InvalidDeferral(f"the resume kwargs are not plain data: {exc}") from None
        trigger, method_name = deferred.trigger, deferred.method_name
        fields = (trigger.classpath, trigger.kwargs, trigger.dedup_key, method_name)
        if not all(isinstance(f, t) for f, t in zip(fields, (str, bytes, str, str), strict=True)):
            raise InvalidDeferral("the trigger is not a serialized trigger (use defer())")
        return Deferred(
            trigger=SerializedTrigger(trigger.classpath, trigger.kwargs, trigger.dedup_key),
            method_name=method_name,
            method_kwargs=method_kwargs,
            timeout_s=None if timeout_s is None else float(timeout_s),
        )
    except Exception as exc:  # any bad deferral fails its own task only
        return _refused("the task's deferral is invalid", exc)


def _rescheduled(at: Any) -> Rescheduled | Raised:
    if not isinstance(at, dt.datetime) or at.utcoffset() is None:
        exc = InvalidDeferral("the reschedule time must be a timezone-aware datetime")
        return _refused("the task's reschedule is invalid", exc)
    try:
        at = at.astimezone(dt.UTC)
    except OverflowError:
        exc = InvalidDeferral(
            f"the reschedule time lies more than {MAX_WAIT_S:.0f}s (ten years) ahead"
        )
        return _refused("the task's reschedule is invalid", exc)
    if type(at) is not dt.datetime:  # a subclass: the plain value, as it crosses a pipe
        at = dt.datetime(
            at.year, at.month, at.day, at.hour, at.minute, at.second, at.microsecond, dt.UTC
        )
    return Rescheduled(at)
