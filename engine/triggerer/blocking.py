"""The blocked-loop policy: what the triggerer does when a trigger blocks its event loop.

The watchdog (engine/triggerer/watchdog.py) calls ``on_block`` and ``on_limit`` on its own thread,
while the loop may still be blocked. Those two read nothing the loop owns: the asyncio task's
name says which trigger (and fence) blocks, the settings are fixed, and the lease keeper is
set before the watchdog starts. Everything that reads or changes the held set hops to the
loop first with ``call_soon_threadsafe`` (``_block_seen``, ``_blocker_failed``).

* A block is logged when seen and when it ends; an ended block seen at least twice in the
  same trigger counts against that trigger, which is cancelled (its tasks failed) the
  ``cancel_blocking_after``-th time (0: never).
* A block past ``max_block_s`` fails the blocker from the lease thread at once (the loop
  cannot write), fenced, so that no triggerer starts it again; the loop stops it once it runs.
"""

from __future__ import annotations

import asyncio
import copy
import logging

from engine.store import TriggerOutcome
from engine.store.models import TriggererHealth
from engine.triggerer.held import Held
from engine.triggerer.lease import LeaseKeeper
from engine.triggerer.outcomes import TriggerOutbox
from engine.triggerer.running import trigger_of
from engine.triggerer.state import LoopState
from engine.triggerer.watchdog import BlockReport

__all__ = ["BlockPolicy"]

log = logging.getLogger("engine.triggerer")


def _culprit(task_name: str | None) -> str:
    of = trigger_of(task_name)
    if of is not None:
        return f"trigger {of[0]}"
    return task_name or "(no task: a callback)"


