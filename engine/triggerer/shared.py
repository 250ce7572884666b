"""What the parts of one triggerer share, all of it owned by the triggerer's event loop.

Other threads (the lease keeper's, the watchdog's) never touch it: they hop to the loop
with ``call_soon_threadsafe`` first.
"""

from __future__ import annotations

import asyncio
import gc
import logging

from engine.runtime.metrics import Metrics
from engine.runtime.outbox import Outbox
from engine.runtime.wakeup import Wakeup
from engine.store import Store, TriggerOutcome
from engine.store.downstream import settle
from engine.triggerer.held import HeldSet
from engine.usercode.logsink import LogLimits, LogSink

__all__ = ["WRITE_BATCH", "Shared"]

log = logging.getLogger("engine.triggerer")

#: Outcomes written per transaction at most. asyncpg encodes the arrays on the loop (~50 us an
#: outcome): 1,000 keeps that under ~60 ms of loop time per write.
WRITE_BATCH = 1000


def _substitute(outcome: TriggerOutcome, exc: Exception) -> TriggerOutcome:
    return TriggerOutcome(
        trigger_id=outcome.trigger_id,
        fence=outcome.fence,
        kind="failed",
        error=f"the trigger's outcome could not be stored: {type(exc).__name__}: {exc}",
    )


class Shared:
    """The triggerer's registration, held set, outbox and the claim loop's wake-up."""

    def __init__(self, store: Store, metrics: Metrics, log_limits: LogLimits | None = None) -> None:
        self.store = store
        self.metrics = metrics
        #: This triggerer's registration (None until the lease thread registered it).
        self.id: int | None = None
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.claim_wake = Wakeup()
        self.held = HeldSet(on_room=self.claim_wake.set)
        self.fired = 0
        self._frozen_at = 0
        #: The triggers' log lines (engine/usercode/logsink.py), written in batches, within the
        #: bounds of the settings log_* (``log_limits``).
        self.logs = LogSink(store, "trigger", limits=log_limits)
        #: Outcomes (events and failures) waiting for the writer.
        self.outbox: Outbox[TriggerOutcome, int, bool] = Outbox(
            "write trigger events",
            write=self._write,
            substitute=_substitute,
            on_written=self._written,
            describe=lambda o: f"the outcome of trigger {o.trigger_id}",
            max_items=WRITE_BATCH,
            crash_before="triggerer.fire.before_write",
            crash_after="triggerer.fire.after_write",
            observe=self._observe_write,
        )

    def _observe_write(self, size: int, duration_s: float) -> None:
        self.metrics.write_batch.labels("trigger_events").observe(size)
        self.metrics.write_duration.labels("trigger_events").observe(duration_s)

    def emit(self, outcome: TriggerOutcome) -> None:
        """Queue a trigger's outcome for the writer, counted as an event or a failure of its
        class (every outcome of the loop comes here: the run's, a build's, a cancel's)."""
        self.outbox.put(outcome)
        held = self.held.get(outcome.trigger_id)
        metrics = self.metrics
        counter = metrics.trigger_failures if outcome.kind == "failed" else metrics.trigger_events
        metrics.inc_by_class(counter, held.classpath if held is not None else "unknown")

    async def _write(self, batch: list[TriggerOutcome]) -> dict[int, bool]:
        triggerer_id = self.id
        assert triggerer_id is not None
        # The lines these triggers logged go first (nothing when they logged none): a reader
        # that sees a trigger gone has every line it logged before its event.
        await self.logs.flush_keys([o.trigger_id for o in batch])
        fired = await self.store.fire_triggers(triggerer_id, batch)
        await settle(self.store, fired.moved, woke=fired.woke)
        return dict.fromkeys(fired.accepted, True)

    def _written(self, batch: list[TriggerOutcome], accepted: dict[int, bool]) -> None:
        for outcome in batch:
            self.held.settle(outcome.trigger_id, outcome.fence)
            if outcome.trigger_id not in accepted:
                log.warning(
                    "outcome of trigger %s refused: this triggerer no longer owns it "
                    "(its lease lapsed and another triggerer adopted it)",
                    outcome.trigger_id,
                )
        self.fired += len(accepted)
        self.thaw_if_shrunk()
        log.debug("wrote %d outcome(s)", len(batch))

    def freeze(self) -> None:
        """Take what is allocated so far out of the collector's generations.

        A full collection walks every tracked object: at 100,000 waiting triggers (a dozen
        objects each) that is a pause of a second or more on the loop, in whichever trigger
        happened to allocate. Frozen objects are skipped by the collector and still freed by
        reference counting when their trigger ends; the collector gets them back (and any
        cycles among them) once the triggerer holds less than half of what it froze."""
        gc.freeze()
        self._frozen_at = max(self._frozen_at, len(self.held))

    def thaw_if_shrunk(self) -> None:
        if self._frozen_at and len(self.held) < self._frozen_at // 2:
            gc.unfreeze()
            self._frozen_at = 0
