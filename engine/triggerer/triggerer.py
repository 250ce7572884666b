"""``Triggerer``: wires the parts together and runs them in one task group.

The parts, one module each: the held set and its invariant (``held``), claiming (``claims``),
running one trigger (``running``), deadlines (``deadlines``), the lease as the loop sees it
(``ownership``; the lease thread is engine/triggerer/lease.py), the blocked-loop policy
(``blocking``) and the outcomes' writer (``outcomes``, on engine/runtime/outbox.py); the
loop's state they share is ``state``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import anyio
from anyio.abc import TaskStatus

from engine.runtime import metrics as _metrics
from engine.runtime.health import Check, freshness
from engine.runtime.overrides import overridden
from engine.store import CHANNEL_DEADLINES, CHANNEL_TRIGGERS, Listener, Store
from engine.triggerer.blocking import BlockPolicy
from engine.triggerer.claims import Claimer
from engine.triggerer.classes import TriggerClasses
from engine.triggerer.config import TriggererConfig
from engine.triggerer.deadlines import Deadlines
from engine.triggerer.held import Held
from engine.triggerer.lease import LeaseKeeper
from engine.triggerer.outcomes import TriggerOutbox
from engine.triggerer.ownership import Ownership, ensure_listening
from engine.triggerer.running import TriggerRunner
from engine.triggerer.state import LoopState
from engine.triggerer.watchdog import BlockReport, LoopWatchdog
from engine.triggerer.watching import WatcherOutbox, WatcherRunner
from engine.usercode import guard as usercode

__all__ = ["Triggerer"]

log = logging.getLogger("engine.triggerer")


class Triggerer:
    """Runs up to ``capacity`` trigger coroutines on one event loop; see the package docstring.

    Its config's ``dags_folder``: trigger modules in it are imported again when their file
    changes (:mod:`engine.triggerer.classes`); None watches nothing."""

    def __init__(
        self,
        store: Store,
        config: TriggererConfig | None = None,
        *,
        metrics: _metrics.Metrics | None = None,
        **overrides: Any,
    ) -> None:
        """``config``: how it runs (:class:`TriggererConfig`, its defaults when None); keyword
        arguments named like its fields override them (``Triggerer(store, capacity=10)``),
        any other name is a TypeError."""
        self.config = config = overridden(
            TriggererConfig() if config is None else config, overrides, "Triggerer"
        )
        capacity, allow, max_block_s = config.capacity, config.allow, config.max_block_s
        #: The trigger queues whose triggers this triggerer claims.
        self.queues = config.queues
        self.store = store
        self.capacity = capacity
        self.lease_s = lease_s = config.lease_s
        self.blocked_loop_s = config.blocked_loop_s
        self.cleanup_timeout_s = config.cleanup_timeout_s
        #: A trigger that blocks the loop longer than this is failed (from another thread).
        self.max_block_s = max_block_s
        self.metrics = metrics if metrics is not None else _metrics.current()
        if allow is not None:
            # A class the allow-list refuses is counted, but not as a series of its own.
            self.metrics.admit_classes(allow)
        self._state = state = LoopState(store, self.metrics, config.log_limits)
        self._outcomes = outcomes = TriggerOutbox(state)
        self.metrics.watch_triggerer(lambda: len(state.held), capacity)
        self._lease: LeaseKeeper | None = None
        self._runner = TriggerRunner(state, outcomes, cleanup_timeout_s=config.cleanup_timeout_s)
        self._watcher_writes = WatcherOutbox(state)
        self._watchers = watchers = WatcherRunner(
            state, self._watcher_writes, cleanup_timeout_s=config.cleanup_timeout_s
        )
        self._deadlines = Deadlines(state)
        self._claimer = Claimer(
            state,
            outcomes,
            self._runner,
            self._deadlines,
            capacity=capacity,
            claim_batch=config.claim_batch,
            poll_interval_s=config.poll_interval_s,
            allow=allow,
            classes=TriggerClasses(config.dags_folder),
            watchers=watchers,
        )
        self._ownership = Ownership(
            state,
            outcomes,
            capacity=capacity,
            lease_s=lease_s,
            max_block_s=max_block_s,
            claiming=lambda: self._claimer.claiming,
            queues=self.queues,
        )
        self._blocking = BlockPolicy(
            state,
            outcomes,
            cancel_blocking_after=config.cancel_blocking_after,
            max_block_s=max_block_s,
        )

    # -- what tests, benchmarks and the CLI read ---------------------------------------------

    @property
    def id(self) -> int | None:
        return self._state.id

    @property
    def held(self) -> dict[int, Held]:
        return self._state.held.triggers

    @property
    def peak_held(self) -> int:
        return self._state.held.peak

    @property
    def fired(self) -> int:
        return self._outcomes.fired

    @property
    def recorded(self) -> int:
        """Asset events its watchers recorded so far."""
        return self._watcher_writes.recorded

    @property
    def blocks(self) -> list[BlockReport]:
        return self._blocking.blocks

    @property
    def unwritten_events(self) -> int:
        """Outcomes produced but not written yet (queued, or in the write in flight)."""
        watchers = self._watcher_writes
        return len(self._outcomes) + self._outcomes.in_flight + len(watchers) + watchers.in_flight

    def stats(self) -> dict[str, float]:
        return {
            "held": len(self.held),
            "peak_held": self.peak_held,
            "fired": self.fired,
            "outbox": len(self._outcomes),
            "time": time.time(),
        }

    def health_checks(self) -> dict[str, Check]:
        """Readiness: the lease was renewed within ``lease_s`` (engine/runtime/health.py)."""

        def renewed_at() -> float | None:
            return self._lease.renewed_at if self._lease is not None else None

        return {"lease": freshness("lease renewal", renewed_at, self.lease_s)}

    # -- lifecycle -----------------------------------------------------------------------------

    def stop(self) -> None:
        """Graceful stop: write pending events, cancel the triggers, release them to others.
        Safe before ``run`` (``run`` then returns at once) and more than once."""
        self._state.stopping = True
        self._state.claim_wake.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        state = self._state
        if state.stopping:
            log.info("triggerer stopped before it started")
            task_status.started()
            return
        state.loop = asyncio.get_running_loop()
        usercode.install(state.loop)
        state.logs.open()
        # Every trigger task (started from this task's claimer) stores its lines there.
        state.logs.bind_triggers()
        watchdog = LoopWatchdog(
            state.loop,
            threshold_s=self.blocked_loop_s,
            on_block=self._blocking.on_block,
            limit_s=self.max_block_s,
            on_limit=self._blocking.on_limit,
        )
        lease = self._lease = self._ownership.keeper(
            watchdog.lag_s, lambda: self._blocking.health(watchdog.lag_p99_s())
        )
        self._blocking.attach(state.loop, lease)
        listener = self.store.listener(CHANNEL_TRIGGERS, CHANNEL_DEADLINES)
        listener.on_notify(self._on_notify)
        watchdog.start()
        lease.start()
        try:
            await ensure_listening(listener)
            while state.id is None and not state.stopping:
                await state.claim_wake.wait(None)  # set by the registration (and stop)
            if state.id is None:
                task_status.started()
                return
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._outcomes.run, name="triggerer-writer")
                tg.start_soon(self._watcher_writes.run, name="triggerer-watcher-writer")
                tg.start_soon(state.logs.run, name="triggerer-logs")
                tg.start_soon(self._deadlines.run, name="triggerer-deadlines")
                tg.start_soon(self._ownership.run, listener, name="triggerer-ownership")
                task_status.started()
                await self._claimer.run()
                with anyio.move_on_after(max(self.lease_s, 5.0)):
                    await self._outcomes.drain()  # events already produced, before letting go
                    self._watchers.stop_all()  # (the watchers' events so far, with cursors)
                    await self._watcher_writes.drain()
                tg.cancel_scope.cancel()
        finally:
            watchdog.stop()
            with anyio.move_on_after(self.cleanup_timeout_s + 5, shield=True):
                await self._shutdown(listener, lease)
            log.info("triggerer %s stopped", state.id)

    async def _shutdown(self, listener: Listener, lease: LeaseKeeper) -> None:
        tasks = self._state.held.drop_all()
        if tasks:
            await asyncio.wait(tasks, timeout=self.cleanup_timeout_s + 1)
        await listener.close()
        await self._state.logs.close()  # what the triggers logged until now
        # The lease thread first: renewing a registration while it is released would find it
        # gone and register again. (Its connection closing frees the session lock, so peers
        # may reap what is left at the same time as the release below: both only free.)
        await anyio.to_thread.run_sync(lease.stop)
        triggerer_id = self._state.id
        if triggerer_id is not None:
            try:
                released = await self.store.release_triggerer(triggerer_id)
                log.info("triggerer %s released %d trigger(s)", triggerer_id, released)
            except Exception as exc:
                log.warning(
                    "could not release triggers (%s); peers adopt them, its session lock "
                    "being free",
                    exc,
                )

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel == CHANNEL_DEADLINES:
            self._deadlines.notified(payload)
        else:
            self._state.claim_wake.set()

    def _drop(self, trigger_id: int) -> None:
        """Stop running a trigger without writing anything (tests lose one in memory so)."""
        self._state.held.drop(trigger_id)
