"""Testing: the authoring kit for triggers, and a whole engine run in-process.

The in-process engine (:mod:`engine.testing.harness`, re-exported here): :func:`run_engine` starts a
scheduler, a worker and a triggerer on a test database in the test's event loop;
:meth:`LocalEngine.drain` runs until nothing is runnable now (arq's burst mode) and
:meth:`LocalEngine.wait_for_state` waits for a task instance to reach a state.

The authoring kit tests a trigger without an engine, a database or guesswork.

* :func:`run_trigger` runs a trigger's ``run()`` until its first event and returns it, or
  fails with a clear :class:`TriggerTestError`: it timed out, it raised, it returned without
  an event, or it blocked the event loop (a ``time.sleep``, a sync HTTP call, a big file read
  inside ``run()``), reported with the trigger's name and the line that blocked.
* :func:`assert_serializable` proves the trigger survives the trip to a triggerer:
  ``serialize()`` → rebuild from the classpath → ``serialize()`` gives the same
  MessagePack-encodable kwargs.
* :func:`run_trigger_sync` is :func:`run_trigger` for code that has no event loop.

Use them in ``pytest`` (``async def`` tests with anyio, or plain ones with the sync variant).
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio

from engine.config import DEFAULT_BLOCKED_LOOP_S
from engine.testing.harness import DEFAULT_WAIT_S, EngineTimeout, LocalEngine, run_engine
from engine.triggerer.watchdog import BlockReport, LoopWatchdog
from triggers.base import (
    BaseTrigger,
    TriggerEvent,
    decode_value,
    encode_value,
    rebuild_trigger,
    validate_trigger,
)

__all__ = [
    "DEFAULT_BLOCKING_THRESHOLD_S",
    "DEFAULT_WAIT_S",
    "EngineTimeout",
    "LocalEngine",
    "TriggerBlockedLoop",
    "TriggerRaised",
    "TriggerReturnedWithoutEvent",
    "TriggerTestError",
    "TriggerTimedOut",
    "assert_serializable",
    "run_engine",
    "run_trigger",
    "run_trigger_sync",
]

#: A single step of trigger code running longer than this without yielding blocks the loop:
#: the triggerer's own default (setting ``triggerer_blocked_loop_s``).
DEFAULT_BLOCKING_THRESHOLD_S = DEFAULT_BLOCKED_LOOP_S


class TriggerTestError(AssertionError):
    """A trigger did not behave as a trigger must."""


class TriggerTimedOut(TriggerTestError):
    """No event within the timeout."""


class TriggerRaised(TriggerTestError):
    """``run()`` raised; the original exception is the ``__cause__``."""


class TriggerReturnedWithoutEvent(TriggerTestError):
    """``run()`` ended without yielding an event: the task would wait until its timeout."""


class TriggerBlockedLoop(TriggerTestError):
    """Trigger code held the event loop without yielding, starving every other trigger."""


def assert_serializable(trigger: BaseTrigger) -> BaseTrigger:
    """Check that ``trigger`` rebuilds from its ``(classpath, kwargs)`` into an equal trigger;
    returns the rebuilt one. Fails with the engine's own explanation when it does not."""
    try:
        serialized = validate_trigger(trigger)
    except Exception as exc:
        raise TriggerTestError(f"{trigger!r} is not serializable: {exc}") from exc
    rebuilt = rebuild_trigger(serialized.classpath, decode_value(serialized.kwargs))
    classpath, kwargs = rebuilt.serialize()
    if classpath != serialized.classpath or encode_value(kwargs) != serialized.kwargs:
        raise TriggerTestError(f"{trigger!r} does not rebuild into an equal trigger")
    lost = sorted(
        name
        for name, value in _plain_attributes(trigger).items()
        if _plain_attributes(rebuilt).get(name, _MISSING) != value
    )
    if lost:
        raise TriggerTestError(
            f"{trigger!r} does not survive a round trip: after rebuilding from its kwargs, "
            f"attribute(s) {', '.join(lost)} differ; serialize() must return every argument "
            "__init__ needs"
        )
    return rebuilt


_MISSING = object()


def _plain_attributes(trigger: BaseTrigger) -> dict[str, Any]:
    """Public instance attributes that hold plain data (live objects are not compared)."""
    plain = {}
    for name, value in vars(trigger).items():
        if name.startswith("_"):
            continue
        try:
            encode_value(value)
        except (TypeError, ValueError, OverflowError):
            continue
        plain[name] = value
    return plain


