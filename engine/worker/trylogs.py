"""The lines of the tries a worker runs, stored per try: the worker's one door to the log sink.

What a try logs and prints goes to the worker's :class:`~engine.usercode.logsink.LogSink`
(``kind="task"``), bound per execution of a try, and is written in batches within the bounds
of the settings ``log_*``. Every call of the worker into ``engine/usercode``'s sink and capture
is here: binding a try, its end, flushing a try's lines before its outcome or its stop, the
line of its failure, the line of its deferral, and the output of an isolated task's child
process. (The lines of a wait's end are written by the statements that end it, with no cost
here: the triggerer's ``fire_triggers`` says when the trigger fired and what it sent, the
claim of the resume says where the try resumes.)
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import msgspec

from engine.masking import shown_json
from engine.runtime import logs
from engine.store import ClaimedTask, Store
from engine.usercode.capture import Target
from engine.usercode.logsink import NOT_STORED, LogLimits, LogSink, capture_line, capture_record
from triggers.base import decode_value

__all__ = ["UNSTORED", "TryLogs"]

#: The logger the worker's own lines about a try are stored under.
LOGGER = "engine.worker"
#: ``extra=`` of a line of the worker's log that is not stored with the try's lines.
UNSTORED: Mapping[str, bool] = MappingProxyType({NOT_STORED: True})

#: What :meth:`TryLogs.enter` bound, for :meth:`TryLogs.leave`.
_Entered = tuple[contextvars.Token[dict[str, Any]], contextvars.Token[Target | None]]


class TryLogs:
    """A worker's per-try lines (its sink, opened by the worker's ``run``)."""

    def __init__(self, store: Store, limits: LogLimits | None = None) -> None:
        self.sink = LogSink(store, "task", limits=limits)

    @property
    def max_line_bytes(self) -> int:
        return self.sink.max_line_bytes

    def open(self) -> None:
        self.sink.open()

    async def run(self) -> None:
        """Write what the tries log, every flush interval (the worker's task group)."""
        await self.sink.run()

    async def close(self) -> None:
        await self.sink.close()

    @contextlib.contextmanager
    def bound(self, ti: ClaimedTask) -> Iterator[None]:
        """What the current context (one execution of try ``ti``) logs or prints is stored
        with the try's lines, until the block ends (and the try's lines with it)."""
        token = self._bind(ti)
        try:
            yield
        finally:
            self.sink.end((ti.id, ti.try_number))
            self.sink.unbind(token)

    def enter(self, ti: ClaimedTask) -> _Entered:
        """:meth:`bound`'s start, with the try's ids bound to the process's own log lines
        too (``engine.runtime.logs``), and no generator (the worker enters one per try):
        what it returns goes to :meth:`leave`, in a ``finally``."""
        ids = logs.bind(dag=ti.dag_id, run=ti.run_id, task=ti.name, attempt=ti.try_number)
        try:
            return ids, self._bind(ti)
        except BaseException:
            logs.unbind(ids)
            raise

    def leave(self, ti: ClaimedTask, entered: _Entered) -> None:
        """:meth:`bound`'s end, for what :meth:`enter` bound."""
        ids, token = entered
        try:
            self.sink.end((ti.id, ti.try_number))
            self.sink.unbind(token)
        finally:
            logs.unbind(ids)

    def _bind(self, ti: ClaimedTask) -> contextvars.Token[Target | None]:
        # (A try this claim started has nothing stored yet: its total starts at 0.)
        fresh = ti.next_method is None and ti.try_started_at == ti.db_now
        return self.sink.bind_task(ti.id, ti.dag_id, ti.run_id, ti.name, ti.try_number, fresh=fresh)

    async def flush_ended(self, key: tuple[int, int]) -> None:
        """A try stopped (told to): its lines are stored before it is reported so."""
        self.sink.end(key)
        await self.sink.flush_keys([key])

    async def flush(self, keys: Iterable[tuple[int, int]]) -> None:
        """Store the lines these tries logged so far (nothing when they logged none)."""
        await self.sink.flush_keys(keys)

    @staticmethod
    def failure(try_number: int, error: str) -> None:
        """The error of the bound try's failure, as its last line (stored past the bounds of
        lines a second and of the try's total)."""
        capture_record(
            time.time(), "ERROR", LOGGER, f"try {try_number} failed:\n{error}", always=True
        )

    @staticmethod
    def deferral_line(
        classpath: str, kwargs: bytes, method: str, timeout_s: float | None, dedup: bool
    ) -> str:
        """The try's line about its deferral, written with it (``defer_tasks``): to which
        trigger (``kwargs`` as encoded, shown masked), where it resumes, its timeout. Never
        raises: the deferral stands whatever its line can show."""
        timeout = f"timeout {timeout_s:g}s" if timeout_s is not None else "no timeout"
        shared = ", shared by its dedup key" if dedup else ""
        try:
            shown = shown_json(decode_value(kwargs))
        except Exception as exc:  # kwargs this process cannot read (a newer trigger's)
            shown = f"(not shown: {type(exc).__name__})"
        return (
            f"deferred to trigger {classpath}{shared} ({timeout}); resumes at {method}; "
            f"trigger kwargs: {shown}"
        )

    @staticmethod
    def child_output(line: str, cut: int = 0) -> None:
        """A line a task's child process (isolation="process") wrote: one of its log lines
        (as JSON) or a print, stored with the lines of the try (bound in this context).
        ``cut``: bytes of the line cut as it was read (a log line cut so is stored as printed
        text)."""
        doc: Any = None
        if line.startswith("{") and not cut:
            with contextlib.suppress(msgspec.DecodeError):
                doc = msgspec.json.decode(line)
        if isinstance(doc, dict) and {"ts", "level", "logger", "msg"} <= doc.keys():
            message = str(doc["msg"])
            if doc.get("exc"):
                message += "\n" + str(doc["exc"])
            stored = capture_record(
                float(doc["ts"]), str(doc["level"]).upper(), str(doc["logger"]), message
            )
        else:
            stored = capture_line("stderr", line, cut=cut)
        if not stored and sys.__stderr__ is not None:
            sys.__stderr__.write(line + "\n")
