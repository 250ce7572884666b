"""The triggerer's lease, kept by a thread with its own connection and event loop.

Renewing the lease on the triggerer's event loop tied it to that loop: a trigger that
blocked the loop longer than the lease lost it, and every trigger held there was adopted
and started again elsewhere. Here a daemon thread renews it on a connection of its own,
and that connection's session holds the triggerer's advisory lock (taken in the statement
that registers it): when the process dies, the session ends and the lock is free at once.
The same thread reaps, several times a second, the triggerers whose lock is free or whose
lease expired, so a dead triggerer's triggers are adopted within a fraction of a second.

Every write is still fenced: a triggerer reaped while alive (its lease connection dropped)
finds its outcomes refused, learns at its next renewal that its registration is gone, and
registers again. The loop stays the owner of the triggerer's state: the thread tells it
about a new registration with ``call_soon_threadsafe`` and reads nothing of it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from engine.runtime.crashpoints import crash_point
from engine.runtime.keepalive import KeepAlive
from engine.runtime.retry import CONNECTION_ERRORS, REFUSED_DATA_ERRORS
from engine.store.models import TriggererHealth, TriggerOutcome
from engine.store.session import TriggererSession
from operators.base import DEFAULT_QUEUE

__all__ = ["REAP_INTERVAL_S", "LeaseKeeper"]

log = logging.getLogger(__name__)

#: How often the thread looks for triggerers that are gone (a read of pg_locks).
REAP_INTERVAL_S = 0.2


class LeaseKeeper:
    """Registers a triggerer, keeps its lease and lock, reaps the gone, writes failures.

    ``on_registered(id)`` runs on the triggerer's loop after each registration (a new id after
    the first means the previous registration was lost). ``on_reaped()`` runs there when
    triggers were freed. ``loop_lag_s()`` says how long the loop has not responded: past
    ``max_unresponsive_s`` the lease is no longer renewed (nor a lost one replaced), so that a
    loop blocked for good lets its triggers go to others."""

    def __init__(
        self,
        url: str,
        *,
        hostname: str,
        pid: int,
        capacity: int,
        lease_s: float,
        loop: asyncio.AbstractEventLoop,
        on_registered: Callable[[int], None],
        on_reaped: Callable[[], None],
        loop_lag_s: Callable[[], float],
        max_unresponsive_s: float,
        reap_interval_s: float = REAP_INTERVAL_S,
        health: Callable[[], TriggererHealth] | None = None,
        queues: Sequence[str] = (DEFAULT_QUEUE,),
    ) -> None:
        self._session = TriggererSession(url, timeout_s=max(lease_s / 3, 0.5))
        self._queues = tuple(queues)
        self._hostname = hostname
        self._pid = pid
        self._capacity = capacity
        self.lease_s = lease_s
        self._loop = loop
        self._on_registered = on_registered
        self._on_reaped = on_reaped
        self._loop_lag_s = loop_lag_s
        #: The loop's health, written with each renewal (read on this thread).
        self._health = health
        self.max_unresponsive_s = max_unresponsive_s
        self.reap_interval_s = min(reap_interval_s, lease_s / 3)
        #: The registration this thread keeps (thread-owned; the loop has its own copy).
        self._id: int | None = None
        self._renew_at = 0.0
        #: When the lease was last registered or renewed (monotonic clock; read by the
        #: readiness check from the loop's thread: a float, written whole).
        self.renewed_at: float | None = None
        #: Failures to write (from the watchdog's thread); a deque is safe across threads.
        self._failures: collections.deque[TriggerOutcome] = collections.deque()
        self._stopping = threading.Event()
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self._keepalive: KeepAlive | None = None
        self._thread = threading.Thread(target=self._main, name="triggerer-lease", daemon=True)

    # -- called from other threads ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread; closing its connection frees the lock (peers reap what is left)."""
        self._stopping.set()
        self._call_on_thread("stop")
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def fail_trigger(self, trigger_id: int, fence: int, error: str) -> None:
        """Write a trigger's failure from this thread (the loop may be blocked), fenced."""
        self._failures.append(
            TriggerOutcome(trigger_id=trigger_id, fence=fence, kind="failed", error=error)
        )
        self._poke()

    def _poke(self) -> None:
        self._call_on_thread("poke")

    def _call_on_thread(self, method: str) -> None:
        loop, keepalive = self._thread_loop, self._keepalive
        if loop is not None and keepalive is not None:
            with contextlib.suppress(RuntimeError):  # the thread's loop already ended
                loop.call_soon_threadsafe(getattr(keepalive, method))

    # -- the thread ------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException:  # pragma: no cover - nothing may escape a daemon thread silently
            log.exception("the triggerer's lease thread ended")

    async def _run(self) -> None:
        keepalive = KeepAlive(
            "triggerer lease connection",
            self._tick,
            interval_s=self.reap_interval_s,
            max_backoff_s=min(1.0, self.lease_s / 3),
            on_error=self._dropped,
        )
        self._keepalive = keepalive
        self._thread_loop = asyncio.get_running_loop()
        try:
            if not self._stopping.is_set():  # (else stop() came before the loop was known)
                await keepalive.run()
        finally:
            await self._session.close()

    async def _dropped(self, exc: BaseException) -> None:
        """After an error, a jittered pause; a new connection only if this one is lost. (Closing
        a healthy connection would free the session lock: peers would reap this live
        triggerer and run all its triggers again elsewhere.)"""
        if not self._session.connected or isinstance(exc, CONNECTION_ERRORS):
            await self._session.close()

    def _publish(self, call: Callable[..., None], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the triggerer stopped
            self._loop.call_soon_threadsafe(call, *args)

    async def _tick(self) -> None:
        await self._keep()
        if self._failures and self._id is not None and self._keepalive is not None:
            self._keepalive.poke()  # queued meanwhile: write them at once, not next tick

    async def _keep(self) -> None:
        session = self._session
        if not session.connected:
            await session.connect()
            if self._id is not None and not await session.relock(self._id):
                log.error("triggerer %s: its session lock is held elsewhere", self._id)
                self._id = None
        try:
            await self._write_failures()
        except REFUSED_DATA_ERRORS as exc:
            # Refused for good: the lease must not wait on it. The loop stops the blocker once
            # it runs again; its tasks end by their deadline or with the trigger's next owner.
            log.error("could not write %d trigger failure(s): %s", len(self._failures), exc)
            self._failures.clear()
        responsive = self._loop_lag_s() < self.max_unresponsive_s
        if self._id is None:
            if not responsive:
                return  # registering for a loop that cannot claim would only churn
            self._id = await session.register(
                self._hostname, self._pid, self._capacity, self.lease_s, self._queues
            )
            self.renewed_at = time.monotonic()
            self._renew_at = self.renewed_at + self.lease_s / 3
            self._publish(self._on_registered, self._id)
        elif responsive and time.monotonic() >= self._renew_at:
            owned = await session.renew(
                self._id, self.lease_s, None if self._health is None else self._health()
            )
            if owned is None:
                log.error(
                    "triggerer %s lost its registration (its lease connection dropped or its "
                    "lease lapsed) and its triggers were freed; registering again",
                    self._id,
                )
                await session.unlock(self._id)
                self._id = None
                return
            crash_point("triggerer.lease.after_renew")
            self.renewed_at = time.monotonic()
            self._renew_at = self.renewed_at + self.lease_s / 3
        _reaped, freed = await session.reap()
        if freed:
            self._publish(self._on_reaped)

    async def _write_failures(self) -> None:
        if not self._failures or self._id is None:
            return
        batch = list(self._failures)
        accepted = await self._session.fail_triggers(self._id, batch)
        for outcome in batch:
            self._failures.popleft()
            if outcome.trigger_id in accepted:
                log.error("trigger %s failed: %s", outcome.trigger_id, outcome.error)
            else:
                log.warning(
                    "the failure of trigger %s was refused: this triggerer no longer owns it",
                    outcome.trigger_id,
                )
