"""Asset watchers: event triggers run for as long as their triggerer holds them.

A watcher is a trigger row like any other (claimed in batches, leased, fenced, adopted on
failover: the held set holds it), but no task waits on it and it never fires: each event its
trigger yields is queued here with the trigger's cursor after it, and the writer writes them
in batches, one statement each (``record_watcher_events``): the asset events and the cursor
together, only while this triggerer still owns the row with the fence it claimed. A trigger
that raises or returns is recorded on its watcher (the error, a restart more, when it starts
again) and built again from its kwargs after a backoff, from the last cursor it yielded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from engine.runtime import logs
from engine.runtime.outbox import Outbox
from engine.store.models import ClaimedWatcher, WatcherFault, WatcherItem
from engine.triggerer.held import Held
from engine.triggerer.state import LoopState
from engine.usercode import guard as usercode
from engine.usercode.tracebacks import format_user_exception
from triggers.base import (
    BaseEventTrigger,
    BaseTrigger,
    Checkpoint,
    CursorEvent,
    decode_value,
    encode_value,
)

__all__ = ["WATCHER_BACKOFF_S", "WatcherOutbox", "WatcherRunner", "backoff_s"]

log = logging.getLogger("engine.triggerer")

#: A failing watcher starts again after the first of these seconds, doubling up to the second
#: while its runs keep failing within that second figure (a run that lasted longer starts the
#: series again).
WATCHER_BACKOFF_S = (1.0, 60.0)

_json = msgspec.json.Encoder()

WatcherWrite = WatcherItem | WatcherFault


def backoff_s(failures: int) -> float:
    """The pause before a watcher's ``failures``-th start in a row after a fault."""
    first, cap = WATCHER_BACKOFF_S
    return float(min(cap, first * 2 ** max(0, failures - 1)))


def _extra(payload: Any) -> dict[str, Any]:
    """An event's payload as an asset event's ``extra`` (a JSON object): a dict as it is,
    None as ``{}``, anything else under ``"payload"``; each NUL character in its strings
    (keys too) replaced by U+FFFD, which PostgreSQL's jsonb cannot hold (an outside body
    with a NUL byte would make the event unstorable once its cursor moved past it)."""
    if payload is None:
        return {}
    if not isinstance(payload, dict):
        payload = {"payload": payload}
    return _without_nul(payload)  # type: ignore[no-any-return]


def _without_nul(value: Any) -> Any:
    """``value`` with every NUL character of its strings replaced by U+FFFD (the same object
    when it holds none)."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd") if "\x00" in value else value
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without_nul(v) for v in value]
    return value


class WatcherOutbox(Outbox[WatcherWrite, int, bool]):
    """The writer of watchers' events and faults (its writer task: :meth:`run`)."""

    def __init__(self, state: LoopState) -> None:
        super().__init__(
            "write watcher events",
            write=self._write_batch,
            substitute=self._substitute,
            on_written=self._written,
            describe=lambda w: f"an event of watcher trigger {w.trigger_id}",
        )
        self._state = state
        #: Asset events written so far.
        self.recorded = 0

    @staticmethod
    def _substitute(item: WatcherWrite, exc: Exception) -> WatcherWrite:
        return WatcherFault(
            trigger_id=item.trigger_id,
            fence=item.fence,
            error=f"an event could not be stored: {type(exc).__name__}: {exc}",
            retry_in_s=0.0,
            restart=False,  # the trigger runs on: no restart to count, no backoff
        )

    async def _write_batch(self, batch: list[WatcherWrite]) -> dict[int, bool]:
        triggerer_id = self._state.id
        assert triggerer_id is not None
        store = self._state.store
        items = [w for w in batch if isinstance(w, WatcherItem)]
        written = await store.record_watcher_events(triggerer_id, items) if items else set()
        for fault in batch:
            if isinstance(fault, WatcherFault) and await store.watcher_failed(triggerer_id, fault):
                written.add(fault.trigger_id)
        return dict.fromkeys(written, True)

    def _written(self, batch: list[WatcherWrite], written: dict[int, bool]) -> None:
        for item in batch:
            if item.trigger_id not in written:
                log.warning(
                    "watcher trigger %s: not written, this triggerer no longer owns it",
                    item.trigger_id,
                )
            elif isinstance(item, WatcherItem) and item.is_event:
                self.recorded += 1


