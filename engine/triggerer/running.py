"""Running one trigger: start its task, watch it for its first event, turn that into an outcome.

Trigger code is untrusted: whatever it raises (SystemExit, KeyboardInterrupt, GeneratorExit, a
CancelledError of its own, ...) in ``run()`` or ``cleanup()`` fails that trigger's tasks and
ends nothing else; only the triggerer's own cancellation of the task ends it without an
outcome.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Generator
from typing import Any

from engine.masking import shown_json
from engine.runtime import logs
from engine.store import TriggerOutcome
from engine.triggerer.held import Held
from engine.triggerer.outcomes import TriggerOutbox
from engine.triggerer.state import LoopState
from engine.usercode import guard as usercode
from engine.usercode.tracebacks import format_user_exception
from triggers.base import (
    MAX_PAYLOAD_BYTES,
    BaseTrigger,
    TaskEndEvent,
    TriggerEvent,
    encode_value,
)

__all__ = ["TriggerRunner", "task_name", "trigger_of"]

log = logging.getLogger("engine.triggerer")


def task_name(trigger_id: int, fence: int) -> str:
    """The asyncio task's name carries the fence: the watchdog's thread fails a blocker by it."""
    return f"trigger-{trigger_id}:{fence}"


def trigger_of(name: str | None) -> tuple[int, int] | None:
    """The trigger id and fence in a trigger task's name: the watchdog's thread learns them
    without reading the loop's state."""
    if not name or not name.startswith("trigger-"):
        return None
    trigger_id, _, fence = name[len("trigger-") :].partition(":")
    if not trigger_id.isdigit() or not fence.isdigit():
        return None
    return int(trigger_id), int(fence)


