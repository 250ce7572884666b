"""Claiming: take unowned triggers in large batches and start them.

Woken by ``NOTIFY`` (and by the lease thread when it freed a gone triggerer's triggers, and by
room made here while the last claim stopped at capacity), polling as the backstop. The next
batch is asked for while the last one starts, so the database and the loop overlap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio

from engine.runtime.crashpoints import crash_point
from engine.runtime.retry import Backoff
from engine.security.allow import TriggerNotAllowed, check_classpath, check_import_paths
from engine.store import ClaimedTrigger, TriggerOutcome
from engine.store.models import ClaimedWatcher
from engine.triggerer.classes import TriggerClasses
from engine.triggerer.deadlines import Deadlines
from engine.triggerer.outcomes import TriggerOutbox
from engine.triggerer.running import TriggerRunner, task_name
from engine.triggerer.state import LoopState
from engine.triggerer.watching import WatcherRunner
from triggers.base import (
    BaseTrigger,
    TriggerSerializationError,
    decode_value,
    rebuild_trigger,
)

__all__ = ["START_SLICE", "Claimer"]

log = logging.getLogger("engine.triggerer")

#: Claimed triggers started per loop iteration.
START_SLICE = 1000


class Claimer:
    """The claim loop; ``claiming`` is true while a claim may have committed rows that are not
    held yet (the lease check must not call them unheld then)."""

    def __init__(
        self,
        state: LoopState,
        outcomes: TriggerOutbox,
        runner: TriggerRunner,
        deadlines: Deadlines,
        *,
        capacity: int,
        claim_batch: int,
        poll_interval_s: float,
        allow: Callable[[str], bool] | None,
        classes: TriggerClasses | None = None,
        watchers: WatcherRunner | None = None,
    ) -> None:
        self._state = state
        self._outcomes = outcomes
        self._runner = runner
        self._deadlines = deadlines
        self.capacity = capacity
        self.claim_batch = claim_batch
        self.poll_interval_s = poll_interval_s
        self._allow = allow
        self.claiming = False
        #: One string object per classpath, shared by every trigger of that class.
        self._classpaths: dict[str, str] = {}
        self._classes = classes if classes is not None else TriggerClasses()
        self._watchers = watchers

    async def run(self) -> None:
        """Claim until the triggerer stops."""
        state = self._state
        backoff = Backoff()
        while not state.stopping:
            self.claiming = True
            try:
                await self._claim_available()
            except Exception as exc:  # a lost connection, anything: pause, then claim again
                self.claiming = False
                await backoff.wait("claim triggers", exc)
                continue
            finally:
                self.claiming = False
            backoff.reset()
            await state.claim_wake.wait(self.poll_interval_s)

    async def _claim_available(self) -> None:
        # (The lease thread reaps gone triggerers several times a second and wakes this
        # loop when that freed triggers.)
        state, held = self._state, self._state.held
        loop = state.loop
        assert loop is not None
        triggerer_id = state.id
        if triggerer_id is None:
            return
        asked = min(self.capacity - len(held), self.claim_batch)
        if asked <= 0 or state.stopping:
            held.full = asked <= 0
            return
        batch = await self._claim(triggerer_id, asked)
        crash_point("triggerer.claim.after_commit")
        held.full = False
        while batch:
            # Ask for the next batch while this one starts: the database and the loop overlap.
            room = self.capacity - len(held) - len(batch)
            more = len(batch) == asked
            held.full = more and room <= 0
            next_asked = min(room, self.claim_batch) if more else 0
            pending = None
            if next_asked > 0 and not state.stopping:
                pending = loop.create_task(self._claim(triggerer_id, next_asked))
            await self._start_batch(batch)
            log.info("claimed %d trigger(s); holding %d", len(batch), len(held))
            if pending is None:
                return
            # Always awaited, never cancelled: a claim that committed must be started.
            batch, asked = await pending, next_asked
            crash_point("triggerer.claim.after_commit")

    async def _claim(self, triggerer_id: int, limit: int) -> list[ClaimedTrigger]:
        started = time.perf_counter()
        claim = await self._state.store.claim_triggers(triggerer_id, limit)
        rows = claim.claimed
        for refused in claim.refused:
            # Cannot run here or anywhere with these keys: held until its failure is written,
            # like a trigger that cannot be built.
            outcome = refused.outcome
            self._state.held.take(outcome.trigger_id, outcome.fence, refused.classpath)
            self._outcomes.emit(outcome)
        metrics = self._state.metrics
        metrics.claim_duration.labels("triggers").observe(time.perf_counter() - started)
        if rows:
            metrics.claim_batch.labels("triggers").observe(len(rows))
            metrics.count_by_class(metrics.trigger_starts, (row.classpath for row in rows))
        return rows

    async def _start_batch(self, rows: list[ClaimedTrigger]) -> None:
        """Start claimed triggers a slice at a time, letting the loop run in between (timers
        of the triggers already held stay on time), and take them out of the garbage
        collector's generations once started."""
        await self._import_new_classes(rows)
        watchers = await self._claimed_watchers(rows)
        for first in range(0, len(rows), START_SLICE):
            for row in rows[first : first + START_SLICE]:
                watcher = watchers.get(row.id)
                if watcher is not None:
                    self._start_watcher(row, watcher)
                else:
                    self._start(row)
            await asyncio.sleep(0)  # the new tasks take their first step, up to their wait
            self._state.freeze()

    async def _claimed_watchers(self, rows: list[ClaimedTrigger]) -> dict[int, ClaimedWatcher]:
        """The claimed rows that run asset watchers, with the cursor each starts from; read
        after the claim committed. A row is a watcher's by its link in the watchers' table,
        whatever its class: one this triggerer cannot import, may not run (allow-list) or that
        is no event trigger is that watcher's fault, recorded on it and retried with backoff
        (on the ordinary path its failure would delete the row and the watchers' sync make it
        again, in a loop nobody sees)."""
        triggerer_id = self._state.id
        if self._watchers is None or triggerer_id is None or not rows:
            return {}
        found = await self._state.store.claimed_watchers(triggerer_id, [row.id for row in rows])
        return {w.trigger_id: w for w in found}

    def _start_watcher(self, row: ClaimedTrigger, watcher: ClaimedWatcher) -> None:
        """Start an asset watcher: built (again after each fault) from the row's kwargs."""
        assert self._watchers is not None
        classpath = self._classpaths.setdefault(row.classpath, row.classpath)
        held = self._state.held.take(row.id, row.fence, classpath)
        self._watchers.start(
            row.id,
            held,
            watcher,
            # (kwargs that do not decode are the watcher's fault too, raised by each build)
            lambda: self._rebuild(classpath, decode_value(row.kwargs), row.sealed),
            task_name(row.id, row.fence),
        )

    async def _import_new_classes(self, rows: list[ClaimedTrigger]) -> None:
        """Import the trigger classes not seen yet (or whose file in the DAGs folder changed) in
        a thread: a first import (aiohttp's, say) can take a good part of a second, which would
        stall every held trigger."""
        classpaths = {row.classpath for row in rows}
        self._classes.check(classpaths)
        for classpath in classpaths:
            if classpath in self._classes:
                continue
            if self._allow is not None and not self._allow(classpath):
                continue
            try:
                await anyio.to_thread.run_sync(self._classes.load, classpath)
            except TriggerSerializationError:
                continue  # _start reports it, for each trigger of that classpath

    def _rebuild(self, classpath: str, kwargs: dict[str, Any], sealed: bool = True) -> BaseTrigger:
        """``rebuild_trigger``, importing and checking each class once per triggerer; a
        trigger that runs commands only from ``sealed`` kwargs."""
        if self._allow is not None:
            check_classpath(self._allow, classpath)  # before the import
        cls = self._classes.get(classpath)
        if cls is None:
            cls = self._classes.load(classpath)
        if self._allow is not None:
            check_import_paths(self._allow, classpath, cls, kwargs)  # before __init__ imports
        if not sealed and getattr(cls, "runs_commands", False):
            raise TriggerNotAllowed(
                f"trigger {classpath} runs a command its kwargs hold, and this row's kwargs "
                "were stored in plaintext while the engine has an encryption key: no engine "
                "process wrote them, so the command is not run"
            )
        return rebuild_trigger(classpath, kwargs, cls)

    def _start(self, row: ClaimedTrigger) -> None:
        classpath = self._classpaths.setdefault(row.classpath, row.classpath)
        held = self._state.held.take(row.id, row.fence, classpath)
        try:
            trigger = self._rebuild(classpath, decode_value(row.kwargs), row.sealed)
        except Exception as exc:
            self._outcomes.emit(
                TriggerOutcome(
                    trigger_id=row.id,
                    fence=row.fence,
                    kind="failed",
                    error=f"the triggerer could not build the trigger: {exc}",
                )
            )
            return
        self._runner.start(row.id, held, trigger)
        if row.timeout_at is not None:
            self._deadlines.arm(row.id, held, row.timeout_at, row.db_now)
