"""Testing: the authoring kit for triggers, and a whole engine run in-process.

The in-process engine (:mod:`engine.harness`, re-exported here): :func:`run_engine` starts a
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
import sys
import threading
import time
import traceback
from collections.abc import Coroutine, Generator
from typing import Any

from engine.harness import DEFAULT_WAIT_S, EngineTimeout, LocalEngine, run_engine
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

#: A single step of trigger code running longer than this without yielding blocks the loop.
DEFAULT_BLOCKING_THRESHOLD_S = 0.1


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


class _BlockWatch:
    """Times every step of the trigger's coroutine; a watchdog thread samples the loop
    thread's stack while a step runs too long, so the report names the blocking line."""

    def __init__(self, name: str, threshold_s: float) -> None:
        self.name = name
        self.threshold_s = threshold_s
        self.step_started: float | None = None
        self.worst_s = 0.0
        self.stack: str | None = None
        self.thread_id = threading.get_ident()
        self._stop = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch, name="trigger-block-watch", daemon=True
        )

    def __enter__(self) -> _BlockWatch:
        if self.threshold_s != float("inf"):
            self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._watcher.is_alive():
            self._watcher.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.threshold_s / 4):
            started = self.step_started
            if started is None or self.stack is not None:
                continue
            if time.perf_counter() - started > self.threshold_s:
                frame = sys._current_frames().get(self.thread_id)
                if frame is not None and self.step_started == started:
                    frames = [
                        f
                        for f in traceback.extract_stack(frame)
                        if f.filename != __file__ and "asyncio" not in f.filename
                    ]
                    self.stack = "".join(traceback.format_list(frames[-4:]))

    def wrap(self, coro: Coroutine[Any, Any, Any]) -> Coroutine[Any, Any, Any]:
        return _timed(coro, self)

    def check(self) -> None:
        if self.worst_s > self.threshold_s:
            where = f"\nit was blocked here:\n{self.stack}" if self.stack else ""
            raise TriggerBlockedLoop(
                f"{self.name} blocked the event loop for {self.worst_s * 1000:.0f} ms in one step "
                f"(limit {self.threshold_s * 1000:.0f} ms): run() must await, never call blocking "
                "code such as time.sleep, requests or file reads; use asyncio.sleep, aiohttp or "
                f"anyio.to_thread.run_sync{where}"
            )


async def _timed(coro: Coroutine[Any, Any, Any], watch: _BlockWatch) -> Any:
    return await _Stepper(coro, watch)


class _Stepper:
    """Drives a coroutine step by step (as the loop would), timing each step."""

    def __init__(self, coro: Coroutine[Any, Any, Any], watch: _BlockWatch) -> None:
        self.coro = coro
        self.watch = watch

    def __await__(self) -> Generator[Any, Any, Any]:
        to_send: Any = None
        to_throw: BaseException | None = None
        while True:
            self.watch.step_started = started = time.perf_counter()
            try:
                if to_throw is not None:
                    yielded = self.coro.throw(to_throw)
                else:
                    yielded = self.coro.send(to_send)
            except StopIteration as stop:
                self._record(started)
                return stop.value
            except BaseException:
                self._record(started)
                raise
            self._record(started)
            try:
                to_send, to_throw = (yield yielded), None
            except GeneratorExit:
                self.coro.close()
                raise
            except BaseException as exc:  # cancellation and errors go into the coroutine
                to_send, to_throw = None, exc

    def _record(self, started: float) -> None:
        self.watch.step_started = None
        self.watch.worst_s = max(self.watch.worst_s, time.perf_counter() - started)


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
    watch = _BlockWatch(name, blocking_threshold if blocking_threshold else float("inf"))
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

    with watch:
        try:
            event = await asyncio.wait_for(watch.wrap(first_event()), timeout)
        except TimeoutError:
            watch.check()
            raise TriggerTimedOut(f"{name} yielded no event within {timeout}s") from None
        except TriggerTestError:
            raise
        except Exception as exc:
            watch.check()
            raise TriggerRaised(f"{name} raised {type(exc).__name__}: {exc}") from exc
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
