"""Notice a blocked event loop and name the asyncio task (the trigger) that blocked it.

A callback on the loop stamps a monotonic clock every ``threshold/4``; a daemon thread
checks the stamp. When the loop has not run the callback for longer than the
threshold, the thread reads which asyncio task the loop is running and where that
code stands, and reports it: once when the block is seen, once when it ends, and once
more when it lasts past ``limit_s`` (the triggerer then fails the trigger that blocks).

The callbacks run on the watchdog's thread, while the loop may still be blocked: they must
not read or change what the loop owns (hop with ``call_soon_threadsafe`` for that).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["BlockReport", "LoopWatchdog"]

log = logging.getLogger(__name__)

#: How many recent ticks the loop's lag percentile is computed over (at the default threshold of
#: 0.2 s a tick comes every 50 ms: the last ~25 s).
LAG_SAMPLES = 512


class BlockReport:
    """Which task blocked the loop, where, and for how long (so far, or in all once ``ended``)."""

    __slots__ = (
        "duration_s",
        "ended",
        "location",
        "over_limit",
        "same",
        "samples",
        "since",
        "stable",
        "task_name",
    )

    def __init__(
        self, task_name: str | None, location: str | None, duration_s: float, since: float
    ) -> None:
        self.task_name = task_name
        self.location = location
        self.duration_s = duration_s
        self.since = since
        self.ended = False
        #: How many times the watchdog looked while the loop was blocked, and how many of
        #: those times it saw the first task (``task_name``) running.
        self.samples = 1
        self.same = 1
        #: The first task was running in more than half of the looks: that task blocked the
        #: loop. (Not every look: the last one can fall between the blocking callback's return
        #: and the watchdog's tick, while other callbacks run.) False means the loop was busy
        #: with many callbacks (or collecting garbage), not one culprit.
        self.stable = True
        #: The block lasted past the watchdog's ``limit_s`` (reported once).
        self.over_limit = False


class LoopWatchdog:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        threshold_s: float,
        on_block: Callable[[BlockReport], None] | None = None,
        limit_s: float | None = None,
        on_limit: Callable[[BlockReport], None] | None = None,
    ) -> None:
        self._loop = loop
        self.threshold_s = threshold_s
        self._interval = threshold_s / 4
        self._on_block = on_block
        self.limit_s = limit_s
        self._on_limit = on_limit
        self._last = time.monotonic()
        #: The longest a tick ran past its time since the watchdog last reset it.
        self._worst = 0.0
        #: How late each recent tick ran (seconds): the loop's lag, for its p99 (status page).
        self._lateness: collections.deque[float] = collections.deque(maxlen=LAG_SAMPLES)
        self._stop = threading.Event()
        self._loop_thread = threading.get_ident()
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._handle: asyncio.TimerHandle | None = None
        self._collecting: int | None = None

    def start(self) -> None:
        self._tick()
        gc.callbacks.append(self._on_gc)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._handle is not None:
            self._handle.cancel()

    def lag_s(self) -> float:
        """How long the loop has not run the watchdog's tick (any thread may ask)."""
        return time.monotonic() - self._last

    def lag_p99_s(self) -> float | None:
        """The p99 of how late the recent ticks ran (any thread may ask); None before any."""
        for _ in range(3):
            try:
                samples = sorted(self._lateness)
                break
            except RuntimeError:  # appended to while copied: look again
                continue
        else:
            return None
        if not samples:
            return None
        return samples[min(len(samples) - 1, int(len(samples) * 0.99))]

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        # A collection in progress on the loop's thread is the culprit, not the task it hit.
        if threading.get_ident() == self._loop_thread:
            self._collecting = info["generation"] if phase == "start" else None

    def _tick(self) -> None:
        now = time.monotonic()
        # How long past its time this tick ran: a block's length, measured by the loop itself.
        late = max(0.0, now - self._last - self._interval)
        self._worst = max(self._worst, late)
        self._lateness.append(late)
        self._last = now
        self._handle = self._loop.call_later(self._interval, self._tick)

    def _culprit(self) -> tuple[str | None, str | None]:
        # Read-only look at the loop's current task from this thread (a dict read under the GIL).
        current: dict[asyncio.AbstractEventLoop, asyncio.Task[object]] = getattr(
            asyncio.tasks, "_current_tasks", {}
        )
        task = current.get(self._loop)
        name = task.get_name() if task is not None else None
        collecting = self._collecting
        if collecting is not None:
            return f"garbage collection (generation {collecting})", None
        frame = sys._current_frames().get(self._loop_thread)
        location = None
        # The innermost frame outside the standard library and the engine names the code.
        while frame is not None:
            filename = frame.f_code.co_filename
            # (The qualified name, "BlockingTrigger.run", names the trigger's class too.)
            if location is None:
                location = f"{filename}:{frame.f_lineno} in {frame.f_code.co_qualname}"
            if "/asyncio/" not in filename and "/engine/" not in filename:
                location = f"{filename}:{frame.f_lineno} in {frame.f_code.co_qualname}"
                break
            frame = frame.f_back
        return name, location

    def _watch(self) -> None:
        report: BlockReport | None = None
        while not self._stop.wait(self._interval):
            lag = time.monotonic() - self._last
            if lag > self.threshold_s:
                if report is None:
                    name, location = self._culprit()
                    self._worst = 0.0  # the blocked tick has not run yet: it sets this
                    report = BlockReport(name, location, lag, since=self._last)
                    self._emit(report, self._on_block)
                else:
                    report.samples += 1
                    if self._culprit()[0] == report.task_name:
                        report.same += 1
                    report.stable = report.same * 2 > report.samples
                    if self.limit_s is not None and lag > self.limit_s and not report.over_limit:
                        report.over_limit = True
                        report.duration_s = lag
                        self._emit(report, self._on_limit)
            elif report is not None:
                # The loop ran the overdue tick as soon as it was free again.
                report.duration_s = max(self._worst, report.duration_s)
                report.ended = True
                self._emit(report, self._on_block)
                report = None

    def _emit(self, report: BlockReport, handler: Callable[[BlockReport], None] | None) -> None:
        if handler is not None:
            try:
                handler(report)
            except Exception:  # pragma: no cover - a report must never kill the watchdog
                log.exception("block report handler failed")
