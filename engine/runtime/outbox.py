"""One outbox: outcomes queue here and one writer writes them in batches.

The worker (task outcomes) and the triggerer (trigger events and failures) both end their
work with a write that must not be lost and must not be one statement per item: under load,
everything that queued while the previous write was in flight goes in the next statement,
so the batch grows with the load and a lone item is written at once.

An outbox may also *linger* (``linger_s``): while its writes follow each other closely (the
last one started less than ``4 * linger_s`` ago) and fewer than ``linger_items`` items are
queued, the next write waits up to ``linger_s`` for more to share it. Under a steady
stream of a few items per write this trades a few milliseconds of each item's write for
several times fewer statements (each costs the client, the server and a commit about the
same whatever it carries); an idle outbox still writes a lone item at once, and
:meth:`drain` and :meth:`flush` never wait.

What a write can meet, and what the outbox does about it, is the same for both:

* a transient error (a lost connection, a restarting server): retried with jittered backoff
  until it goes through (``with_db_retry``);
* data the database refuses for good (``REFUSED_DATA_ERRORS``: a CHECK constraint, text it
  cannot store): the batch is written again one item at a time, so one bad item takes no
  other with it, and the refused item is replaced by the substitute failure its owner builds
  (``substitute``), which says why. If even that is refused the item is given up
  (``on_lost``) and the writer carries on;
* anything else (neither transient nor about one item's data): the batch goes back to the
  head of the queue and the writer pauses (backing off) and tries it again; nothing is lost.

The results of a write are a mapping from each written item's key (a task instance and
worker, a trigger id) to what the database made of it; an item that is not in it was refused
by the fencing check (its owner no longer holds it) or lost. ``on_written`` gets every batch
with its results, on the loop, right after the write.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

import anyio

from engine.runtime.crashpoints import crash_point
from engine.runtime.retry import REFUSED_DATA_ERRORS, Backoff, with_db_retry
from engine.runtime.wakeup import Wakeup

__all__ = ["Outbox"]

log = logging.getLogger(__name__)

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Unwritten(Exception):
    """A batch written one item at a time stopped at an item that met neither a transient
    error nor refused data: the items before it are written (``results``), ``rest`` is not."""

    def __init__(self, rest: list[Any], results: dict[Any, Any], error: Exception) -> None:
        super().__init__(str(error))
        self.rest = rest
        self.results = results
        self.error = error


class Outbox(Generic[T, K, V]):
    """Queue of items of type ``T`` written by ``write`` in batches; see the module docstring.

    ``write(batch)`` is the store call (without retries: the outbox retries transient errors)
    and returns ``{key: result}`` for the items it stored. ``substitute(item, exc)`` builds the
    failure that replaces an item whose data is refused. ``size`` and ``max_bytes`` bound a
    batch by bytes as well as by ``max_items``. ``crash_before``/``crash_after`` name the
    crash points around each batch's write; ``observe(size, seconds)`` hears of each write.
    """

    def __init__(
        self,
        what: str,
        *,
        write: Callable[[list[T]], Awaitable[dict[K, V]]],
        substitute: Callable[[T, Exception], T],
        on_written: Callable[[list[T], dict[K, V]], None],
        on_lost: Callable[[T, Exception], None] | None = None,
        describe: Callable[[T], str] = repr,
        max_items: int = 1000,
        size: Callable[[T], int] | None = None,
        max_bytes: int | None = None,
        crash_before: str | None = None,
        crash_after: str | None = None,
        observe: Callable[[int, float], None] | None = None,
        linger_s: float = 0.0,
        linger_items: int = 16,
    ) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        if linger_s < 0:
            raise ValueError(f"linger_s must be >= 0, got {linger_s}")
        self.what = what
        self._write = write
        self._substitute = substitute
        self._on_written = on_written
        self._on_lost = on_lost
        self._describe = describe
        self.max_items = max_items
        self._size = size
        self.max_bytes = max_bytes
        self._crash_before = crash_before
        self._crash_after = crash_after
        #: Told each written batch's size and how long its write took (the metrics).
        self._observe = observe
        self._queue: list[T] = []
        self._wake = Wakeup()
        self._flushed = Wakeup()
        #: Items in the write in flight (0: none).
        self.in_flight = 0
        #: Held by the caller of :meth:`flush` writing (made on first use, on the loop).
        self._flushing: anyio.Lock | None = None
        #: How long a write waits for more items while writes follow closely (0: never),
        #: and the queue length from which it does not wait.
        self.linger_s = linger_s
        self.linger_items = min(max(1, linger_items), max_items)
        #: When the last write started (perf_counter; None: none yet).
        self._last_write: float | None = None
        #: Callers of :meth:`drain` waiting: the writer does not linger for them.
        self._draining = 0

    def __len__(self) -> int:
        """Items queued, not counting the write in flight."""
        return len(self._queue)

    def put(self, item: T) -> None:
        """Queue an item (on the loop); the writer picks it up at once or after its write."""
        self._queue.append(item)
        self._wake.set()

    def put_all(self, items: Iterable[T]) -> None:
        """Queue items, in order (on the loop)."""
        self._queue.extend(items)
        self._wake.set()

    def clear(self) -> None:
        """Forget everything queued (not the write in flight)."""
        self._queue.clear()

    def pending(self) -> bool:
        return bool(self._queue) or self.in_flight > 0

    async def drain(self) -> None:
        """Return once everything queued so far is written (callers bound it with a timeout)."""
        self._draining += 1
        try:
            while self.pending():
                self._wake.set()
                await self._flushed.wait(None)
        finally:
            self._draining -= 1

    async def run(self) -> None:
        """The writer: runs until cancelled."""
        backoff = Backoff()
        while True:
            await self._wake.wait(None)
            while self._queue:
                await self._linger()
                try:
                    await self._write_next()
                except Exception as exc:  # not transient, not about one item's data: the
                    await backoff.wait(self.what, exc)  # batch is queued again; pause, retry
                    continue
                backoff.reset()
            self._flushed.set()

    async def _linger(self) -> None:
        """Wait up to ``linger_s`` for more items to share the next write, while writes follow
        each other closely and the batch is small (see the module docstring)."""
        if self.linger_s <= 0 or self._last_write is None:
            return
        now = time.perf_counter()
        if now - self._last_write >= 4 * self.linger_s:
            return
        deadline = now + self.linger_s
        while len(self._queue) < self.linger_items and not self._draining:
            left = deadline - time.perf_counter()
            if left <= 0 or not await self._wake.wait(left):
                return

    async def flush(self) -> None:
        """Write everything queued, batch after batch, in the calling task: for an owner that
        decides itself when to write, instead of running the writer (:meth:`run`). Raises what
        the writer would pause on (the unwritten items stay queued, first). One caller writes
        at a time; the others wait for it, then write what is left."""
        if self._flushing is None:
            self._flushing = anyio.Lock()
        async with self._flushing:
            while self._queue:
                await self._write_next()

    async def _write_next(self) -> None:
        """Write the next batch and tell ``on_written``. Raises what is neither transient nor
        about one item's data; the items not written then (and on cancellation: all of the
        batch, whether or not its write went through) go back to the head of the queue."""
        batch = self._take()
        self.in_flight = len(batch)
        try:
            if self._crash_before is not None:
                crash_point(self._crash_before)
            started = self._last_write = time.perf_counter()
            results = await self.write_batch(batch)
            if self._observe is not None:
                self._observe(len(batch), time.perf_counter() - started)
        except _Unwritten as stuck:  # some written alone before the error
            self._queue[:0] = stuck.rest
            self.in_flight = 0
            self._on_written(batch[: len(batch) - len(stuck.rest)], stuck.results)
            raise stuck.error from None
        except BaseException:
            self._queue[:0] = batch
            raise
        finally:
            self.in_flight = 0
        if self._crash_after is not None:
            crash_point(self._crash_after)
        self._on_written(batch, results)

    def _take(self) -> list[T]:
        count, size = 0, 0
        for item in self._queue:
            if count == self.max_items:
                break
            if self._size is not None and self.max_bytes is not None:
                if count and size >= self.max_bytes:
                    break
                size += self._size(item)
            count += 1
        batch = self._queue[:count]
        del self._queue[:count]
        return batch

    async def write_batch(self, batch: list[T]) -> dict[K, V]:
        """Write one batch; a refused item is split out and replaced by its substitute. Raises
        only what is neither transient nor about one item's data (the batch is then unwritten,
        except for the items already written alone)."""
        try:
            return await with_db_retry(self.what, functools.partial(self._write, batch))
        except Exception as exc:
            if len(batch) > 1:
                log.warning(
                    "%s: writing %d items failed (%s); writing each alone",
                    self.what,
                    len(batch),
                    exc,
                )
                results: dict[K, V] = {}
                for done, item in enumerate(batch):
                    try:
                        results.update(await self.write_batch([item]))
                    except Exception as error:
                        raise _Unwritten(batch[done:], results, error) from error
                return results
            if not isinstance(exc, REFUSED_DATA_ERRORS):
                raise
            (item,) = batch
            return await self._write_substitute(item, exc)

    async def _write_substitute(self, item: T, exc: Exception) -> dict[K, V]:
        log.error(
            "%s: %s could not be stored (%s: %s); writing a failure in its place",
            self.what,
            self._describe(item),
            type(exc).__name__,
            exc,
        )
        substitute = self._substitute(item, exc)
        try:
            return await with_db_retry(
                f"{self.what} (a substitute failure)",
                functools.partial(self._write, [substitute]),
            )
        except Exception as again:
            if not isinstance(again, REFUSED_DATA_ERRORS):
                raise
            log.error(
                "%s: not even a failure could be stored for %s (%s: %s); giving it up",
                self.what,
                self._describe(item),
                type(again).__name__,
                again,
            )
            if self._on_lost is not None:
                self._on_lost(item, again)
            return {}