class _BlockCheck:
    """The triggerer's own loop watchdog (:class:`engine.triggerer.watchdog.LoopWatchdog`) watching
    the trigger's task: what it reports here is what a triggerer would report and enforce."""

    def __init__(self, name: str, task_name: str, threshold_s: float | None) -> None:
        self.name = name
        self.task_name = task_name
        self.threshold_s = threshold_s
        self.reports: list[BlockReport] = []
        self._ended: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: LoopWatchdog | None = None

    def __enter__(self) -> _BlockCheck:
        if self.threshold_s is not None:
            self._loop = asyncio.get_running_loop()
            self._ended = asyncio.Event()
            self._watchdog = LoopWatchdog(
                self._loop, threshold_s=self.threshold_s, on_block=self._on_block
            )
            self._watchdog.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()

    def _on_block(self, report: BlockReport) -> None:
        # On the watchdog's thread: record, and hop to the loop to say a block ended.
        if report.task_name != self.task_name:
            return  # another task of the caller's loop blocked it, not the trigger
        if report not in self.reports:
            self.reports.append(report)
        if report.ended and self._loop is not None and self._ended is not None:
            self._loop.call_soon_threadsafe(self._ended.set)

    async def settle(self) -> None:
        """Let a block seen at the trigger's last step end, so its length is known (the
        watchdog notices within a quarter of the threshold once the loop is free)."""
        if self.threshold_s is None or self._ended is None:
            return
        with anyio.move_on_after(self.threshold_s * 4 + 1):
            while any(not r.ended for r in self.reports):
                self._ended.clear()
                await self._ended.wait()

    def check(self) -> None:
        if not self.reports or self.threshold_s is None:
            return
        worst = max(self.reports, key=lambda r: r.duration_s)
        where = f"\nit was blocked here:\n  {worst.location}" if worst.location else ""
        raise TriggerBlockedLoop(
            f"{self.name} blocked the event loop for {worst.duration_s * 1000:.0f} ms in one step "
            f"(limit {self.threshold_s * 1000:.0f} ms, as a triggerer's blocked_loop_s): run() "
            "must await, never call blocking code such as time.sleep, requests or file reads; "
            f"use asyncio.sleep, aiohttp or anyio.to_thread.run_sync{where}"
        )


async def run_trigger(
    trigger: BaseTrigger,
    *,
    timeout: float = 10.0,  # noqa: ASYNC109 - the kit's public, documented parameter
    check_serializable: bool = True,
    blocking_threshold: float | None = DEFAULT_BLOCKING_THRESHOLD_S,
) -> TriggerEvent:
    """Run ``trigger`` as a triggerer would (after a serialization round trip, on the current
    loop) and return its first event. ``cleanup()`` runs afterwards in every case.

    Raises :class:`TriggerTimedOut`, :class:`TriggerRaised`,
    :class:`TriggerReturnedWithoutEvent`, or :class:`TriggerBlockedLoop` when one step of its
    code held the loop longer than ``blocking_threshold`` seconds (``None`` turns the check
    off).
    """
    name = repr(trigger)
    if check_serializable:
        trigger = assert_serializable(trigger)
    agen = trigger.run()

    async def first_event() -> TriggerEvent | None:
        try:
            async for event in agen:
                return event
            return None
        finally:
            try:
                aclose = getattr(agen, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                await trigger.cleanup()

    # Named as the triggerer names a trigger's task: the watchdog reports the task it caught.
    task_name = f"trigger-test-{id(trigger)}"
    with _BlockCheck(name, task_name, blocking_threshold or None) as watch:
        task = asyncio.get_running_loop().create_task(first_event(), name=task_name)
        try:
            event = await asyncio.wait_for(task, timeout)
        except TimeoutError:
            await watch.settle()
            watch.check()
            raise TriggerTimedOut(f"{name} yielded no event within {timeout}s") from None
        except TriggerTestError:
            raise
        except Exception as exc:
            await watch.settle()
            watch.check()
            raise TriggerRaised(f"{name} raised {type(exc).__name__}: {exc}") from exc
        await watch.settle()
    watch.check()
    if event is None:
        raise TriggerReturnedWithoutEvent(
            f"{name}: run() returned without yielding an event; a trigger must yield one "
            "TriggerEvent (or a TaskSuccessEvent / TaskFailedEvent / TaskSkippedEvent)"
        )
    if not isinstance(event, TriggerEvent):
        raise TriggerTestError(f"{name} yielded {event!r}, which is not a TriggerEvent")
    try:
        encode_value(event.payload)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TriggerTestError(f"{name} yielded a payload that cannot be stored: {exc}") from None
    return event


def run_trigger_sync(trigger: BaseTrigger, **kwargs: Any) -> TriggerEvent:
    """:func:`run_trigger` on a fresh event loop, for code that has none."""
    return asyncio.run(run_trigger(trigger, **kwargs))
