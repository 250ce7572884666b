"""Per-trigger and per-try logs, kept in the database: no file per trigger, no write per line.

A triggerer binds each trigger's asyncio task to its :class:`LogSink` (``bind_trigger``), a
worker each execution of a try (``bind_task``); the binding is a context variable, so it
follows the code into the tasks it starts and the threads it runs (``anyio.to_thread``
copies the context). One :class:`logging.Handler` on the root logger, and one proxy in place
of ``sys.stdout`` and ``sys.stderr``, installed once per process while a sink is open, route
what a bound context logs or prints to its sink; anything else goes where it went before
(the process's own log, the real streams).

A sink keeps a bounded buffer per trigger or try (``buffer_lines``: past it the oldest lines
are dropped and counted, and a line saying how many were dropped is stored in their place),
and a bound on all its buffers together (``max_pending_lines``). One background task writes
everything buffered every ``flush_interval_s`` (sooner once ``WRITE_BATCH`` lines wait), in
one statement per ``WRITE_BATCH`` lines. Before a triggerer writes an event, and before a
worker writes a try's outcome, the lines of those triggers and tries are written first
(``flush_keys``; nothing when they logged nothing): a reader that sees a trigger gone or a
try ended has every line they logged before it.

The engine's own lines (loggers ``engine.*``) below WARNING are not stored: they are in the
process's log, and one or two a task would cost a row each on the hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import sys
import threading
import time
from collections.abc import Hashable, Iterable, Iterator
from typing import Any, Literal, TextIO, cast

import anyio

from engine import logs
from engine.retry import REFUSED_DATA_ERRORS
from engine.security.masking import redact_text
from engine.store.logstore import TaskLogRow, TriggerLogRow

__all__ = [
    "DEFAULT_BUFFER_LINES",
    "DEFAULT_FLUSH_INTERVAL_S",
    "DEFAULT_MAX_PENDING_LINES",
    "MAX_LINE_CHARS",
    "NOT_STORED",
    "WRITE_BATCH",
    "LogSink",
    "capture_line",
    "capture_record",
    "tee_streams",
    "unbound",
]

log = logging.getLogger(__name__)

#: Lines kept per trigger or try between two writes; older ones are dropped (and counted).
DEFAULT_BUFFER_LINES = 1000
#: Lines kept by one sink between two writes, all triggers or tries together.
DEFAULT_MAX_PENDING_LINES = 100_000
#: How often buffered lines are written.
DEFAULT_FLUSH_INTERVAL_S = 1.0
#: Lines per statement; this many waiting also wakes the writer before its interval.
WRITE_BATCH = 1000
#: A longer line is cut here (with a note of how much was cut).
MAX_LINE_CHARS = 32_768
#: The tries waiting on a logging trigger are recorded again at most this often.
MAP_AGAIN_S = 10.0
#: Engine lines below this level are not stored per trigger or try.
ENGINE_MIN_LEVEL = logging.WARNING
#: A record with this attribute set (``extra={NOT_STORED: True}``) is not stored.
NOT_STORED = "deferral_not_stored"

Kind = Literal["trigger", "task"]


class _Target:
    """Where the lines of one bound context go: a sink, and a trigger id or a try."""

    __slots__ = ("ident", "key", "sink")

    def __init__(self, sink: LogSink, key: Hashable, ident: tuple[Any, ...]) -> None:
        self.sink = sink
        self.key = key
        #: (trigger_id,) or (dag_id, run_id, task_id, try_number)
        self.ident = ident


_target: contextvars.ContextVar[_Target | None] = contextvars.ContextVar(
    "deferral_log_target", default=None
)


def _current() -> _Target | None:
    """Where the current context's lines go, if anywhere. A target without a key (a
    triggerer's: :meth:`LogSink.bind_triggers`) takes the trigger id bound in the context
    (engine.logs), so each trigger's task costs no binding of its own."""
    target = _target.get()
    if target is None or target.key is not None:
        return target
    trigger_id = logs.bound().get("trigger")
    if trigger_id is None:
        return None
    return _Target(target.sink, trigger_id, (trigger_id,))