class BlockPolicy:
    def __init__(
        self,
        state: LoopState,
        outcomes: TriggerOutbox,
        *,
        cancel_blocking_after: int,
        max_block_s: float,
    ) -> None:
        self._state = state
        self._outcomes = outcomes
        self.cancel_blocking_after = cancel_blocking_after
        self.max_block_s = max_block_s
        #: Set by ``attach`` before the watchdog starts, never changed while it runs: safe to
        #: read from its thread.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lease: LeaseKeeper | None = None
        self.blocks: list[BlockReport] = []
        self._counts: dict[int, int] = {}
        #: For the status page (read by the lease thread; each a single attribute write here):
        #: the blocks that ended, and the longest one's trigger class and length.
        self.blocked_loops = 0
        self.worst_block: tuple[str, float] | None = None

    def attach(self, loop: asyncio.AbstractEventLoop, lease: LeaseKeeper) -> None:
        """Before the watchdog starts: the loop to hop to, the lease thread that writes."""
        self._loop, self._lease = loop, lease

    # -- on the watchdog's thread ------------------------------------------------------------

    def on_block(self, report: BlockReport) -> None:
        """Watchdog thread: log, then hop to the loop."""
        loop = self._loop
        assert loop is not None
        if not report.ended:
            log.warning(
                "event loop blocked for over %.3fs by %s at %s; trigger code must not block "
                "(use await, or run blocking calls in a thread)",
                report.duration_s,
                _culprit(report.task_name),
                report.location,
            )
        # A copy: the watchdog's thread goes on updating the report it holds.
        loop.call_soon_threadsafe(self._block_seen, copy.copy(report))

    def on_limit(self, report: BlockReport) -> None:
        """Watchdog thread, while the loop is still blocked past ``max_block_s``: the
        blocker's failure is written from the lease thread, fenced; the loop, once it runs,
        stops the trigger."""
        loop = self._loop
        assert loop is not None
        of = trigger_of(report.task_name) if report.stable else None
        if of is None:
            log.error(
                "event loop blocked for over %.1fs (triggerer_max_block_s) by %s at %s, not by "
                "one trigger: nothing to fail",
                self.max_block_s,
                _culprit(report.task_name),
                report.location,
            )
            return
        trigger_id, fence = of
        reason = (
            f"trigger {trigger_id} was failed: it blocked the triggerer's event loop for over "
            f"{self.max_block_s:g}s, the limit (setting triggerer_max_block_s), at "
            f"{report.location}; trigger code must not block (use await, or run blocking "
            "calls in a thread)"
        )
        if self._lease is not None:
            self._lease.fail_trigger(trigger_id, fence, reason)
        loop.call_soon_threadsafe(self._blocker_failed, trigger_id, fence)

    # -- on the loop ---------------------------------------------------------------------------

    def _blocker_failed(self, trigger_id: int, fence: int) -> None:
        """Stop the trigger whose failure was written (if still the same run)."""
        held = self._state.held.get(trigger_id)
        if held is not None and held.fence == fence:
            log.error(
                "stopped trigger %s (%s): it blocked the event loop past the limit of %gs",
                trigger_id,
                held.classpath,
                self.max_block_s,
            )
            self._state.held.drop(trigger_id)
            metrics = self._state.metrics
            metrics.inc_by_class(metrics.trigger_failures, held.classpath)

    def _block_seen(self, report: BlockReport) -> None:
        """Record a block, and count an ended one against its trigger."""
        if not report.ended:
            self.blocks.append(report)
            return
        of = trigger_of(report.task_name)
        held = self._state.held.get(of[0]) if of is not None else None
        if of is None or held is None or held.fence != of[1]:
            held = None
        culprit = (
            f"trigger {of[0]} ({held.classpath})"
            if of is not None and held is not None
            else _culprit(report.task_name)
        )
        self._count_block(
            report, held.classpath if held is not None else _culprit(report.task_name)
        )
        metrics = self._state.metrics
        metrics.inc_by_class(
            metrics.loop_blocked,
            held.classpath if held is not None and report.stable else "unknown",
            report.duration_s,
        )
        if not report.stable:
            # Different tasks were running when the watchdog looked: the loop was busy
            # (many callbacks at once, a garbage collection), not blocked by one trigger.
            log.warning(
                "event loop was busy for %.3fs with many callbacks (first seen: %s)",
                report.duration_s,
                culprit,
            )
            return
        log.warning(
            "event loop was blocked for %.3fs by %s at %s",
            report.duration_s,
            culprit,
            report.location,
        )
        if of is None or held is None or self.cancel_blocking_after <= 0:
            return
        # Only a block seen at least twice, in the same trigger most times, counts against it.
        if report.samples < 2:
            return
        trigger_id = of[0]
        count = self._counts.get(trigger_id, 0) + 1
        self._counts[trigger_id] = count
        if count >= self.cancel_blocking_after:
            reason = (
                f"trigger {held.classpath} was cancelled: it blocked the triggerer's event loop "
                f"{count} time(s) (last for {report.duration_s:.3f}s at {report.location})"
            )
            self._cancel_blocker(trigger_id, held, reason)

    def _count_block(self, report: BlockReport, culprit: str) -> None:
        self.blocked_loops += 1
        worst = self.worst_block
        if worst is None or report.duration_s > worst[1]:
            self.worst_block = (culprit if report.stable else "(many callbacks)", report.duration_s)

    def health(self, lag_p99_s: float | None) -> TriggererHealth:
        """What the lease renewal records for the status page (called on the lease thread)."""
        worst = self.worst_block
        return TriggererHealth(
            loop_lag_p99_ms=None if lag_p99_s is None else lag_p99_s * 1000,
            blocked_loops=self.blocked_loops,
            worst_blocker=None if worst is None else worst[0],
            worst_block_ms=None if worst is None else worst[1] * 1000,
        )

    def _cancel_blocker(self, trigger_id: int, held: Held, reason: str) -> None:
        """End a repeat offender; its tasks fail with the reason."""
        if self._state.held.get(trigger_id) is not held or held.task is None or held.task.done():
            return
        log.error("%s", reason)
        self._counts.pop(trigger_id, None)
        self._outcomes.emit(
            TriggerOutcome(trigger_id=trigger_id, fence=held.fence, kind="failed", error=reason)
        )
        held.task.cancel()
