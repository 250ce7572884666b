"""The store's part of "why is this task not running?" (``deferral tasks why``, ``waiting_reason``
in ``tasks list --json``, the status page's task try page): read-only facts about task
instances and what holds them back, as structs; engine/client/why.py words the answer. A reader of
:class:`engine.store.Store`; not on a hot path (one statement for a whole listing)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.store.core import StoreCore, struct, structs
from engine.store.models import RunWait, TaskWait, WhyTask

__all__ = ["WhyQueries"]


class WhyQueries(StoreCore):
    """Store methods for "why is this task not running?"."""

    async def why_tasks(self, ti_ids: Sequence[int], *, worker_stale_s: float) -> list[TaskWait]:
        """What may hold back each of these task instances, in one statement (ordered by id;
        ids that do not exist are left out). A worker is live while its last heartbeat is
        less than ``worker_stale_s`` seconds old (the ``zombie_threshold_s`` setting)."""
        if not ti_ids:
            return []
        rows = await self._pool.fetch(self._q["why_tasks"], list(ti_ids), worker_stale_s)
        return structs(rows, TaskWait)

    async def why_task(
        self,
        dag_id: str,
        run_id: str,
        task_id: str,
        *,
        worker_stale_s: float,
        map_index: int = -1,
    ) -> WhyTask | None:
        """The run and the task instance asked about (``map_index``: which instance of a
        mapped task; None: no such run)."""
        record = await self._pool.fetchrow(self._q["why_run"], dag_id, run_id, task_id, map_index)
        if record is None:
            return None
        run = struct(record, RunWait)
        if run.ti_id is None:
            return WhyTask(run=run, task=None)
        tasks = await self.why_tasks([run.ti_id], worker_stale_s=worker_stale_s)
        return WhyTask(run=run, task=tasks[0] if tasks else None)