def _cancelled_by_us() -> bool:
    """The current task is being cancelled by the triggerer (not by trigger code raising
    CancelledError of its own, as a cancelled inner task does)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class TriggerRunner:
    """Starts and watches trigger tasks; their outcomes go to the triggerer's outbox."""

    def __init__(
        self, state: LoopState, outcomes: TriggerOutbox, *, cleanup_timeout_s: float
    ) -> None:
        self._state = state
        self._outcomes = outcomes
        self.cleanup_timeout_s = cleanup_timeout_s

    def start(self, trigger_id: int, held: Held, trigger: BaseTrigger) -> None:
        loop = self._state.loop
        assert loop is not None
        held.task = loop.create_task(
            self._watch(trigger_id, held, trigger), name=task_name(trigger_id, held.fence)
        )

    async def _watch(self, trigger_id: int, held: Held, trigger: BaseTrigger) -> None:
        logs.bind(trigger=trigger_id, classpath=held.classpath)
        # (Its lines and prints are stored per trigger by that id: Triggerer.run bound the
        # triggers' log sink once for every trigger task, engine/usercode/logsink.py.)
        usercode.enter_user_code()  # tasks the trigger starts cannot end the process
        outcome: TriggerOutcome | None = None
        agen = None
        try:
            agen = trigger.run()
            if not hasattr(agen, "__anext__"):
                close = getattr(agen, "close", None)
                if close is not None:
                    close()  # a coroutine (async def without yield): never awaited, closed
                raise TypeError(
                    f"{held.classpath}.run() must be an async generator (async def with yield), "
                    f"got {type(agen).__name__}"
                )
            event = await agen.__anext__()
            outcome = self._outcome(trigger_id, held, event)
        except StopAsyncIteration:
            outcome = _failed(
                trigger_id, held, f"trigger {held.classpath} returned without yielding an event"
            )
        except BaseException as exc:
            # Anything trigger code raises fails its tasks and ends nothing else; only the
            # triggerer's own cancellation of this task ends it without an outcome.
            if _cancelled_by_us():
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            outcome = _failed(
                trigger_id,
                held,
                f"trigger {held.classpath} raised:\n" + format_user_exception(exc),
            )
        finally:
            if outcome is not None:
                self._outcomes.emit(outcome)
            await self._close(trigger, agen, held)
            self._state.logs.end(trigger_id)

    async def _close(self, trigger: BaseTrigger, agen: object, held: Held) -> None:
        try:
            closing = _closing(trigger, agen)
            # Its first step here, without a timeout: most triggers close without waiting for
            # anything (no cleanup of their own, nothing awaited in their generator's finally),
            # and a timeout is a timer scheduled and cancelled on the loop for each trigger.
            # One that waits finishes under the timeout, from where it waits.
            try:
                waiting_on = closing.send(None)
            except StopIteration:
                return
            async with asyncio.timeout(self.cleanup_timeout_s):
                await _Resumed(closing, waiting_on)
        except TimeoutError:
            log.warning(
                "cleanup of %s did not finish within %.1fs; abandoned",
                held.classpath,
                self.cleanup_timeout_s,
            )
        except BaseException as exc:  # trigger code: whatever it raises ends nothing else
            if isinstance(exc, asyncio.CancelledError) and _cancelled_by_us():
                raise
            log.error(
                "cleanup of %s raised %s",
                held.classpath,
                format_user_exception(exc),
            )

    @staticmethod
    def _outcome(trigger_id: int, held: Held, event: object) -> TriggerOutcome:
        if not isinstance(event, TriggerEvent):
            return _failed(
                trigger_id,
                held,
                f"trigger {held.classpath} yielded {type(event).__name__}, not a TriggerEvent",
            )
        if isinstance(event, TaskEndEvent) and event.state not in ("success", "failed", "skipped"):
            return _failed(
                trigger_id,
                held,
                f"trigger {held.classpath} yielded a bare {type(event).__name__}, which says "
                "neither how the task ends nor why: yield TaskSuccessEvent, TaskFailedEvent or "
                "TaskSkippedEvent",
            )
        if isinstance(event, TaskEndEvent) and event.state == "failed":
            reason = event.payload if event.payload is not None else "no reason given"
            return TriggerOutcome(
                trigger_id=trigger_id,
                fence=held.fence,
                kind="failed",
                error=f"trigger {held.classpath} failed the task: {reason}",
            )
        try:
            payload = encode_value(event.payload)
        except (TypeError, ValueError, OverflowError) as exc:
            return _failed(
                trigger_id,
                held,
                f"trigger {held.classpath} yielded an event whose payload cannot be stored: {exc}",
            )
        if len(payload) > MAX_PAYLOAD_BYTES:
            return _failed(
                trigger_id,
                held,
                f"trigger {held.classpath} yielded a payload of {len(payload)} bytes, over the "
                f"limit of {MAX_PAYLOAD_BYTES}",
            )
        kind = event.state if isinstance(event, TaskEndEvent) else "event"
        return TriggerOutcome(
            trigger_id=trigger_id,
            fence=held.fence,
            kind=kind,
            payload=payload,
            shown=shown_json(event.payload),
        )


async def _closing(trigger: BaseTrigger, agen: object) -> None:
    """Close the trigger's generator (if it made one), then run its cleanup."""
    aclose = getattr(agen, "aclose", None)
    if aclose is not None:
        await aclose()
    await trigger.cleanup()


class _Resumed:
    """Awaits a coroutine that already took its first step and is waiting on ``waiting_on``
    (what that step yielded to the task): each value sent and each exception thrown in (a
    cancellation) goes on to the coroutine, as ``await`` would have passed them."""

    __slots__ = ("_coro", "_waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        self._coro = coro
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, None]:
        coro, waiting_on = self._coro, self._waiting_on
        while True:
            try:
                sent = yield waiting_on
            except BaseException as exc:
                try:
                    waiting_on = coro.throw(exc)
                except StopIteration:
                    return
                continue
            try:
                waiting_on = coro.send(sent)
            except StopIteration:
                return


def _failed(trigger_id: int, held: Held, error: str) -> TriggerOutcome:
    log.error("%s", error)
    return TriggerOutcome(trigger_id=trigger_id, fence=held.fence, kind="failed", error=error)
