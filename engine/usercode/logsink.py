"""Per-trigger and per-try logs, kept in the database: no file per trigger, no write per line.

A triggerer binds each trigger's asyncio task to its :class:`LogSink` (``bind_trigger``), a
worker each execution of a try (``bind_task``); what a bound context logs and prints comes
here (engine/usercode/capture.py: the binding, the logging handler and the stream proxies).

Bounds (:class:`LogLimits`, the settings ``log_*``), so that whatever a task or a trigger
prints, its process's memory and the database stay bounded:

* every line's text goes through :func:`engine.usercode.loglines.stored_text` (cut to
  ``max_line_bytes``, saying how much was cut) before it is buffered;
* a trigger or a try keeps at most ``lines_per_write`` lines between two writes of the sink
  (``max_lines_per_s`` a second): past it the oldest are dropped, and a line ``N lines
  dropped`` is stored in their place;
* a trigger or a try stores at most ``max_trigger_bytes`` / ``max_try_bytes`` of text in all
  (counting what other processes stored for it before, read from the database when this
  process first writes for it): later lines are dropped, and one line ``N lines dropped``
  says so when it ends (:meth:`LogSink.flush_keys` before its event or outcome, or
  :meth:`LogSink.end`);
* all the lines a sink holds (buffered, being written, or kept after a failed write) take at
  most ``buffer_bytes`` (text plus ``LINE_OVERHEAD`` a line): past it the oldest lines of the
  same trigger or try make room, or the new line is dropped (and counted as above).

One background task writes everything buffered every ``flush_interval_s``, in statements of
at most ``WRITE_BATCH`` lines (and ``WRITE_BATCH_BYTES``). Before a triggerer writes an event,
and before a worker writes a try's outcome, the lines of those triggers and tries are written
first (``flush_keys``; nothing when they logged nothing): a reader that sees a trigger gone or
a try ended has every line they logged before it.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Hashable, Iterable
from typing import Any, Literal

import anyio
import msgspec

from engine.runtime.retry import REFUSED_DATA_ERRORS
from engine.store.models import TaskLogRow, TriggerLogRow
from engine.usercode import capture as logcapture
from engine.usercode.capture import (
    NOT_STORED,
    Target,
    capture_line,
    capture_record,
    tee_streams,
    unbound,
)
from engine.usercode.loglines import stored_text, utf8_len

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_FLUSH_INTERVAL_S",
    "DEFAULT_MAX_LINES_PER_S",
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_MAX_TOTAL_BYTES",
    "LINE_OVERHEAD",
    "NOT_STORED",
    "WRITE_BATCH",
    "LogLimits",
    "LogSink",
    "capture_line",
    "capture_record",
    "tee_streams",
    "unbound",
]

log = logging.getLogger(__name__)

#: Lines a trigger or a try may log a second (between two writes); older ones are dropped.
DEFAULT_MAX_LINES_PER_S = 1000
#: Bytes of text one trigger, or one try, stores in all.
DEFAULT_MAX_TOTAL_BYTES = 10 << 20
#: A longer line is cut here (with a note of how much was cut).
DEFAULT_MAX_LINE_BYTES = 64 << 10
#: Memory for the lines one process holds, all triggers or tries together.
DEFAULT_BUFFER_BYTES = 32 << 20
#: How often buffered lines are written.
DEFAULT_FLUSH_INTERVAL_S = 1.0
#: Lines per statement at most.
WRITE_BATCH = 1000
#: Bytes of text per statement at most (a statement of WRITE_BATCH long lines would be big).
WRITE_BATCH_BYTES = 4 << 20
#: What a buffered line costs besides its text: its tuple, time, strings' headers, list slot.
LINE_OVERHEAD = 200
#: A trigger or try that logged nothing for this many writes is forgotten (what it stored is
#: read again from the database if it logs again).
FORGET_AFTER_WRITES = 60
#: The tries waiting on a logging trigger are recorded again at most this often.
MAP_AGAIN_S = 10.0

Kind = Literal["trigger", "task"]
#: A buffered line: time, level, logger, message, stream, size of the message in bytes.
_Line = tuple[float, str, str, str, str, int]


class LogLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The bounds of the stored logs of one process (settings ``log_max_lines_per_s``,
    ``log_max_try_bytes``, ``log_max_trigger_bytes``, ``log_max_line_bytes``,
    ``log_buffer_bytes``; see the module docstring)."""

    max_lines_per_s: int = DEFAULT_MAX_LINES_PER_S
    max_try_bytes: int = DEFAULT_MAX_TOTAL_BYTES
    max_trigger_bytes: int = DEFAULT_MAX_TOTAL_BYTES
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    buffer_bytes: int = DEFAULT_BUFFER_BYTES

    def __post_init__(self) -> None:
        for name in ("max_lines_per_s", "max_try_bytes", "max_trigger_bytes", "max_line_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        least = self.max_line_bytes + 1024
        if self.buffer_bytes < least:
            raise ValueError(
                f"buffer_bytes must be at least max_line_bytes + 1024 ({least}), "
                f"got {self.buffer_bytes}"
            )


class _Log:
    """What one sink knows of one trigger's or try's log: its lines since the last write and
    its counts. (A list, not a deque: a triggerer may hold one for each of 100,000 triggers
    that logged a line, and an empty deque alone is some 600 bytes.)"""

    __slots__ = (
        "buffered",
        "dirty",
        "dropped",
        "ended",
        "ident",
        "known",
        "lines",
        "noted",
        "over",
        "partial",
        "seen",
        "squeezed",
        "stored",
    )

    def __init__(self, ident: tuple[Any, ...], known: bool, seen: int) -> None:
        self.ident = ident
        self.lines: list[_Line] = []
        #: Bytes of the buffered lines' text.
        self.buffered = 0
        #: Bytes of text written (or being written) for it; once ``known``, with what was
        #: stored before this process saw it.
        self.stored = 0
        self.known = known
        #: Lines dropped since the last write: more than the lines per write / no room left in
        #: the sink's memory. Said by a line in their place at the next write.
        self.dropped = 0
        self.squeezed = 0
        #: Lines dropped past the total (once one is, every later one is), and how many of
        #: them a line already said.
        self.over = 0
        self.noted = 0
        #: A printed line not ended yet, by stream: its text so far and the bytes cut of it.
        self.partial: dict[str, tuple[str, int]] | None = None
        #: It has something to write (it is in the sink's ``_dirty``).
        self.dirty = False
        #: Its execution or run ended here (forgotten once its lines are written).
        self.ended = False
        #: The sink's write count when it last logged.
        self.seen = seen


class LogSink:
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
        limits = limits if limits is not None else LogLimits()
        if buffer_lines is not None and buffer_lines < 1:
            raise ValueError(f"buffer_lines must be >= 1, got {buffer_lines}")
        self.store = store
        self.kind = kind
        self.limits = limits
        self.flush_interval_s = flush_interval_s
        #: Lines a trigger or try keeps between two writes.
        self.buffer_lines = (
            buffer_lines
            if buffer_lines is not None
            else max(1, round(limits.max_lines_per_s * flush_interval_s))
        )
        #: Bytes of text a trigger or try stores in all.
        self.max_total_bytes = (
            limits.max_trigger_bytes if kind == "trigger" else limits.max_try_bytes
        )
        self.max_line_bytes = limits.max_line_bytes
        self.buffer_bytes = limits.buffer_bytes
        self._lock = threading.Lock()
        self._logs: dict[Hashable, _Log] = {}
        #: The logs with something to write.
        self._dirty: dict[Hashable, _Log] = {}
        #: Memory the lines held take (buffered, being written, unwritten), LINE_OVERHEAD each.
        self._pending = 0
        #: Rows a write failed to store, with what each costs: written first next time.
        self._unwritten: list[tuple[Any, int]] = []
        self._write_lock: anyio.Lock | None = None
        #: Writes so far (the periodic ones): the clock of the lines per write.
        self._writes = 0
        self._open = False
        #: Trigger id -> when the tries waiting on it were last recorded (monotonic).
        self._mapped: dict[int, float] = {}
        #: Lines stored so far, and dropped (over a bound, or refused); for tests and stats.
        self.written = 0
        self.dropped = 0

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

    def _resume(self, key: Hashable) -> None:
        """A trigger or try bound again before its last lines were written: not forgotten."""
        with self._lock:
            found = self._logs.get(key)
            if found is not None:
                found.ended = False

    @staticmethod
    def unbind(token: contextvars.Token[Target | None]) -> None:
        logcapture.reset(token)

    # -- buffering (any thread) ------------------------------------------------------------

    def _log(self, target: Target) -> _Log:
        """(Under the lock.)"""
        found = self._logs.get(target.key)
        if found is None:
            found = self._logs[target.key] = _Log(target.ident, target.fresh, self._writes)
        return found

    def _mark(self, key: Hashable, found: _Log) -> None:
        """(Under the lock.)"""
        if not found.dirty:
            found.dirty = True
            self._dirty[key] = found

    def append(
        self,
        target: Target,
        at: float,
        level: str,
        logger: str,
        message: str,
        stream: str,
        *,
        cut: int = 0,
        always: bool = False,
    ) -> None:
        """Buffer one line (``cut``: bytes of it cut already). ``always``: past the lines per
        write and the total (the engine's own line about the try; still cut, and within the
        sink's memory)."""
        message, size = stored_text(message, max_bytes=self.max_line_bytes, cut=cut)
        cost = size + LINE_OVERHEAD
        with self._lock:
            found = self._log(target)
            found.seen = self._writes
            lines = found.lines
            full = len(lines) >= self.buffer_lines and not always
            if not always:
                room = self.max_total_bytes - found.stored - found.buffered
                if full:
                    room += lines[0][5]  # (the oldest line would make room)
                if found.over or size > room:
                    found.over += 1  # the total is reached: this and every later line go
                    self._mark(target.key, found)
                    return
            if full:
                self._evict(found)
                found.dropped += 1
            while self._pending + cost > self.buffer_bytes:
                if not found.lines:
                    found.squeezed += 1  # no room left: this line goes
                    self._mark(target.key, found)
                    return
                self._evict(found)
                found.squeezed += 1
            found.lines.append((at, level, logger, message, stream, size))
            found.buffered += size
            self._pending += cost
            self._mark(target.key, found)

    def _evict(self, found: _Log) -> None:
        """The oldest buffered line of ``found`` goes. (Under the lock.)"""
        old = found.lines.pop(0)
        found.buffered -= old[5]
        self._pending -= old[5] + LINE_OVERHEAD

    def write_text(self, target: Target, stream: str, text: str) -> None:
        """What the bound context printed: whole lines are buffered, the rest waits for its
        end (or for :meth:`end`). Of a line, only as much as can be stored is kept (the rest
        is counted), however long it is and however many prints it takes."""
        limit = self.max_line_bytes
        whole: list[tuple[str, int]] = []
        with self._lock:
            found = self._log(target)
            head, cut = found.partial.pop(stream, _NOTHING) if found.partial else _NOTHING
            start = 0
            while (end := text.find("\n", start)) >= 0:
                whole.append(_extend(head, cut, text, start, end, limit))
                head, cut = _NOTHING
                start = end + 1
            if start < len(text):
                head, cut = _extend(head, cut, text, start, len(text), limit)
            if head or cut:
                if found.partial is None:
                    found.partial = {}
                found.partial[stream] = (head, cut)
        if not whole:
            return
        now = time.time()
        for line, line_cut in whole:
            self.append(target, now, "INFO", f"<{stream}>", line.rstrip("\r"), stream, cut=line_cut)

    def end(self, key: Hashable) -> None:
        """A trigger or an execution of a try ended: what it printed without a final newline
        is a line of its own, a line says how many lines went past its total, and it is
        forgotten once that is written."""
        with self._lock:
            found = self._logs.get(key)
            if found is None:
                return
            partial, found.partial = found.partial, None
            found.ended = True
            self._mark(key, found)
        if partial:
            target = Target(self, key, found.ident)
            for stream, (text, cut) in partial.items():
                self.append(target, time.time(), "INFO", f"<{stream}>", text, stream, cut=cut)

    def _take(self, keys: list[Hashable] | None, *, ending: bool) -> list[tuple[Any, int]]:
        """The rows to write, with what each costs: the unwritten ones first, then the lines
        of ``keys`` (None: of all; ``ending``: they end now), in order. Lines dropped since
        the last write are said by a line before the lines kept; lines dropped past the total
        by one line when the trigger or try ends (or is forgotten). (Under the lock.)"""
        rows, self._unwritten = self._unwritten, []
        dirty = self._dirty
        if keys is None:
            taken = list(dirty.items())
            dirty.clear()
        else:
            taken = [(k, f) for k in keys if (f := dirty.pop(k, None)) is not None]
        for key, found in taken:
            found.dirty = False
            if found.dropped or found.squeezed:
                first_at = found.lines[0][0] if found.lines else time.time()
                rows.append((self._note(found.ident, first_at, self._dropped_note(found)), 0))
                self.dropped += found.dropped + found.squeezed
                found.dropped = found.squeezed = 0
            room = self.max_total_bytes - found.stored
            past = False
            for line in found.lines:
                if past or line[5] > room:
                    # (What was stored before this process saw it, learnt since the line was
                    # buffered, leaves no room: this line and the later ones go.)
                    past = True
                    found.over += 1
                    self._pending -= line[5] + LINE_OVERHEAD
                    continue
                room -= line[5]
                found.stored += line[5]
                rows.append((self._row(found.ident, line), line[5] + LINE_OVERHEAD))
            found.lines = []
            found.buffered = 0
            closing = ending or (found.ended and not found.partial)
            if closing and found.over > found.noted:
                rows.append((self._note(found.ident, time.time(), self._total_note(found)), 0))
                self.dropped += found.over - found.noted
                found.noted = found.over
            if found.ended and not found.partial:
                self._logs.pop(key, None)
            elif found.over > found.noted:
                self._mark(key, found)  # its note waits for its end
        return rows

    def _forget_idle(self) -> list[tuple[Any, int]]:
        """Forget the triggers and tries that logged nothing for FORGET_AFTER_WRITES writes
        (with the line saying how many went past the total, if not said yet). (Under the
        lock.)"""
        rows: list[tuple[Any, int]] = []
        since = self._writes - FORGET_AFTER_WRITES
        for key, found in list(self._logs.items()):
            if found.seen > since or found.lines or found.partial:
                continue
            if found.over > found.noted:
                rows.append((self._note(found.ident, time.time(), self._total_note(found)), 0))
                self.dropped += found.over - found.noted
            self._dirty.pop(key, None)
            del self._logs[key]
        return rows

    def _dropped_note(self, found: _Log) -> str:
        n = found.dropped + found.squeezed
        why = []
        if found.dropped:
            why.append(
                f"more than {self.buffer_lines} lines in a second: setting log_max_lines_per_s"
            )
        if found.squeezed:
            why.append("this process's log buffer was full: setting log_buffer_bytes")
        return f"{n} lines dropped ({'; '.join(why)})"

    def _total_note(self, found: _Log) -> str:
        what = "trigger" if self.kind == "trigger" else "try"
        return (
            f"{found.over - found.noted} lines dropped (this {what}'s log reached its limit of "
            f"{_size(self.max_total_bytes)}: setting log_max_{what}_bytes)"
        )

    def _note(self, ident: tuple[Any, ...], at: float, note: str) -> Any:
        return self._row(ident, (at, "WARNING", "deferral", note, "log", len(note)))

    def _row(self, ident: tuple[Any, ...], line: _Line) -> Any:
        at, level, logger, message, stream, _size = line
        if self.kind == "trigger":
            return TriggerLogRow(ident[0], at, level, logger, message)
        dag_id, run_id, task_id, try_number = ident
        return TaskLogRow(dag_id, run_id, task_id, try_number, at, level, stream, logger, message)

    def has_lines(self, keys: Iterable[Hashable]) -> bool:
        if self._unwritten:
            return True
        dirty = self._dirty
        return bool(dirty) and any(k in dirty for k in keys)

    # -- writing (the event loop) ----------------------------------------------------------

    async def flush(self) -> None:
        """Write everything buffered now (retrying nothing: what fails waits for the next)."""
        await self._flush(None)

    async def flush_keys(self, keys: Iterable[Hashable]) -> None:
        """Write the lines of these triggers or tries now, if they logged any (before their
        event or outcome is written: they end), with the line saying how many went past
        their total. A failure is logged and the lines wait for the next write: the event or
        outcome is not held up."""
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
        if self._write_lock is None:
            self._write_lock = anyio.Lock()
        async with self._write_lock:
            await self._learn_stored(keys)
            with self._lock:
                rows = self._take(keys, ending=ending)
                if tick:
                    self._writes += 1
                    if self._writes % FORGET_AFTER_WRITES == 0:
                        rows.extend(self._forget_idle())
            done = 0
            try:
                while done < len(rows):
                    batch = _batch(rows, done)
                    try:
                        await self._write([row for row, _ in batch])
                    except REFUSED_DATA_ERRORS as exc:
                        # Refused for good (not a lost connection): written again it would
                        # be refused again, holding up every line after it.
                        log.warning(
                            "%d %s log lines dropped: the database refused them (%s: %s)",
                            len(batch),
                            self.kind,
                            type(exc).__name__,
                            exc,
                        )
                        self.dropped += len(batch)
                    else:
                        self.written += len(batch)
                    with self._lock:
                        self._pending -= sum(cost for _, cost in batch)
                    done += len(batch)
            except BaseException:
                with self._lock:  # (still counted in _pending: new lines make room for them)
                    self._unwritten[:0] = rows[done:]
                raise

    async def _learn_stored(self, keys: list[Hashable] | None) -> None:
        """Before the first write for a trigger or try this process did not start: what was
        stored for it before (another execution of the try, another triggerer), counted in
        its total."""
        with self._lock:
            dirty = self._dirty
            chosen = dirty.items() if keys is None else ((k, dirty.get(k)) for k in keys)
            unknown = [(k, f) for k, f in chosen if f is not None and not f.known and f.lines]
        if not unknown:
            return
        idents = [f.ident for _, f in unknown]
        if self.kind == "trigger":
            stored = await self.store.trigger_log_bytes([i[0] for i in idents])
        else:
            stored = await self.store.task_log_bytes(idents)
        with self._lock:
            for (_key, found), nbytes in zip(unknown, stored, strict=True):
                if not found.known:
                    found.known = True
                    found.stored += nbytes

    async def _write(self, rows: list[Any]) -> None:
        if self.kind == "task":
            await self.store.insert_task_logs(rows)
            return
        now = time.monotonic()
        ids = {r.trigger_id for r in rows}
        mapped = self._mapped
        fresh = [i for i in ids if now - mapped.get(i, -MAP_AGAIN_S) >= MAP_AGAIN_S]
        for i in fresh:
            mapped[i] = now
        if len(mapped) > 2 * len(ids) + 1000:  # forget the triggers not seen lately
            self._mapped = {i: t for i, t in mapped.items() if now - t < MAP_AGAIN_S}
        await self.store.insert_trigger_logs(rows, fresh)

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

    async def close(self) -> None:
        """Write what is left (once) and stop routing lines here. Safe to repeat, and before
        :meth:`open`."""
        if not self._open:
            return
        self._open = False
        logcapture.uninstall()
        for key in list(self._logs):
            self.end(key)
        try:
            await self._flush(None, ending=True)
        except Exception as exc:
            log.warning(
                "%s log lines could not be written at stop (%s: %s)",
                self.kind,
                type(exc).__name__,
                exc,
            )


#: No printed line waiting: its text and the bytes cut of it.
_NOTHING = ("", 0)


def _extend(head: str, cut: int, text: str, start: int, stop: int, limit: int) -> tuple[str, int]:
    """A printed line ``head`` (``cut`` bytes cut of it) continued by ``text[start:stop]``:
    kept up to ``limit`` characters (at least as many bytes), the rest counted as cut."""
    room = limit - len(head)
    n = stop - start
    if n <= room:
        if not head and start == 0 and stop == len(text):
            return text, cut  # (the whole text: no copy)
        return head + text[start:stop], cut
    kept = max(room, 0)
    return head + text[start : start + kept], cut + utf8_len(text, start + kept, stop)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _batch(rows: list[tuple[Any, int]], start: int) -> list[tuple[Any, int]]:
    """The rows of one statement from ``start``: WRITE_BATCH at most, and WRITE_BATCH_BYTES
    (but at least one)."""
    end = min(len(rows), start + WRITE_BATCH)
    size = 0
    for i in range(start, end):
        size += rows[i][1]
        if size > WRITE_BATCH_BYTES and i > start:
            return rows[start:i]
    return rows[start:end]
