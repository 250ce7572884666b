"""DAGs, runs and task instances: recording DAGs, creating and ending runs, listing them, and
moving pending task instances on (what engine/store/downstream.py runs after a committed
change). A reader of :class:`engine.store.Store`. (Schedules and run admission:
engine/store/schedules.py.)"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import asyncpg

from engine.security.keys import UnreadableValue
from engine.store.connection import CHANNEL_RUNS, CHANNEL_TASKS, HANDED_UNREAD_S
from engine.store.core import StoreCore, from_dicts, one, struct, structs
from engine.store.models import (
    Dag,
    DagRun,
    DagRunSummary,
    DagSummary,
    EndedRun,
    MovedTask,
    TaskInstance,
    WorkLeft,
)
from engine.store.schedules import DuplicateRun

__all__ = ["DagRunNotFound", "RunQueries", "UnknownDag"]

log = logging.getLogger(__name__)


class UnknownDag(LookupError):
    """No DAG with that id has been recorded (its file was never parsed)."""


class DagRunNotFound(LookupError):
    """No run with that id exists."""


class RunQueries(StoreCore):
    """The statements of DAGs, runs and task instances."""

    # -- moving downstream work on (engine/store/downstream.py runs these) -------------------

    async def resolve_pending(
        self, run_ids: Sequence[int], finished_task_ids: Sequence[str] | None
    ) -> list[MovedTask]:
        """Move on the pending task instances of these runs whose upstreams allow it (of the
        downstreams of ``finished_task_ids``; None: every pending one); returns what moved."""
        rows = await self._pool.fetch(
            self._q["resolve_pending"],
            list(run_ids),
            None if finished_task_ids is None else list(finished_task_ids),
        )
        return structs(rows, MovedTask)

    async def wake_workers(self) -> None:
        """A task instance became runnable."""
        await self.notify(CHANNEL_TASKS)

    async def notify_finished_runs(self, run_ids: Sequence[int]) -> None:
        """Wake the scheduler for those of these runs with no unfinished task left."""
        await self._pool.execute(self._q["notify_finished_runs"], list(run_ids))

    # -- DAGs and runs ----------------------------------------------------------------------

    async def upsert_dag(
        self,
        dag_id: str,
        fileloc: str,
        tasks: list[dict[str, Any]],
        description: str | None,
        schedule: dict[str, Any] | None = None,
        *,
        fingerprint: str | None = None,
    ) -> bool:
        """Record a DAG (``schedule``: :meth:`engine.dags.dag.DAG.serialize_schedule`; None: no
        schedule; ``fingerprint``: the hash of it all, :mod:`engine.scheduler.dagrecord`). Returns
        whether its next scheduled run must be computed again (a new DAG or a changed
        schedule)."""
        sched = schedule or {}
        row = await one(
            self._pool,
            self._q["upsert_dag"],
            dag_id,
            fileloc,
            tasks,
            description,
            sched.get("timetable") or {"kind": "none"},
            sched.get("schedule"),
            sched.get("start_date"),
            sched.get("end_date"),
            bool(sched.get("catchup", False)),
            int(sched.get("max_active_runs", 16)),
            bool(sched.get("is_paused_upon_creation", False)),
            sched.get("params") or {},
            list(sched.get("tags") or ()),
            sched.get("max_active_tasks"),
            fingerprint,
            sched.get("alerts"),
        )
        return bool(row["reschedule"])

    async def dags_to_record(self, fingerprints: Mapping[str, str]) -> set[str]:
        """Of these DAGs (id: hash of what a scan found), the ids whose row is missing,
        inactive or records something else."""
        rows = await self._pool.fetch(
            self._q["dags_to_record"], list(fingerprints), list(fingerprints.values())
        )
        return {r["dag_id"] for r in rows}

    async def deactivate_missing_dags(
        self, folder: str, found: Iterable[str], failed_files: Iterable[str]
    ) -> list[str]:
        """Mark inactive (no more scheduled runs) the DAGs recorded from files under
        ``folder`` that a scan did not find, except the DAGs of ``failed_files`` (files that
        failed to import keep their DAGs as they were). Returns their ids."""
        prefix = folder.rstrip("/") + "/"
        rows = await self._pool.fetch(
            self._q["deactivate_missing_dags"], prefix, list(found), list(failed_files)
        )
        return [r["dag_id"] for r in rows]

    async def list_dags(self) -> list[DagSummary]:
        return structs(await self._pool.fetch(self._q["list_dags"]), DagSummary)

    async def get_dag(self, dag_id: str) -> Dag | None:
        row = await self._pool.fetchrow(self._q["get_dag"], dag_id)
        return None if row is None else struct(row, Dag)

    async def create_dag_run(
        self,
        dag_id: str,
        run_id: str,
        *,
        logical_date: dt.datetime,
        conf: dict[str, Any] | None = None,
        run_type: str = "manual",
        data_interval: tuple[dt.datetime, dt.datetime] | None = None,
    ) -> int:
        """Create a run and its task instances, running at once whatever the DAG's
        max_active_runs (:meth:`create_queued_run` is held back by it); returns the run's id.
        ``data_interval`` defaults to ``[logical_date, logical_date]``."""
        start, end = data_interval or (None, None)
        try:
            row = await self._pool.fetchrow(
                self._q["create_dag_run"],
                dag_id,
                run_id,
                logical_date,
                conf or {},
                run_type,
                start,
                end,
            )
        except asyncpg.UniqueViolationError:
            raise DuplicateRun(f"DAG {dag_id} already has a run {run_id!r}") from None
        if row is None:
            raise UnknownDag(
                f"unknown DAG {dag_id!r}: no DAG file with that dag_id has been parsed "
                "(pass --dags, or start a scheduler on the DAGs folder)"
            )
        await self.notify(CHANNEL_TASKS)
        run_pk: int = row["id"]
        return run_pk

    async def get_dag_run(self, dag_id: str, run_id: str) -> DagRun | None:
        row = await self._pool.fetchrow(self._q["get_dag_run"], dag_id, run_id)
        return None if row is None else struct(row, DagRun)

    async def finish_dag_runs(self, run_ids: Sequence[int] | None = None) -> list[EndedRun]:
        """End the runs whose tasks are all finished; announces each on ``deferral_runs``."""
        async with self._tx() as conn:
            locked = await conn.fetch(
                self._q["lock_runs_to_finish"], None if run_ids is None else list(run_ids)
            )
            if not locked:
                return []
            rows = await conn.fetch(self._q["finish_dag_runs"], [r["id"] for r in locked])
            for row in rows:
                await conn.execute(
                    self._q["notify"],
                    CHANNEL_RUNS,
                    f"{row['dag_id']} {row['run_id']} {row['state']}",
                )
        return structs(rows, EndedRun)

    async def runs_with_pending(self) -> list[int]:
        """The running runs that still have pending task instances."""
        return [r["id"] for r in await self._pool.fetch(self._q["runs_with_pending"])]

    async def list_task_instances(
        self,
        *,
        dag_id: str | None = None,
        run_id: str | None = None,
        state: str | None = None,
        limit: int = 10_000,
    ) -> list[TaskInstance]:
        rows = await self._pool.fetch(self._q["list_task_instances"], dag_id, run_id, state, limit)
        listed = [dict(r) for r in rows]
        for row in listed:
            try:
                row["result"] = self.keyring.decrypt_opt(row["result"])
            except UnreadableValue as exc:
                # One unreadable result must not hide the others: listed without it.
                log.warning("task instance %s: result not shown: %s", row["id"], exc)
                row["result"] = None
        return from_dicts(listed, TaskInstance)

    async def list_dag_runs(
        self, *, dag_id: str | None = None, state: str | None = None, limit: int = 10_000
    ) -> list[DagRunSummary]:
        """Runs, newest first, with how many task instances are in each state."""
        rows = await self._pool.fetch(self._q["list_dag_runs"], dag_id, state, limit)
        return structs(rows, DagRunSummary)

    async def prev_success_interval_start(
        self, dag_id: str, logical_date: dt.datetime
    ) -> dt.datetime | None:
        """The data interval start of the latest successful run of ``dag_id`` before
        ``logical_date``; None when there is none."""
        start: dt.datetime | None = await self._pool.fetchval(
            self._q["prev_success_interval_start"], dag_id, logical_date
        )
        return start

    async def dags_of_run_id(self, run_id: str) -> list[str]:
        """The DAG ids that have a run called ``run_id`` (usually one, or none)."""
        rows = await self._pool.fetch(self._q["dags_of_run_id"], run_id)
        return [r["dag_id"] for r in rows]

    async def count_task_states(self, dag_run_pk: int | None = None) -> dict[str, int]:
        rows = await self._pool.fetch(self._q["count_task_states"], dag_run_pk)
        return {r["state"]: r["n"] for r in rows}

    async def work_left(self) -> WorkLeft:
        """Counts of what is left to do now: ``runnable`` (runnable now, queued or running),
        ``deferred_due`` (deadline due, or trigger not claimed yet), ``runs_to_end``."""
        return struct(await one(self._pool, self._q["work_left"]), WorkLeft)

    # -- the scheduler's housekeeping -------------------------------------------------------

    async def reap_zombie_tasks(
        self,
        threshold_s: float,
        *,
        contact_since: dt.datetime | None = None,
        last_contact: dt.datetime | None = None,
        max_gap_s: float = 0.0,
        handed_unread_s: float = HANDED_UNREAD_S,
    ) -> list[MovedTask]:
        """Fail the running tries whose worker missed heartbeats for ``threshold_s`` seconds.
        Only heartbeats the database could have received count as missed: none before the
        server last started, nor before ``contact_since`` (when the caller's unbroken contact
        with the database began; engine/scheduler/contact.py). With ``last_contact`` (the database
        time of the caller's latest contact), nothing is reaped if this statement starts more
        than ``max_gap_s`` after it. Resumes a fire handed to a worker that no worker read
        within ``handed_unread_s`` (at most ``threshold_s``) are given back instead: state
        ``scheduled``, the same try. Returns what moved, which the caller settles
        (engine/store/downstream.py)."""
        rows = await self._pool.fetch(
            self._q["reap_zombie_tasks"],
            threshold_s,
            contact_since,
            last_contact,
            max_gap_s,
            min(handed_unread_s, threshold_s),
        )
        return structs(rows, MovedTask)
