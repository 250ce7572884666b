"""The store's part for the status page (engine/web/) and the schedulers' registry: reads of
the fleet, DAGs, runs, task tries and triggers, and the page's trigger cancel, written to the
audit table (marks and clears: engine/store/overrides.py). A reader of
:class:`engine.store.Store`; none of it is on a hot path. The reads of the page's views (grid,
Gantt, tries, searches): engine/store/browse.py."""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

import msgspec

from engine.security.keys import UnreadableValue
from engine.store.browse import BrowseReads
from engine.store.core import in_tx, structs
from engine.store.fleetstats import read_backlog_split
from engine.store.models import (
    AuditRow,
    Backlog,
    DagOverview,
    Fleet,
    FleetTriggerer,
    GridCell,
    MovedTask,
    OldestWait,
    SchedulerRow,
    TaskTry,
    TriggerListing,
    WorkerRow,
)
from engine.version import __version__

if TYPE_CHECKING:
    pass

__all__ = ["StatusQueries"]

log = logging.getLogger(__name__)


class StatusQueries(BrowseReads):
    """The statements of the status page and the schedulers' registry."""

    # -- the schedulers' registry ----------------------------------------------------------

    async def register_scheduler(self) -> int:
        scheduler_id: int = await self._pool.fetchval(
            self._q["register_scheduler"], socket.gethostname(), os.getpid(), __version__
        )
        return scheduler_id

    async def heartbeat_scheduler(self, scheduler_id: int) -> int:
        """Keep the scheduler's row (inserted again if it was removed); returns its id."""
        new_id: int = await self._pool.fetchval(
            self._q["heartbeat_scheduler"],
            scheduler_id,
            socket.gethostname(),
            os.getpid(),
            __version__,
        )
        return new_id

    async def unregister_scheduler(self, scheduler_id: int) -> None:
        await self._pool.execute(self._q["unregister_scheduler"], scheduler_id)

    # -- reads -------------------------------------------------------------------------------

    async def fleet(self) -> Fleet:
        async with self._pool.acquire() as conn:
            schedulers = await conn.fetch(self._q["fleet_schedulers"])
            workers = await conn.fetch(self._q["fleet_workers"])
            triggerers = await conn.fetch(self._q["fleet_triggerers"])
            backlog = await conn.fetchrow(self._q["fleet_backlog"])
            split = await read_backlog_split(conn, self._q)
        assert backlog is not None
        return Fleet(
            schedulers=structs(schedulers, SchedulerRow),
            workers=structs(workers, WorkerRow),
            triggerers=structs(triggerers, FleetTriggerer),
            backlog=msgspec.convert({**dict(backlog), **msgspec.to_builtins(split)}, Backlog),
        )

    async def dags_overview(
        self,
        runs: int = 10,
        *,
        name: str | None = None,
        state: str | None = None,
        paused: bool | None = None,
    ) -> list[DagOverview]:
        """Every DAG with its ``runs`` latest runs; those whose id holds ``name`` or with a tag
        ``name`` (any case), whose latest run is in ``state``, paused or not (None: all)."""
        rows = await self._pool.fetch(self._q["dags_overview"], runs, name, state, paused)
        return structs(rows, DagOverview)

    async def run_task_grid(
        self,
        dag_run_pk: int,
        *,
        state: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[GridCell]:
        """The run's task instances in the order they were created (the DAG's), those in
        ``state`` only (None: all), ``limit`` of them (None: all) after skipping ``offset``."""
        rows = await self._pool.fetch(self._q["run_task_grid"], dag_run_pk, state, limit, offset)
        return structs(rows, GridCell)

    async def run_task_counts(self, dag_run_pk: int) -> dict[str, int]:
        """How many of the run's task instances are in each state (states with none left out)."""
        rows = await self._pool.fetch(self._q["run_task_counts"], dag_run_pk)
        return {row["state"]: row["n"] for row in rows}

    async def task_try(self, dag_id: str, run_id: str, task_id: str) -> TaskTry | None:
        """One task instance in full, its encrypted values opened (None where no key does)."""
        record = await self._pool.fetchrow(self._q["task_try"], dag_id, run_id, task_id)
        if record is None:
            return None
        row = dict(record)
        for name in ("next_kwargs", "result", "trigger_kwargs"):
            try:
                row[name] = self.keyring.decrypt_opt(row[name])
            except UnreadableValue as exc:
                log.warning("task instance %s: %s not shown: %s", row["id"], name, exc)
                row[name] = None
        return msgspec.convert(row, TaskTry)

    async def triggers_page(
        self,
        *,
        classpath: str | None = None,
        triggerer_id: int | None = None,
        min_age_s: float | None = None,
        limit: int = 200,
    ) -> list[TriggerListing]:
        """Triggers, oldest first, filtered by a classpath substring, an owner (0: unowned)
        and a minimum age."""
        rows = await self._pool.fetch(
            self._q["triggers_page"], classpath, triggerer_id, min_age_s, limit
        )
        return structs(rows, TriggerListing)

    async def triggerer_health(self) -> list[FleetTriggerer]:
        """Every registered triggerer with the triggers it holds and its loop's health."""
        return structs(await self._pool.fetch(self._q["fleet_triggerers"]), FleetTriggerer)

    async def oldest_waits(self, limit: int = 20) -> list[OldestWait]:
        return structs(await self._pool.fetch(self._q["oldest_waits"], limit), OldestWait)

    async def list_audit(self, limit: int = 100) -> list[AuditRow]:
        return structs(await self._pool.fetch(self._q["list_audit"], limit), AuditRow)

    # -- the page's actions: each one and its audit row in one transaction ------------------

    async def _audited(
        self, who: str, action: str, target: str, detail: dict[str, Any], query: str, *args: Any
    ) -> list[MovedTask]:
        async with self._pool.acquire() as conn, in_tx(conn):
            rows = await conn.fetch(self._q[query], *args)
            await conn.execute(self._q["record_audit"], who, action, target, detail)
        return structs(rows, MovedTask)

    async def cancel_trigger(self, trigger_id: int, *, who: str) -> list[MovedTask]:
        """Fail the task instances waiting on a trigger and drop it; audited."""
        message = f"cancelled by {who} from the status page"
        return await self._audited(
            who,
            "cancel_trigger",
            f"trigger {trigger_id}",
            {"trigger": trigger_id},
            "cancel_trigger",
            trigger_id,
            message,
        )

    async def record_audit(
        self, who: str, action: str, target: str, detail: dict[str, Any] | None = None
    ) -> None:
        await self._pool.execute(self._q["record_audit"], who, action, target, detail or {})
