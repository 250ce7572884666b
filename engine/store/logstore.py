"""The store's log methods: writing batches of trigger and task log lines, reading them page
by page, and the retention's deletes. A reader of :class:`engine.store.Store`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from engine.masking import redact_text
from engine.states import TERMINAL_STATES, TRY_OUTCOME_STATES
from engine.store.core import StoreCore, storable, structs
from engine.store.models import LoggedTry, LogLine, TaskLogRow, TaskLogs, TriggerLogRow, TriggerLogs

if TYPE_CHECKING:
    import asyncpg

__all__ = ["DEFAULT_PAGE_LINES", "LogQueries"]

#: Lines a read returns at most, unless told otherwise.
DEFAULT_PAGE_LINES = 1000

#: States after which a try has ended (a later try may have started since).
_ENDED_STATES = frozenset(TERMINAL_STATES | TRY_OUTCOME_STATES)


def _lines(rows: Sequence[asyncpg.Record], *, stream: bool) -> list[LogLine]:
    lines = [dict(r) for r in rows if r["seq"] is not None]
    if not stream:
        for line in lines:
            line["stream"] = "log"
    return msgspec.convert(lines, list[LogLine])


class LogQueries(StoreCore):
    """The statements of log lines."""

    # -- writing (engine/usercode/logsink.py) ------------------------------------------------------

    async def insert_trigger_logs(
        self, rows: Sequence[TriggerLogRow], map_trigger_ids: Sequence[int] = ()
    ) -> None:
        """Write trigger lines in one statement, in order; the tries waiting now on
        ``map_trigger_ids`` are recorded as waiting on them. Messages are stored masked
        (:func:`engine.masking.redact_text`), as are task lines."""
        await self._pool.execute(
            self._q["insert_trigger_logs"],
            [r.trigger_id for r in rows],
            [r.at for r in rows],
            [r.level for r in rows],
            [storable(r.logger) for r in rows],
            [storable(redact_text(r.message)) for r in rows],
            list(map_trigger_ids),
        )

    async def insert_task_logs(self, rows: Sequence[TaskLogRow]) -> None:
        """Write task lines in one statement, in order."""
        await self._pool.execute(
            self._q["insert_task_logs"],
            [r.dag_id for r in rows],
            [r.run_id for r in rows],
            [r.task_id for r in rows],
            [r.try_number for r in rows],
            [r.at for r in rows],
            [r.level for r in rows],
            [r.stream for r in rows],
            [storable(r.logger) for r in rows],
            [storable(redact_text(r.message)) for r in rows],
        )

    async def trigger_log_bytes(self, trigger_ids: Sequence[int]) -> list[int]:
        """Bytes of the messages stored so far for each trigger, in the order given."""
        rows = await self._pool.fetch(self._q["trigger_log_bytes"], list(trigger_ids))
        return [int(r["bytes"]) for r in rows]

    async def task_log_bytes(self, tries: Sequence[tuple[str, str, str, int]]) -> list[int]:
        """Bytes of the messages stored so far for each task try ``(dag_id, run_id, task_id,
        try_number)``, in the order given."""
        rows = await self._pool.fetch(
            self._q["task_log_bytes"],
            [t[0] for t in tries],
            [t[1] for t in tries],
            [t[2] for t in tries],
            [t[3] for t in tries],
        )
        return [int(r["bytes"]) for r in rows]

    # -- reading (the CLI, the status page) ----------------------------------------------------

    async def trigger_logs(
        self, trigger_id: int, after_seq: int = 0, limit: int = DEFAULT_PAGE_LINES
    ) -> TriggerLogs:
        """Up to ``limit`` lines of a trigger after ``after_seq``, oldest first, while it
        waits and after it fired; see :class:`TriggerLogs`."""
        rows = await self._pool.fetch(self._q["trigger_logs"], trigger_id, after_seq, limit)
        tasks = await self._pool.fetch(self._q["trigger_log_tasks"], trigger_id)
        lines = _lines(rows, stream=False)
        return TriggerLogs(
            trigger_id=trigger_id,
            waiting=bool(rows[0]["waiting"]),
            classpath=rows[0]["classpath"],
            lines=lines,
            next_seq=lines[-1].seq if lines else after_seq,
            tasks=structs(tasks, LoggedTry),
        )

    async def task_logs(
        self,
        dag_id: str,
        run_id: str,
        task_id: str,
        try_number: int | None = None,
        after_seq: int = 0,
        limit: int = DEFAULT_PAGE_LINES,
    ) -> TaskLogs:
        """Up to ``limit`` lines of a task try (None: the latest) after ``after_seq``, oldest
        first; see :class:`TaskLogs`."""
        rows = await self._pool.fetch(
            self._q["task_logs"], dag_id, run_id, task_id, try_number, after_seq, limit
        )
        first: dict[str, Any] = dict(rows[0])
        number = first["try_number"] or 0
        latest, state = first["latest_try"], first["state"]
        triggers = await self._pool.fetch(
            self._q["task_log_triggers"], dag_id, run_id, task_id, number
        )
        lines = _lines(rows, stream=True)
        ended = latest is None or latest > number or (number > 0 and state in _ENDED_STATES)
        return TaskLogs(
            dag_id=dag_id,
            run_id=run_id,
            task_id=task_id,
            try_number=number,
            state=state,
            latest_try=latest,
            ended=ended,
            lines=lines,
            next_seq=lines[-1].seq if lines else after_seq,
            trigger_ids=[r["trigger_id"] for r in triggers],
        )

    # -- retention (the scheduler's housekeeping) ----------------------------------------------

    async def delete_old_logs(
        self, older_than_s: float, *, batch: int = 1000, max_batches: int = 20
    ) -> int:
        """Delete log lines logged more than ``older_than_s`` seconds ago, oldest first, in
        statements of at most ``batch`` rows, at most ``max_batches`` of them per table (call
        again later for the rest); returns how many rows went."""
        gone = 0
        for name in ("delete_old_trigger_logs", "delete_old_task_logs"):
            after = 0
            for _ in range(max_batches):
                row = await self._pool.fetchrow(self._q[name], older_than_s, batch, after)
                assert row is not None
                deleted = int(row["deleted"])
                gone += deleted
                # (Lines are in time order, but for the clocks of different hosts: read on
                # while a batch held old lines.)
                if row["last_seq"] is None or (deleted == 0 and not row["more"]):
                    break
                after = row["last_seq"]
        for _ in range(max_batches):
            deleted = int(
                await self._pool.fetchval(
                    self._q["delete_old_trigger_log_tasks"], older_than_s, batch
                )
            )
            gone += deleted
            if deleted < batch:
                break
        return gone
