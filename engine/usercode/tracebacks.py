"""Tracebacks of user code, without the engine's frames above it.

A task's error used to start with a screen of the worker's and anyio's frames (``worker.py``,
``to_thread.py``, ``_asyncio.py``...) before the one frame its author wrote. The text stored
as a task's or a trigger's error, and logged, keeps the frames from the first one outside the
engine's machinery (the engine package, anyio, the standard library) down to where it was
raised, under the usual header. The frames below it are all kept, the engine's included: a
``defer()`` that refused its arguments still shows where. An exception whose every frame is
the engine's (an engine bug) keeps its whole traceback.
"""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

import anyio

from engine.masking import redact_text

__all__ = ["format_user_exception"]

_PACKAGE_DIRS = tuple(
    f"{Path(p).resolve()}/"
    for p in (Path(__file__).resolve().parents[1], Path(anyio.__file__).resolve().parent)
)
_STDLIB_DIR = f"{Path(sysconfig.get_paths()['stdlib']).resolve()}/"
_INSTALLED = ("/site-packages/", "/dist-packages/")


def _is_machinery(filename: str) -> bool:
    if filename.startswith("<frozen "):
        return True
    path = str(Path(filename).resolve())
    if path.startswith(_PACKAGE_DIRS):
        return True
    # The standard library, not the packages installed under its folder (a user's among them).
    return path.startswith(_STDLIB_DIR) and not any(part in path for part in _INSTALLED)


def _trim(te: traceback.TracebackException) -> None:
    frames = list(te.stack)
    first = next((i for i, f in enumerate(frames) if not _is_machinery(f.filename)), None)
    if first:
        te.stack = traceback.StackSummary.from_list(frames[first:])


def format_user_exception(exc: BaseException) -> str:
    """``traceback.format_exception(exc)`` without the engine's leading frames (of ``exc`` and
    of the exceptions chained to it), stripped of its last newline, secrets masked."""
    top = traceback.TracebackException.from_exception(exc)
    seen: set[int] = set()
    pending = [top]
    while pending:
        te = pending.pop()
        if id(te) in seen:
            continue
        seen.add(id(te))
        _trim(te)
        pending.extend(e for e in (te.__cause__, te.__context__) if e is not None)
        pending.extend(getattr(te, "exceptions", None) or [])
    # Stored and shown as the task's or trigger's error: masked with what this process knows
    # (registered secrets, secret shapes: engine.masking), as its log lines are.
    return redact_text("".join(top.format()).rstrip())
