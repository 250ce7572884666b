"""Per-trigger and per-try logs, kept in the database: no file per trigger, no write per line.

A triggerer binds each trigger's asyncio task to its :class:`LogSink` (``bind_trigger``), a
worker each execution of a try (``bind_task``); what a bound context logs and prints comes
here (engine/usercode/capture.py: the binding, the logging handler and the stream proxies),
and is held in the sink's buffers within the bounds of the settings ``log_*``
(engine/usercode/logbuffer.py: the lines per second, the totals, the cut of long lines, the
process's memory).

The sink writes what its buffers hold every ``flush_interval_s``, through an outbox
(engine/runtime/outbox.py, the one that writes the worker's and the triggerer's outcomes):
statements of at most ``WRITE_BATCH`` lines (and ``WRITE_BATCH_BYTES``), in the order the lines
were taken; transient errors retried; a line the database refuses for good replaced by a line
saying so, taking no other with it; after any other error the lines stay queued, first, for
the next write. Before a triggerer writes an event, and before a worker writes a try's outcome,
the lines of those triggers and tries are written first (``flush_keys``; nothing when they
logged nothing): a reader that sees a trigger gone or a try ended has every line they logged
before it.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import logging
import time
from collections.abc import Hashable, Iterable
from typing import Any

import anyio

from engine.runtime.outbox import Outbox
from engine.runtime.retry import with_db_retry
from engine.usercode import capture as logcapture
from engine.usercode.capture import (
    NOT_STORED,
    Target,
    capture_line,
    capture_record,
    tee_streams,
    unbound,
)
from engine.usercode.logbuffer import Kind, LogBuffer
from engine.usercode.loglimits import (
    DEFAULT_FLUSH_INTERVAL_S,
    DEFAULT_MAX_LINE_BYTES,
    LINE_OVERHEAD,
    LogLimits,
)

# (What callers of the sink use of capture.py and loglimits.py is importable from here too.)
__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "LINE_OVERHEAD",
    "NOT_STORED",
    "WRITE_BATCH",
    "WRITE_BATCH_BYTES",
    "LogLimits",
    "LogSink",
    "capture_line",
    "capture_record",
    "tee_streams",
    "unbound",
]

log = logging.getLogger(__name__)

#: Lines per statement at most.
WRITE_BATCH = 1000
#: Bytes of text per statement at most (a statement of WRITE_BATCH long lines would be big).
WRITE_BATCH_BYTES = 4 << 20
#: The tries waiting on a logging trigger are recorded again at most this often.
MAP_AGAIN_S = 10.0
#: How long :meth:`LogSink.close` tries to write what is left.
CLOSE_TIMEOUT_S = 3.0

#: A row taken to be written: its number (for the outbox's results), the row, and what it
#: costs in the sink's memory until written.
_Queued = tuple[int, Any, int]


class LogSink(LogBuffer):
    """The buffered lines of one triggerer's triggers (``kind="trigger"``) or one worker's
    tries (``kind="task"``), and their writer; see the module docstring."""

    def __init__(
        self,
        store: Any,
        kind: Kind,
        *,
        limits: LogLimits | None = None,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        buffer_lines: int | None = None,
    ) -> None:
        super().__init__(
            kind, limits=limits, flush_interval_s=flush_interval_s, buffer_lines=buffer_lines
        )
        self.store = store
        self._numbers = itertools.count()
        self._outbox: Outbox[_Queued, int, bool] = Outbox(
            f"write {kind} log lines",
            write=self._write,
            substitute=self._refused,
            on_written=self._written,
            on_lost=self._lost,
            describe=lambda q: f"a {kind} log line",
            max_items=WRITE_BATCH,
            size=lambda q: q[2],
            max_bytes=WRITE_BATCH_BYTES,
        )
        self._write_lock: anyio.Lock | None = None
        self._open = False
        #: Trigger id -> when the tries waiting on it were last recorded (monotonic).
        self._mapped: dict[int, float] = {}

    # -- binding ---------------------------------------------------------------------------

    def bind_trigger(self, trigger_id: int) -> contextvars.Token[Target | None]:
        """Route what the current context (a trigger's asyncio task) logs or prints here."""
        self._resume(trigger_id)
        return logcapture.bind(Target(self, trigger_id, (trigger_id,)))

    def bind_triggers(self) -> contextvars.Token[Target | None]:
        """Route what the tasks started from the current context log or print here, each by
        the trigger id bound in it (``logs.bind(trigger=...)``; without one, nowhere)."""
        return logcapture.bind(Target(self, None, ()))

    def bind_task(
        self,
        ti_id: int,
        dag_id: str,
        run_id: str,
        task_id: str,
        try_number: int,
        *,
        fresh: bool = False,
    ) -> contextvars.Token[Target | None]:
        """Route what the current context (one execution of a try) logs or prints here.
        ``fresh``: the try starts here (nothing can be stored for it yet)."""
        key = (ti_id, try_number)
        self._resume(key)
        return logcapture.bind(
            Target(self, key, (dag_id, run_id, task_id, try_number), fresh=fresh)
        )

    @staticmethod
    def unbind(token: contextvars.Token[Target | None]) -> None:
        logcapture.reset(token)

    # -- writing (the event loop) ----------------------------------------------------------

    def has_lines(self, keys: Iterable[Hashable]) -> bool:
        """Whether these triggers or tries have lines to write, or lines taken before may
        be theirs (queued, or in a write in flight)."""
        return self._outbox.pending() or super().has_lines(keys)

    async def flush(self) -> None:
        """Write everything buffered now (what fails waits for the next write: raised)."""
        await self._flush(None)

    async def flush_keys(self, keys: Iterable[Hashable]) -> None:
        """Write the lines of these triggers or tries now, if they logged any (before their
        event or outcome is written: they end), with the line saying how many went past
        their total; lines taken before theirs and not written yet go first (and a write in
        flight ends first). A failure (not a transient one: those are tried again) is logged
        and the lines wait for the next write: the event or outcome is not held up."""
        keys = list(keys)
        if not self.has_lines(keys):
            return
        try:
            await self._flush(keys, ending=True)
        except Exception as exc:
            log.warning("writing %s log lines failed (%s: %s)", self.kind, type(exc).__name__, exc)

    async def _flush(
        self, keys: list[Hashable] | None, *, ending: bool = False, tick: bool = False
    ) -> None:
        """Take the lines of ``keys`` (None: all) and write what the outbox holds."""
        if self._write_lock is None:
            self._write_lock = anyio.Lock()
        async with self._write_lock:
            unknown = self._unknown(keys)
            if unknown:
                # Before the first write for a trigger or try this process did not start:
                # what was stored for it before (another execution of the try, another
                # triggerer) counts in its total.
                idents = [found.ident for found in unknown]
                if self.kind == "trigger":
                    read = functools.partial(self.store.trigger_log_bytes, [i[0] for i in idents])
                else:
                    read = functools.partial(self.store.task_log_bytes, idents)
                self._learn(unknown, await with_db_retry(f"read {self.kind} log sizes", read))
            numbers = self._numbers
            rows = self._take(keys, ending=ending, tick=tick)
            self._outbox.put_all([(next(numbers), row, cost) for row, cost in rows])
            await self._outbox.flush()

    async def _write(self, batch: list[_Queued]) -> dict[int, bool]:
        rows = [row for _, row, _ in batch]
        if self.kind == "task":
            await self.store.insert_task_logs(rows)
        else:
            now = time.monotonic()
            ids = {r.trigger_id for r in rows}
            mapped = self._mapped
            fresh = [i for i in ids if now - mapped.get(i, -MAP_AGAIN_S) >= MAP_AGAIN_S]
            for i in fresh:
                mapped[i] = now
            if len(mapped) > 2 * len(ids) + 1000:  # forget the triggers not seen lately
                self._mapped = {i: t for i, t in mapped.items() if now - t < MAP_AGAIN_S}
            await self.store.insert_trigger_logs(rows, fresh)
        return {number: True for number, _, _ in batch}

    def _written(self, batch: list[_Queued], results: dict[int, bool]) -> None:
        self.written += len(results)
        self._release(sum(cost for _, _, cost in batch))

    def _refused(self, queued: _Queued, exc: Exception) -> _Queued:
        """A line the database refuses for good (written again it would be refused again,
        holding up every line after it): a line saying so in its place."""
        self.dropped += 1
        number, row, _cost = queued
        if self.kind == "trigger":
            ident: tuple[Any, ...] = (row.trigger_id,)
        else:
            ident = (row.dag_id, row.run_id, row.task_id, row.try_number)
        note = f"1 line dropped (the database refused it: {type(exc).__name__}: {exc})"
        return number, self._note(ident, time.time(), note), 0

    def _lost(self, _queued: _Queued, _exc: Exception) -> None:
        self.dropped += 1  # (not even the line saying so could be stored)

    # -- lifecycle -------------------------------------------------------------------------

    def open(self) -> None:
        """Start routing bound lines here (installs the process's handler and stream proxies
        while any sink is open)."""
        if self._open:
            return
        self._open = True
        logcapture.install()

    async def run(self) -> None:
        """The writer: every ``flush_interval_s``. Runs until cancelled (:meth:`close` writes
        what is left)."""
        failing = False
        while True:
            await anyio.sleep(self.flush_interval_s)
            try:
                await self._flush(None, tick=True)
            except Exception as exc:
                if not failing:
                    log.warning(
                        "writing %s log lines failed (%s: %s); kept for the next write",
                        self.kind,
                        type(exc).__name__,
                        exc,
                    )
                failing = True
            else:
                failing = False

    async def close(self, *, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is left and stop routing lines here: transient errors are tried again
        for up to ``timeout_s`` (a process stopping while the database is unreachable goes on
        with its stop after that, as it would with nowhere to write). Safe to repeat, and
        before :meth:`open`."""
        if not self._open:
            return
        self._open = False
        logcapture.uninstall()
        for key in list(self._logs):
            self.end(key)
        try:
            with anyio.fail_after(timeout_s):
                await self._flush(None, ending=True)
        except Exception as exc:
            log.warning(
                "%s log lines could not be written at stop (%s: %s)",
                self.kind,
                type(exc).__name__,
                exc,
            )
