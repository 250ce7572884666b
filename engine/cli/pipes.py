"""A closed pipe (``deferral tasks list | head -1``): every command ends quietly when the
reader of its output has gone, as ``ls | head -1`` does (exit 141, the code of a process
killed by SIGPIPE; no message). Python ignores SIGPIPE, so the write raises
``BrokenPipeError`` instead, wherever the command was: in click's or rich's output, inside
the command's event loop, wrapped in an exception group by a task group."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys

from rich.console import Console

__all__ = ["EXIT_CLOSED_PIPE", "PipeConsole", "is_closed_pipe", "silence_stdout"]

#: 128 + SIGPIPE: what a shell reports for a process a closed pipe ended.
EXIT_CLOSED_PIPE = 141


def is_closed_pipe(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a write to a closed pipe (also inside an exception group, alone or
    with others of its kind, or as the explicit cause of the error that was raised)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, BrokenPipeError):
            return True
        if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
            return True
        if isinstance(exc, BaseExceptionGroup):
            return all(is_closed_pipe(inner) for inner in exc.exceptions)
        exc = exc.__cause__
    return False


def silence_stdout() -> None:
    """Point standard output at /dev/null: what is still buffered, and the flush at exit, go
    nowhere instead of raising again."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return  # not a real file (a test's capture): nothing is flushed to a pipe at exit
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


class PipeConsole(Console):
    """A rich console whose write to a closed pipe raises ``BrokenPipeError`` (rich's own
    answer is to exit 1 at once), for the command's one handler (engine.cli.root)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))
