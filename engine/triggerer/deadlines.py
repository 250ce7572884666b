"""Deferral deadlines: one loop timer per held trigger, for its earliest waiting deadline.

A timer that fires marks its trigger due; a deadline pass ends the deferrals past their
deadline (on the database clock), re-arms the timer for the next one, and drops the
triggers nobody waits on any more. A task that joins a held trigger with an earlier deadline
sends ``NOTIFY deferral_deadlines`` with the trigger id: that trigger is due at once.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging

from engine.runtime.retry import Backoff, with_db_retry
from engine.runtime.wakeup import Wakeup
from engine.store import TriggerWaiters
from engine.store.downstream import settle
from engine.store.models import TimedOutTask
from engine.triggerer.held import Held, HeldSet
from engine.triggerer.state import LoopState

__all__ = ["Deadlines"]

log = logging.getLogger("engine.triggerer")


class Deadlines:
    def __init__(self, state: LoopState) -> None:
        self._state = state
        self._due: set[int] = set()
        self._wake = Wakeup()

    def arm(self, trigger_id: int, held: Held, deadline: dt.datetime, db_now: dt.datetime) -> None:
        loop = self._state.loop
        assert loop is not None
        if held.timer is not None:
            held.timer.cancel()
        delay = (deadline - db_now).total_seconds()
        held.timer = loop.call_at(loop.time() + delay, self.due, trigger_id)

    def due(self, trigger_id: int) -> None:
        """On the loop: a deadline pass looks at this trigger."""
        self._due.add(trigger_id)
        self._wake.set()

    def notified(self, payload: str) -> None:
        if payload.isdigit() and int(payload) in self._state.held:
            # A task joined a trigger held here with an earlier deadline than its timer's: a
            # deadline pass re-reads the trigger's earliest deadline and re-arms the timer.
            self.due(int(payload))

    async def run(self) -> None:
        backoff = Backoff()
        while True:
            await self._wake.wait(None)
            due = [tid for tid in self._due if tid in self._state.held]
            self._due.clear()
            if not due:
                continue
            try:
                await self._pass(due)
            except Exception as exc:  # keep the deadlines for the next pass
                self._due.update(due)
                self._wake.set()
                await backoff.wait("time out deferrals", exc)
                continue
            backoff.reset()

    async def _pass(self, due: list[int]) -> None:
        """End the deferrals of ``due`` past their deadline, re-arm the others' timers, and
        drop the triggers nobody waits on any more."""
        store, held_set = self._state.store, self._state.held
        rows = await with_db_retry(
            "time out deferrals", functools.partial(store.timeout_deferrals, due)
        )
        await settle(store, rows)
        if rows:
            metrics = self._state.metrics
            metrics.count_by_class(
                metrics.trigger_timeouts, (_classpath_of(row, held_set) for row in rows)
            )
        for row in rows:
            classpath = _classpath_of(row, held_set)
            log.warning(
                "task instance %s (%s) timed out waiting on trigger %s (%s): its deadline "
                "passed before the trigger fired; now %s",
                row.id,
                row.task_id,
                row.trigger_id,
                classpath,
                row.state,
            )
        unused = self._rearm(
            await with_db_retry(
                "read trigger waiters", functools.partial(store.trigger_waiters, due)
            )
        )
        triggerer_id = self._state.id
        if not unused or triggerer_id is None:
            return
        # Their lines first: a reader that sees a trigger gone has all it logged.
        await self._state.logs.flush_keys(unused)
        dropped = await with_db_retry(
            "drop unused triggers",
            functools.partial(store.delete_owned_triggers, triggerer_id, unused),
        )
        joined: set[int] = set()
        if len(dropped) < len(unused):
            # The drop refused some: a task joined them meanwhile (keep running them, timed
            # for the new waiters), or this triggerer no longer owns them.
            refused = [tid for tid in unused if tid not in dropped]
            again = await with_db_retry(
                "read trigger waiters", functools.partial(store.trigger_waiters, refused)
            )
            joined = {w.id for w in again if w.waiting > 0 and w.id in held_set}
            self._rearm([w for w in again if w.id in joined])
        for trigger_id in unused:
            if trigger_id not in joined:
                held_set.drop(trigger_id)

    def _rearm(self, waiters: list[TriggerWaiters]) -> list[int]:
        """Re-arm the timers of triggers still waited on; returns the ids nobody waits on."""
        unused = []
        for w in waiters:
            held = self._state.held.get(w.id)
            if held is None:
                continue
            if w.waiting == 0:
                unused.append(w.id)
            elif w.timeout_at is not None:
                self.arm(w.id, held, w.timeout_at, w.db_now)
        return unused


def _classpath_of(row: TimedOutTask, held_set: HeldSet) -> str:
    """The classpath of the trigger a timed-out task waited on: as the store read it, else the
    held trigger's, else "unknown" (metrics label it so; the log line says so)."""
    if row.classpath is not None:
        return row.classpath
    held = held_set.get(row.trigger_id) if row.trigger_id is not None else None
    return held.classpath if held is not None else "unknown"
