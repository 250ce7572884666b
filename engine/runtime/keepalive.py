"""A periodic keep-alive with backoff: the shape of the worker's heartbeat and the triggerer's
lease renewal.

Both call one coroutine (``beat``) every ``interval_s``; after a failure they call it again
sooner, after a jittered, growing pause capped at ``max_backoff_s`` (so that a short outage
costs no missed heartbeat and a fleet that lost the database does not come back in lock
step), and an early ``poke()`` runs the next beat at once. Where the keep-alive runs is its
owner's choice: the worker runs it on its own loop, the triggerer's lease runs it on a
thread's loop of its own (engine/triggerer/lease.py); see docs/explanation/architecture.md.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from engine.runtime import metrics
from engine.runtime.retry import Backoff
from engine.runtime.wakeup import Wakeup

__all__ = ["KeepAlive"]

log = logging.getLogger(__name__)


class KeepAlive:
    """Run ``beat`` every ``interval_s`` until ``stop()``; see the module docstring.

    ``errors`` are the exceptions a beat may meet and survive (others end ``run``).
    ``on_error`` runs after each of them, before the pause (the lease drops its connection
    there). ``first_after_s`` delays the first beat (the worker's registration is its first).
    Every method is for the loop that runs ``run`` (hop with ``call_soon_threadsafe``).
    """

    def __init__(
        self,
        what: str,
        beat: Callable[[], Awaitable[None]],
        *,
        interval_s: float,
        max_backoff_s: float,
        errors: tuple[type[BaseException], ...] = (Exception,),
        on_error: Callable[[BaseException], Awaitable[None]] | None = None,
        first_after_s: float = 0.0,
    ) -> None:
        self.what = what
        self._beat = beat
        self.interval_s = interval_s
        self._backoff = Backoff(max_s=max_backoff_s)
        self._errors = errors
        self._on_error = on_error
        self.first_after_s = first_after_s
        self._wake = Wakeup()
        self._stopped = False
        #: Beats that failed in a row (0 after a success).
        self.failures = 0

    def poke(self) -> None:
        """Beat again now (or as soon as the beat in progress ends)."""
        self._wake.set()

    def stop(self) -> None:
        """End ``run`` after the beat in progress; harmless before ``run`` or twice."""
        self._stopped = True
        self._wake.set()

    async def run(self) -> None:
        if self.first_after_s > 0:
            await self._wake.wait(self.first_after_s)
        while not self._stopped:
            try:
                await self._beat()
            except self._errors as exc:
                self.failures += 1
                metrics.current().count_db_error(exc)
                if self._on_error is not None:
                    await self._on_error(exc)
                delay = self._backoff.next_delay()
                log.warning(
                    "%s failed (%s: %s); retrying in %.2fs",
                    self.what,
                    type(exc).__name__,
                    exc,
                    delay,
                )
            else:
                self.failures = 0
                self._backoff.reset()
                delay = self.interval_s
            if self._stopped:
                break
            await self._wake.wait(delay)
