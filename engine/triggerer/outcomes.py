"""The triggerer's outcomes (events and failures) and their writer.

Every outcome of the loop (a trigger's first event, its failure, a build's or a cancel's) is
queued here (:meth:`TriggerOutbox.emit`) and written by one writer, the outbox of
engine/runtime/outbox.py: a batch is one ``fire_triggers`` transaction in which every waiting
task instance moves by a conditional update, only while this triggerer still owns the trigger
with the fence it claimed. The lines the triggers logged are written first; once written,
each outcome settles its trigger in the held set (same fence only).
"""

from __future__ import annotations

import logging

from engine.runtime.outbox import Outbox
from engine.store import TriggerOutcome
from engine.store.downstream import settle
from engine.triggerer.state import LoopState

__all__ = ["WRITE_BATCH", "TriggerOutbox"]

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


class TriggerOutbox(Outbox[TriggerOutcome, int, bool]):
    """The outbox of one triggerer's outcomes (its writer: :meth:`run`, on the loop)."""

    def __init__(self, state: LoopState) -> None:
        super().__init__(
            "write trigger events",
            write=self._fire,
            substitute=_substitute,
            on_written=self._settle,
            describe=lambda o: f"the outcome of trigger {o.trigger_id}",
            max_items=WRITE_BATCH,
            crash_before="triggerer.fire.before_write",
            crash_after="triggerer.fire.after_write",
            observe=self._observe_write,
        )
        self._state = state
        #: Outcomes the database accepted so far.
        self.fired = 0
        # (The labelled series each write is observed in, looked up once.)
        metrics = state.metrics
        self._batch_sizes = metrics.write_batch.labels("trigger_events")
        self._write_seconds = metrics.write_duration.labels("trigger_events")

    def emit(self, outcome: TriggerOutcome) -> None:
        """Queue a trigger's outcome for the writer, counted as an event or a failure of its
        class (every outcome of the loop comes here: the run's, a build's, a cancel's)."""
        self.put(outcome)
        held = self._state.held.get(outcome.trigger_id)
        metrics = self._state.metrics
        counter = metrics.trigger_failures if outcome.kind == "failed" else metrics.trigger_events
        metrics.inc_by_class(counter, held.classpath if held is not None else "unknown")

    def _observe_write(self, size: int, duration_s: float) -> None:
        self._batch_sizes.observe(size)
        self._write_seconds.observe(duration_s)

    async def _fire(self, batch: list[TriggerOutcome]) -> dict[int, bool]:
        state = self._state
        triggerer_id = state.id
        assert triggerer_id is not None
        # The lines these triggers logged go first (nothing when they logged none): a reader
        # that sees a trigger gone has every line it logged before its event.
        await state.logs.flush_keys([o.trigger_id for o in batch])
        fired = await state.store.fire_triggers(triggerer_id, batch)
        await settle(state.store, fired.moved, woke=fired.woke)
        return dict.fromkeys(fired.accepted, True)

    def _settle(self, batch: list[TriggerOutcome], accepted: dict[int, bool]) -> None:
        held = self._state.held
        for outcome in batch:
            held.settle(outcome.trigger_id, outcome.fence)
            if outcome.trigger_id not in accepted:
                log.warning(
                    "outcome of trigger %s refused: this triggerer no longer owns it "
                    "(its lease lapsed and another triggerer adopted it)",
                    outcome.trigger_id,
                )
        self.fired += len(accepted)
        self._state.thaw_if_shrunk()
        log.debug("wrote %d outcome(s)", len(batch))
