"""What an import error of a DAG file says: the text stored and logged for it (what happened,
then the traceback of the DAG file's own frames), its one-line summary, and how often it is
logged (once per change of its file)."""

from __future__ import annotations

import importlib
import logging
import os
import re
import traceback
from pathlib import Path

__all__ = ["ErrorReports", "describe", "error_summary", "user_traceback"]

#: Frames of the import machinery (engine/dags/dagparse.py, the DAG bag, importlib) are left
#: out of an import error's traceback: the DAG author needs their own file's lines, not the
#: engine's.
_MACHINERY_FILES = frozenset(
    str(Path(__file__).resolve().with_name(name)) for name in ("dagparse.py", "dagbag.py")
)
_IMPORTLIB_DIR = str(Path(importlib.__file__).resolve().parent)


def _is_machinery(filename: str) -> bool:
    if filename.startswith("<frozen importlib"):
        return True
    try:
        path = str(Path(filename).resolve())
    except (OSError, ValueError):
        return False
    return path in _MACHINERY_FILES or path.startswith(_IMPORTLIB_DIR + os.sep)


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` (and of the exceptions chained to it) without the import
    machinery's frames, under a ``Traceback (most recent call last):`` line even when no frame
    is left (a ``SyntaxError``: its file, line and caret follow)."""
    top = traceback.TracebackException.from_exception(exc)
    seen: set[int] = set()
    pending = [top]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        current.stack = traceback.StackSummary.from_list(
            [frame for frame in current.stack if not _is_machinery(frame.filename)]
        )
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    text = "".join(top.format())
    if not top.stack:
        # format() writes the header only above frames: put it back above the exception line.
        lines = text.splitlines(keepends=True)
        own = "".join(top.format_exception_only())
        text = "".join(lines[: len(lines) - len(own.splitlines())])
        text += "Traceback (most recent call last):\n" + own
    return text.rstrip()


def describe(file: Path, exc: BaseException) -> str:
    """An import error's text: what happened, then the traceback (the DAG file's frames)."""
    body = user_traceback(exc)
    if isinstance(exc, SystemExit):
        return f"DAG file {file} called sys.exit({exc.code!r}) at import\n{body}"
    if not isinstance(exc, Exception):
        return f"DAG file {file} raised {type(exc).__name__} at import\n{body}"
    return body


_TRACEBACK_FILE = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+)', re.MULTILINE)


def error_summary(error: str) -> str:
    """One line for an import error: a traceback's exception line with the place it was raised
    (``SyntaxError: invalid syntax (at dags/x.py:3)``), or the first line of any other text."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "(no error text)"
    if not any(line.startswith("Traceback") for line in lines):
        return lines[0]
    places = list(_TRACEBACK_FILE.finditer(error))
    where = f" (at {places[-1]['file']}:{places[-1]['line']})" if places else ""
    return lines[-1].strip() + where


class ErrorReports:
    """Logs an import error once per change of its file (or of the error): a short line and
    the traceback under it; the same error again is logged at DEBUG level only."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        #: The error last logged for each path: its file's ``stat`` and summary.
        self._last: dict[str, tuple[object, str]] = {}
        #: The paths whose error was logged since :meth:`begin` (new or changed errors).
        self.new: list[str] = []

    def begin(self) -> None:
        """A (re)load begins: :attr:`new` counts from now."""
        self.new = []

    def report(self, path: str, stat: object, error: str) -> None:
        summary = error_summary(error)
        if self._last.get(path) == (stat, summary):
            self._log.debug(
                "DAG file %s still fails to import (reported before): %s", path, summary
            )
            return
        self._last[path] = (stat, summary)
        self.new.append(path)
        detail = error.strip()
        if detail == summary:
            self._log.error("DAG file %s failed to import: %s", path, summary)
        else:
            self._log.error("DAG file %s failed to import: %s\n%s", path, summary, detail)

    def forget(self, path: str) -> None:
        """The file imported: an error it has again is logged anew."""
        self._last.pop(path, None)

    def keep(self, paths: set[str]) -> None:
        """Forget the paths not in ``paths`` (gone from the folder)."""
        for stale in set(self._last) - paths:
            del self._last[stale]