class WatcherRunner:
    """Starts and keeps watcher tasks; their events and faults go to the watcher outbox."""

    def __init__(
        self, state: LoopState, outbox: WatcherOutbox, *, cleanup_timeout_s: float
    ) -> None:
        self._state = state
        self._outbox = outbox
        self.cleanup_timeout_s = cleanup_timeout_s
        #: The held triggers that are watchers.
        self.running: set[int] = set()

    def stop_all(self) -> None:
        """Stop every watcher (the triggerer stops): no event comes after this."""
        for trigger_id in list(self.running):
            self._state.held.drop(trigger_id)
        self.running.clear()

    def start(
        self,
        trigger_id: int,
        held: Held,
        watcher: ClaimedWatcher,
        build: Callable[[], BaseTrigger],
        name: str,
    ) -> None:
        loop = self._state.loop
        assert loop is not None
        held.task = loop.create_task(self._keep(trigger_id, held, watcher, build), name=name)
        self.running.add(trigger_id)
        held.task.add_done_callback(lambda _task: self.running.discard(trigger_id))

    async def _keep(
        self,
        trigger_id: int,
        held: Held,
        watcher: ClaimedWatcher,
        build: Callable[[], BaseTrigger],
    ) -> None:
        logs.bind(trigger=trigger_id, classpath=held.classpath)
        usercode.enter_user_code()
        cursor = None if watcher.cursor is None else decode_value(watcher.cursor)
        seq = 0
        failures = 0
        restarts = watcher.restarts  # (as its faults count them: one a fault here)
        what = f"watcher {watcher.name!r} of asset {watcher.asset!r} ({held.classpath})"
        while True:
            trigger: BaseTrigger | None = None
            agen: Any = None
            error: str | None = None
            started = asyncio.get_running_loop().time()
            try:
                trigger = build()
                if not isinstance(trigger, BaseEventTrigger):
                    raise TypeError(f"{held.classpath} is not an event trigger (BaseEventTrigger)")
                trigger.resume_from(cursor)
                agen = trigger.run()
                if not hasattr(agen, "__anext__"):
                    raise TypeError(f"{held.classpath}.run() must be an async generator")
                log.info("%s started (restarts so far: %d)", what, restarts)
                while True:
                    try:
                        event = await agen.__anext__()
                    except StopAsyncIteration:
                        error = (
                            f"{what}: run() returned; an event trigger yields events for as "
                            "long as it runs"
                        )
                        break
                    has_cursor = isinstance(event, CursorEvent | Checkpoint)
                    extra = None if isinstance(event, Checkpoint) else _extra(event.payload)
                    if extra is not None:
                        _json.encode(extra)  # not JSON: a fault of the trigger, said here
                    if has_cursor:
                        cursor = event.cursor
                    seq += 1
                    self._outbox.put(
                        WatcherItem(
                            trigger_id=trigger_id,
                            fence=held.fence,
                            extra=extra,
                            is_event=extra is not None,
                            cursor=encode_value(cursor) if has_cursor else None,
                            has_cursor=has_cursor,
                            seq=seq,
                        )
                    )
            except BaseException as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling() > 0:
                    await self._close(trigger, agen, what)
                    raise
                error = f"{what} raised:\n" + format_user_exception(exc)
            await self._close(trigger, agen, what)
            if asyncio.get_running_loop().time() - started >= WATCHER_BACKOFF_S[1]:
                failures = 0  # it ran well for a while: this fault starts a new series
            failures += 1
            restarts += 1
            delay = backoff_s(failures)
            log.error("%s; starting it again in %.0fs", error, delay)
            self._outbox.put(
                WatcherFault(trigger_id=trigger_id, fence=held.fence, error=error, retry_in_s=delay)
            )
            await asyncio.sleep(delay)

    async def _close(self, trigger: BaseTrigger | None, agen: Any, what: str) -> None:
        try:
            async with asyncio.timeout(self.cleanup_timeout_s):
                aclose = getattr(agen, "aclose", None)
                if aclose is not None:
                    await aclose()
                if trigger is not None:
                    await trigger.cleanup()
        except BaseException as exc:  # its cleanup's faults end nothing else
            if isinstance(exc, asyncio.CancelledError):
                task = asyncio.current_task()
                if task is not None and task.cancelling() > 0:
                    raise
            log.warning("cleanup of %s failed: %s: %s", what, type(exc).__name__, exc)
