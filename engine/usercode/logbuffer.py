"""The buffered log lines of one process's triggers or tries, and their bounds.

What a bound context logs and prints (engine/usercode/capture.py routes it) is buffered here,
per trigger or try, until the sink (engine/usercode/logsink.py) takes it to be written. The
bounds (:class:`LogLimits`, the settings ``log_*``) keep the process's memory and the database
bounded whatever a task or a trigger prints:

* every line's text goes through :func:`engine.usercode.loglines.stored_text` (cut to
  ``max_line_bytes``, saying how much was cut) before it is buffered;
* a trigger or a try keeps at most ``buffer_lines`` lines between two periodic writes of the
  sink (``max_lines_per_s`` a second): past it the oldest are dropped, and a line ``N lines
  dropped`` is stored in their place;
* a trigger or a try stores at most ``max_trigger_bytes`` / ``max_try_bytes`` of text in all
  (counting what other processes stored for it before, read from the database when this
  process first writes for it): later lines are dropped, and one line ``N lines dropped``
  says so when it ends (taken with ``ending``, or after :meth:`LogBuffer.end`);
* all the lines a process holds (buffered, or taken and not written yet) take at most
  ``buffer_bytes`` (text plus ``LINE_OVERHEAD`` a line): past it the oldest lines of the same
  trigger or try make room, or the new line is dropped (and counted as above).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterable
from typing import Any, Literal

from engine.store.models import TaskLogRow, TriggerLogRow
from engine.usercode.capture import Target
from engine.usercode.loglimits import DEFAULT_FLUSH_INTERVAL_S, LINE_OVERHEAD, LogLimits
from engine.usercode.loglines import NO_LINE, extend_line, size_text, stored_text

__all__ = ["FORGET_AFTER_WRITES", "LogBuffer"]

#: A trigger or try that logged nothing for this many writes is forgotten (what it stored is
#: read again from the database if it logs again).
FORGET_AFTER_WRITES = 60
Kind = Literal["trigger", "task"]
#: A buffered line: time, level, logger, message, stream, size of the message in bytes.
_Line = tuple[float, str, str, str, str, int]


class _Log:
    """What one buffer knows of one trigger's or try's log: its lines since the last write and
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


class LogBuffer:
    """The buffered lines of one triggerer's triggers (``kind="trigger"``) or one worker's
    tries (``kind="task"``), within the bounds of ``limits``; see the module docstring.
    Lines come from any thread (:meth:`append`, :meth:`write_text`, under a lock); the sink
    takes them on its loop (:meth:`_take`)."""

    def __init__(
        self,
        kind: Kind,
        *,
        limits: LogLimits | None = None,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
        buffer_lines: int | None = None,
    ) -> None:
        limits = limits if limits is not None else LogLimits()
        if buffer_lines is not None and buffer_lines < 1:
            raise ValueError(f"buffer_lines must be >= 1, got {buffer_lines}")
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
        #: Memory the lines held take (buffered, or taken and not written yet),
        #: LINE_OVERHEAD each; the sink gives back what it wrote (:meth:`_release`).
        self._pending = 0
        #: Periodic writes so far: the clock of the lines per write.
        self._writes = 0
        #: Lines stored so far, and dropped (over a bound, or refused); for tests and stats.
        self.written = 0
        self.dropped = 0

    def _resume(self, key: Hashable) -> None:
        """A trigger or try bound again before its last lines were written: not forgotten."""
        with self._lock:
            found = self._logs.get(key)
            if found is not None:
                found.ended = False

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
            head, cut = found.partial.pop(stream, NO_LINE) if found.partial else NO_LINE
            start = 0
            while (end := text.find("\n", start)) >= 0:
                whole.append(extend_line(head, cut, text, start, end, limit))
                head, cut = NO_LINE
                start = end + 1
            if start < len(text):
                head, cut = extend_line(head, cut, text, start, len(text), limit)
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

    # -- taking (the sink, on its loop) ------------------------------------------------------

    def _take(
        self, keys: list[Hashable] | None, *, ending: bool = False, tick: bool = False
    ) -> list[tuple[Any, int]]:
        """The rows to write, with what each costs (given back by :meth:`_release` once
        written): the lines of ``keys`` (None: of all; ``ending``: they end now), in order.
        Lines dropped since the last write are said by a line before the lines kept; lines
        dropped past the total by one line when the trigger or try ends (or is forgotten).
        ``tick``: a periodic write (the clock of the lines per write; every
        FORGET_AFTER_WRITES of them, the idle triggers and tries are forgotten)."""
        with self._lock:
            rows = self._take_lines(keys, ending)
            if tick:
                self._writes += 1
                if self._writes % FORGET_AFTER_WRITES == 0:
                    rows.extend(self._forget_idle())
        return rows

    def _take_lines(self, keys: list[Hashable] | None, ending: bool) -> list[tuple[Any, int]]:
        """(Under the lock.)"""
        rows: list[tuple[Any, int]] = []
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

    def _release(self, cost: int) -> None:
        """Rows costing ``cost`` are written (or given up): their memory is free."""
        with self._lock:
            self._pending -= cost

    def _unknown(self, keys: list[Hashable] | None) -> list[_Log]:
        """The triggers or tries of ``keys`` (None: all) with lines to write, of which this
        process does not know yet what was stored before it saw them."""
        with self._lock:
            dirty = self._dirty
            chosen = dirty.values() if keys is None else (dirty.get(k) for k in keys)
            return [f for f in chosen if f is not None and not f.known and f.lines]

    def _learn(self, unknown: list[_Log], stored: list[int]) -> None:
        """What was stored for each of ``unknown`` before (bytes), read from the database,
        counts in its total."""
        with self._lock:
            for found, nbytes in zip(unknown, stored, strict=True):
                if not found.known:
                    found.known = True
                    found.stored += nbytes

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
            f"{size_text(self.max_total_bytes)}: setting log_max_{what}_bytes)"
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
        """Whether any of these triggers or tries has something to write."""
        dirty = self._dirty
        return bool(dirty) and any(k in dirty for k in keys)
