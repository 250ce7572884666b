"""Routing what a trigger or a task logs and prints to its log sink (engine/usercode/logsink.py,
which holds the lines in its buffers, engine/usercode/logbuffer.py).

A sink binds a context (a trigger's asyncio task, one execution of a try) to a
:class:`Target` held in a context variable, so it follows the code into the tasks it starts
and the threads it runs (``anyio.to_thread`` copies the context). One
:class:`logging.Handler` on the root logger, and one proxy in place of ``sys.stdout`` and
``sys.stderr``, installed once per process while a sink is open (:func:`install`), route what
a bound context logs or prints to its sink; anything else goes where it went before (the
process's own log, the real streams).

The engine's own lines (loggers ``engine.*``) below WARNING are not routed: they are in the
process's log, and one or two a task would cost a row each on the hot path.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import threading
import time
from collections.abc import Hashable, Iterable, Iterator
from typing import Any, Protocol, TextIO, cast

from engine.masking import redact_text
from engine.runtime import logs

__all__ = [
    "ENGINE_MIN_LEVEL",
    "NOT_STORED",
    "Sink",
    "Target",
    "bind",
    "capture_line",
    "capture_record",
    "current",
    "install",
    "reset",
    "tee_streams",
    "unbound",
    "uninstall",
]

#: Engine lines below this level are not stored per trigger or try.
ENGINE_MIN_LEVEL = logging.WARNING
#: A record with this attribute set (``extra={NOT_STORED: True}``) is not stored.
NOT_STORED = "deferral_not_stored"


class Sink(Protocol):
    """What the routing hands lines to (:class:`engine.usercode.logbuffer.LogBuffer`, the base
    of :class:`engine.usercode.logsink.LogSink`)."""

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
    ) -> None: ...

    def write_text(self, target: Target, stream: str, text: str) -> None: ...


class Target:
    """Where the lines of one bound context go: a sink, and a trigger id or a try."""

    __slots__ = ("fresh", "ident", "key", "sink")

    def __init__(
        self, sink: Sink, key: Hashable, ident: tuple[Any, ...], fresh: bool = False
    ) -> None:
        self.sink = sink
        self.key = key
        #: (trigger_id,) or (dag_id, run_id, task_id, try_number)
        self.ident = ident
        #: Nothing was stored for it before (a try's first execution): no need to ask.
        self.fresh = fresh


_target: contextvars.ContextVar[Target | None] = contextvars.ContextVar(
    "deferral_log_target", default=None
)


def current() -> Target | None:
    """Where the current context's lines go, if anywhere. A target without a key (a
    triggerer's: :meth:`LogSink.bind_triggers`) takes the trigger id bound in the context
    (engine.runtime.logs), so each trigger's task costs no binding of its own."""
    target = _target.get()
    if target is None or target.key is not None:
        return target
    trigger_id = logs.bound().get("trigger")
    if trigger_id is None:
        return None
    return Target(target.sink, trigger_id, (trigger_id,))


def bind(target: Target) -> contextvars.Token[Target | None]:
    """Route what the current context logs or prints to ``target`` (until :func:`reset`)."""
    return _target.set(target)


def reset(token: contextvars.Token[Target | None]) -> None:
    _target.reset(token)


def capture_line(stream: str, text: str, *, cut: int = 0) -> bool:
    """Store one line of ``stream`` (``cut``: bytes of it already cut) for the trigger or try
    bound in the current context (a task's child process output); False when none is bound."""
    target = current()
    if target is None:
        return False
    target.sink.append(target, time.time(), "INFO", f"<{stream}>", text, stream, cut=cut)
    return True


def capture_record(
    at: float,
    level: str,
    logger: str,
    message: str,
    stream: str = "log",
    *,
    cut: int = 0,
    always: bool = False,
) -> bool:
    """Store one log line (a task's child process logged it; ``cut``: bytes of it already
    cut) for the trigger or try bound in the current context; False when none is bound.
    ``always``: whatever the bounds of lines per write and of the total (the engine's own
    line about the try)."""
    target = current()
    if target is None:
        return False
    target.sink.append(target, at, level, logger, message, stream, cut=cut, always=always)
    return True


# -- the process's handler and stream proxies --------------------------------------------


class _Handler(logging.Handler):
    """Routes records of a bound context to its sink; others pass by."""

    _formatter = logging.Formatter()

    def handle(self, record: logging.LogRecord) -> bool:
        target = current()
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
        target = current()
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


def install() -> None:
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


def uninstall() -> None:
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