class _Buffer:
    """The lines of one trigger or try since the last write. (A list, not a deque: a
    triggerer may hold a buffer for each of 100,000 triggers that logged a line, and an empty
    deque alone is some 600 bytes.)"""

    __slots__ = ("dropped", "ident", "lines", "partial")

    def __init__(self, ident: tuple[Any, ...]) -> None:
        self.ident = ident
        self.lines: list[tuple[float, str, str, str, str]] = []
        self.dropped = 0
        #: A printed line not ended yet, by stream.
        self.partial: dict[str, str] = {}


def _cut(text: str) -> str:
    if len(text) <= MAX_LINE_CHARS:
        return text
    return f"{text[:MAX_LINE_CHARS]} [... {len(text) - MAX_LINE_CHARS} characters cut]"


class LogSink:
    """The buffered lines of one triggerer's triggers (``kind="trigger"``) or one worker's
    tries (``kind="task"``), and their writer; see the module docstring."""

    def __init__(
        self,
        store: Any,
        kind: Kind,
        *,
        buffer_lines: int = DEFAULT_BUFFER_LINES,
        max_pending_lines: int = DEFAULT_MAX_PENDING_LINES,
        flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S,
    ) -> None:
        if buffer_lines < 1:
            raise ValueError(f"buffer_lines must be >= 1, got {buffer_lines}")
        self.store = store
        self.kind = kind
        self.buffer_lines = buffer_lines
        self.max_pending_lines = max_pending_lines
        self.flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        self._buffers: dict[Hashable, _Buffer] = {}
        self._pending = 0
        #: Rows a write failed to store: written first next time.
        self._unwritten: list[Any] = []
        self._write_lock: anyio.Lock | None = None
        self._wake: anyio.Event | None = None
        self._loop: Any = None
        self._wake_asked = False
        self._open = False
        #: Trigger id -> when the tries waiting on it were last recorded (monotonic).
        self._mapped: dict[int, float] = {}
        #: Lines stored so far, and dropped (buffer full); for tests and stats.
        self.written = 0
        self.dropped = 0

    # -- binding ---------------------------------------------------------------------------

    def bind_trigger(self, trigger_id: int) -> contextvars.Token[_Target | None]:
        """Route what the current context (a trigger's asyncio task) logs or prints here."""
        return _target.set(_Target(self, trigger_id, (trigger_id,)))

    def bind_triggers(self) -> contextvars.Token[_Target | None]:
        """Route what the tasks started from the current context log or print here, each by
        the trigger id bound in it (``logs.bind(trigger=...)``; without one, nowhere)."""
        return _target.set(_Target(self, None, ()))

    def bind_task(
        self, ti_id: int, dag_id: str, run_id: str, task_id: str, try_number: int
    ) -> contextvars.Token[_Target | None]:
        """Route what the current context (one execution of a try) logs or prints here."""
        return _target.set(
            _Target(self, (ti_id, try_number), (dag_id, run_id, task_id, try_number))
        )

    @staticmethod
    def unbind(token: contextvars.Token[_Target | None]) -> None:
        _target.reset(token)

    # -- buffering (any thread) ------------------------------------------------------------

    def append(
        self, target: _Target, at: float, level: str, logger: str, message: str, stream: str
    ) -> None:
        line = (at, level, logger, _cut(message), stream)
        with self._lock:
            buf = self._buffers.get(target.key)
            if buf is None:
                buf = self._buffers[target.key] = _Buffer(target.ident)
            if len(buf.lines) >= self.buffer_lines:
                del buf.lines[0]  # the oldest goes
                buf.dropped += 1
            elif self._pending >= self.max_pending_lines:
                buf.dropped += 1  # every buffer together is full: this one goes
                return
            else:
                self._pending += 1
            buf.lines.append(line)
            wake = self._pending >= WRITE_BATCH and not self._wake_asked
            if wake:
                self._wake_asked = True
        if wake:
            self._ask_write()

    def write_text(self, target: _Target, stream: str, text: str) -> None:
        """What the bound context printed: whole lines are buffered, the rest waits for its
        end (or for :meth:`end`)."""
        with self._lock:
            buf = self._buffers.get(target.key)
            if buf is None:
                buf = self._buffers[target.key] = _Buffer(target.ident)
            text = buf.partial.pop(stream, "") + text
            *whole, rest = text.split("\n")
            if rest:
                buf.partial[stream] = rest[: MAX_LINE_CHARS + 1]
        now = time.time()
        for line in whole:
            self.append(target, now, "INFO", f"<{stream}>", line.rstrip("\r"), stream)

    def end(self, key: Hashable) -> None:
        """A trigger or an execution of a try ended: what it printed without a final newline
        is a line of its own."""
        buf = self._buffers.get(key)
        if buf is None or not buf.partial:
            return
        with self._lock:
            partial, buf.partial = buf.partial, {}
        target = _Target(self, key, buf.ident)
        for stream, text in partial.items():
            self.append(target, time.time(), "INFO", f"<{stream}>", text, stream)

    def _ask_write(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the last flush is done
            loop.call_soon_threadsafe(wake.set)

    def _take(self, keys: Iterable[Hashable] | None) -> list[Any]:
        """The rows to write: the unwritten ones first, then the buffers of ``keys`` (None:
        all), in order; each buffer that dropped lines starts with a line saying so."""
        with self._lock:
            if keys is None:
                taken = list(self._buffers.items())
                self._buffers = {}
            else:
                taken = [(k, b) for k in keys if (b := self._buffers.pop(k, None)) is not None]
            rows, self._unwritten = self._unwritten, []
            for key, buf in taken:
                if buf.partial:  # still being printed: its buffer stays for the rest
                    self._buffers[key] = _Buffer(buf.ident)
                    self._buffers[key].partial = buf.partial
                self._pending -= len(buf.lines)
                if buf.dropped:
                    self.dropped += buf.dropped
                    first_at = buf.lines[0][0] if buf.lines else time.time()
                    note = (
                        f"{buf.dropped} lines dropped (more than {self.buffer_lines} between "
                        "two writes, or too many lines waiting in this process)"
                    )
                    marker = (first_at, "WARNING", "deferral", note, "log")
                    rows.append(self._row(buf.ident, marker))
                rows.extend(self._row(buf.ident, line) for line in buf.lines)
            self._wake_asked = False
        return rows

    def _row(self, ident: tuple[Any, ...], line: tuple[float, str, str, str, str]) -> Any:
        at, level, logger, message, stream = line
        if self.kind == "trigger":
            return TriggerLogRow(ident[0], at, level, logger, message)
        dag_id, run_id, task_id, try_number = ident
        return TaskLogRow(dag_id, run_id, task_id, try_number, at, level, stream, logger, message)

    def has_lines(self, keys: Iterable[Hashable]) -> bool:
        buffers = self._buffers
        if not buffers and not self._unwritten:
            return False
        return bool(self._unwritten) or any(k in buffers for k in keys)

    # -- writing (the event loop) ----------------------------------------------------------

    async def flush(self) -> None:
        """Write everything buffered now (retrying nothing: what fails waits for the next)."""
        await self._flush(None)

    async def flush_keys(self, keys: Iterable[Hashable]) -> None:
        """Write the lines of these triggers or tries now, if they logged any (before their
        event or outcome is written). A failure is logged and the lines wait for the next
        write: the event or outcome is not held up."""
        keys = list(keys)
        if not self.has_lines(keys):
            return
        try:
            await self._flush(keys)
        except Exception as exc:
            log.warning("writing %s log lines failed (%s: %s)", self.kind, type(exc).__name__, exc)

    async def _flush(self, keys: list[Hashable] | None) -> None:
        if self._write_lock is None:
            self._write_lock = anyio.Lock()
        async with self._write_lock:
            rows = self._take(keys)
            done = 0
            try:
                while done < len(rows):
                    batch = rows[done : done + WRITE_BATCH]
                    try:
                        await self._write(batch)
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
                    done += len(batch)
            except BaseException:
                with self._lock:
                    self._unwritten[:0] = rows[done:]
                    excess = len(self._unwritten) - self.max_pending_lines
                    if excess > 0:
                        del self._unwritten[:excess]
                        self.dropped += excess
                raise

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
        while any sink is open). Call on the event loop that will run :meth:`run`."""
        if self._open:
            return
        self._loop = asyncio.get_running_loop()
        self._wake = anyio.Event()
        self._open = True
        _install()

    async def run(self) -> None:
        """The writer: every ``flush_interval_s``, or once ``WRITE_BATCH`` lines wait. Runs
        until cancelled (:meth:`close` writes what is left)."""
        failing = False
        while True:
            with anyio.move_on_after(self.flush_interval_s):
                assert self._wake is not None
                await self._wake.wait()
            self._wake = anyio.Event()
            try:
                await self._flush(None)
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
        _uninstall()
        for key in list(self._buffers):
            self.end(key)
        try:
            await self._flush(None)
        except Exception as exc:
            log.warning(
                "%s log lines could not be written at stop (%s: %s)",
                self.kind,
                type(exc).__name__,
                exc,
            )
        self._loop = None


def capture_line(stream: str, text: str) -> bool:
    """Store one line of ``stream`` for the trigger or try bound in the current context (a
    task's child process output); False when none is bound."""
    target = _current()
    if target is None:
        return False
    target.sink.append(target, time.time(), "INFO", f"<{stream}>", text, stream)
    return True


def capture_record(at: float, level: str, logger: str, message: str, stream: str = "log") -> bool:
    """Store one log line (a task's child process logged it) for the trigger or try bound in
    the current context; False when none is bound."""
    target = _current()
    if target is None:
        return False
    target.sink.append(target, at, level, logger, message, stream)
    return True


# -- the process's handler and stream proxies --------------------------------------------


class _Handler(logging.Handler):
    """Routes records of a bound context to its sink; others pass by."""

    _formatter = logging.Formatter()

    def handle(self, record: logging.LogRecord) -> bool:
        target = _current()
        if target is None:
            return False
        if record.levelno < ENGINE_MIN_LEVEL and (
            record.name == "engine" or record.name.startswith("engine.")
        ):
            return False
        if getattr(record, NOT_STORED, False):
            return False
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + self._formatter.formatException(record.exc_info)
            if record.stack_info:
                message += "\n" + record.stack_info
            target.sink.append(
                target, record.created, record.levelname, record.name, message, "log"
            )
        except Exception:
            self.handleError(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:  # pragma: no cover - handle() does it
        self.handle(record)


class _StreamProxy:
    """Stands in for ``sys.stdout`` / ``sys.stderr``: what a bound context writes goes to its
    sink, anything else to the real stream."""

    def __init__(self, real: TextIO, name: str) -> None:
        self._deferral_real = real
        self._name = name

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            # As a text stream does, whatever is bound: click probes a stream with
            # ``write(b"")`` to tell a binary one, and caches the answer per stream.
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        target = _current()
        if target is None:
            return self._deferral_real.write(text)
        target.sink.write_text(target, self._name, text)
        if _tee:
            self._deferral_real.write(redact_text(text))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._deferral_real.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._deferral_real, name)


#: While set (:func:`tee_streams`), what a bound context prints also reaches the real stream.
_tee = False


@contextlib.contextmanager
def tee_streams() -> Iterator[None]:
    """What bound contexts print is stored and also written to the process's real streams
    (``deferral tasks test`` shows the task's output as it runs)."""
    global _tee
    before, _tee = _tee, True
    try:
        yield
    finally:
        _tee = before


@contextlib.contextmanager
def unbound() -> Iterator[None]:
    """Within, the current context logs and prints to the process's own log and streams, not
    to the sink of the trigger or try it runs for."""
    token = _target.set(None)
    try:
        yield
    finally:
        _target.reset(token)


_install_count = 0
_handler: _Handler | None = None
_install_lock = threading.Lock()


def _install() -> None:
    global _install_count, _handler
    with _install_lock:
        _install_count += 1
        if _install_count > 1:
            return
        _handler = _Handler()
        logging.getLogger().addHandler(_handler)
        if sys.stdout is not None:  # (None without a console)
            sys.stdout = cast(TextIO, _StreamProxy(sys.stdout, "stdout"))
        if sys.stderr is not None:
            sys.stderr = cast(TextIO, _StreamProxy(sys.stderr, "stderr"))


def _uninstall() -> None:
    global _install_count, _handler
    with _install_lock:
        _install_count -= 1
        if _install_count > 0:
            return
        _install_count = 0
        if _handler is not None:
            logging.getLogger().removeHandler(_handler)
            _handler = None
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if isinstance(stream, _StreamProxy):
                setattr(sys, name, stream._deferral_real)
