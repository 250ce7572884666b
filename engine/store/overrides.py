"""Marking and clearing task instances: the one implementation behind the status page's actions
(and the command line's). A reader of :class:`engine.store.Store`.

A mark ends task instances in a state whatever they were doing; a clear makes them run again
(their next claim is a new try). Either way, in one transaction:

* a **running** try is told to stop: it is recorded in ``deferral_stopping_tries`` and its
  worker is woken (``deferral_stop``); the worker cancels the try as it does at an
  ``execution_timeout`` and reports it gone with its next heartbeat. Until then the try keeps
  counting in its pool and its limits, and no new try of the task instance is admitted. Every
  write of the old try (outcome, deferral, reschedule, heartbeat) is fenced by task instance,
  try number and worker, so nothing it does late changes the task instance again;
* a **deferred** task leaves its trigger, and the trigger is dropped when no other task waits
  on it (a shared trigger keeps running for its other waiters); its event, should it still
  come, moves nothing;
* an audit row (``deferral_audit``) and a line in the log of the task's latest try say who did
  what, from where;
* no callback is requested, neither the task's nor (for a run marked as a whole) the DAG's:
  a mark is the user's override, not the task's outcome (as in Airflow, where marking sets
  the state and runs no callback). A run that a mark of some tasks lets end is ended by the
  scheduler later, and calls back as any run does.

The downstream tasks are then resolved by their trigger rules, as if the task had ended that way
(a cleared task with upstreams is resolved too: one whose upstream failed does not run).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import get_args

import asyncpg
import msgspec

from engine.states import TaskOutcomeKind
from engine.store.core import in_tx, structs
from engine.store.downstream import settle
from engine.store.models import MovedTask, Override, OverrideTarget, RunOverride
from engine.store.runs import RunQueries

__all__ = [
    "FAILED_STATES",
    "MARK_STATES",
    "RUN_MARK_STATES",
    "UNFINISHED_STATES",
    "VIA_PAGE",
    "NoSuchTarget",
    "OverrideQueries",
]

log = logging.getLogger(__name__)

#: The states a task instance can be marked with.
MARK_STATES: frozenset[str] = frozenset(get_args(TaskOutcomeKind))

#: The states a whole run can be marked with.
RUN_MARK_STATES: frozenset[str] = frozenset({"success", "failed"})

#: What ``only_failed`` keeps.
FAILED_STATES: frozenset[str] = frozenset({"failed", "upstream_failed"})

#: The task states a run's mark changes (success: every task not a success already).
UNFINISHED_STATES: frozenset[str] = frozenset(
    {"pending", "scheduled", "queued", "running", "deferred", "up_for_reschedule", "up_for_retry"}
)

#: The unfinished states a run marked failed fails (the others it skips), as Airflow does: the
#: tries under way, whether on a worker, a trigger or waiting for a reschedule.
_UNDER_WAY = ("queued", "running", "deferred", "up_for_reschedule")

#: How the status page names itself in the audit rows, the errors and the log lines.
VIA_PAGE = "the status page"


class NoSuchTarget(LookupError):
    """A clear or a mark named a DAG, a run or a task that does not exist (nothing changed)."""


class OverrideQueries(RunQueries):
    """The statements that mark and clear task instances (they settle what they moved, with
    the runs reader's statements)."""

    async def override_targets(
        self,
        dag_id: str,
        run_id: str,
        task_ids: Sequence[str] | None = None,
        *,
        map_indexes: Sequence[int] | None = None,
        downstream: bool = False,
        upstream: bool = False,
        only_failed: bool = False,
    ) -> list[OverrideTarget]:
        """The task instances of run ``run_id`` of ``dag_id`` that a clear or a mark of
        ``task_ids`` (None: every task of the run) reaches, as they are now: those tasks
        (``map_indexes``, one per task id: only that instance of a mapped task; -1 or None:
        every instance), with ``downstream`` their downstream tasks (transitively, whole),
        with ``upstream`` their upstream tasks; ``only_failed``: only those failed or
        upstream_failed. Raises :class:`NoSuchTarget` for an unknown DAG, run or task (naming
        it)."""
        if map_indexes is not None and (task_ids is None or len(map_indexes) != len(task_ids)):
            raise ValueError("map_indexes needs one map index per task id")
        run = await self.get_dag_run(dag_id, run_id)
        if run is None:
            if await self.get_dag(dag_id) is None:
                raise NoSuchTarget(f"no DAG {dag_id!r} (deferral dags list shows the DAGs)")
            raise NoSuchTarget(
                f"no run {run_id!r} of DAG {dag_id!r} (deferral runs list --dag {dag_id} "
                "shows its runs)"
            )
        if task_ids is not None:
            known = {r["task_id"] for r in await self._pool.fetch(self._q["run_task_ids"], run.id)}
            unknown = sorted(set(task_ids) - known)
            if unknown:
                names = ", ".join(repr(t) for t in unknown)
                raise NoSuchTarget(
                    f"no task {names} in run {run_id!r} of DAG {dag_id!r}"
                    + (f" (its tasks: {', '.join(sorted(known))})" if known else " (it has none)")
                )
        rows = await self._pool.fetch(
            self._q["override_targets"],
            run.id,
            None if task_ids is None else list(task_ids),
            downstream,
            upstream,
            only_failed,
            None if task_ids is None else list(map_indexes or [-1] * len(task_ids)),
        )
        return [OverrideTarget(dag_id=dag_id, run_id=run_id, **dict(r)) for r in rows]

    async def mark_run(
        self, dag_id: str, run_id: str, state: str, *, who: str, via: str = VIA_PAGE
    ) -> RunOverride:
        """End run ``run_id`` of ``dag_id`` in ``state`` (``success`` or ``failed``), with its
        task instances, in one transaction. Success: every task instance not a success is
        marked success. Failed: the tries under way (queued, running, deferred, up for
        reschedule) are marked failed, the task instances that have not started or wait for a
        retry skipped; ended ones are kept. Each task instance as :meth:`mark_tasks` marks it
        (a running try told to stop, a trigger left, audited), then the run ends in ``state``
        (audited; announced as a run the scheduler ended is). Raises :class:`NoSuchTarget`."""
        if state not in RUN_MARK_STATES:
            raise ValueError(f"a run can be marked failed or success, not {state!r}")
        run = await self.get_dag_run(dag_id, run_id)
        if run is None:
            await self.override_targets(dag_id, run_id)  # (raises, naming what is missing)
            raise NoSuchTarget(f"no run {run_id!r} of DAG {dag_id!r}")
        rows: list[asyncpg.Record] = []
        async with self._pool.acquire() as conn, in_tx(conn):
            # The triggers its deferred tasks and its deadlines wait on first (in id order, as
            # a trigger firing locks them), then its task instances, read as they are now (a
            # task that ended before these locks keeps its end under a mark failed), then the
            # run's row, written last as a clear or a mark of tasks writes it (a scheduler
            # ending the run meanwhile is ended over).
            await conn.execute(self._q["begin_override"])
            was = await conn.fetchval(self._q["run_state"], run.id)
            left = [r["id"] for r in await conn.fetch(self._q["lock_run_triggers"], run.id)]
            marks: dict[str, list[int]] = {}
            for t in await conn.fetch(self._q["lock_run_tasks"], run.id):
                if state == "success":
                    mark = "success" if t["state"] != "success" else None
                elif t["state"] in _UNDER_WAY:
                    mark = "failed"
                else:
                    mark = "skipped" if t["state"] in UNFINISHED_STATES else None
                if mark is not None:
                    marks.setdefault(mark, []).append(t["id"])
            for mark, group in sorted(marks.items()):
                rows += await conn.fetch(self._q["mark_tasks"], group, mark, who, via)
            if left:
                await conn.fetch(self._q["delete_orphan_triggers"], left)
            await conn.fetch(self._q["end_marked_run"], run.id, state, who, via)
        done = await _settle(self, structs(rows, Override))
        return RunOverride(dag_id=dag_id, run_id=run_id, was=str(was), state=state, tasks=done)

    async def mark_tasks(
        self, ti_ids: Sequence[int], state: str, *, who: str, via: str = VIA_PAGE
    ) -> list[Override]:
        """End the task instances ``ti_ids`` in ``state`` (``success``, ``failed`` or
        ``skipped``) whatever they were doing: see the module's docstring. ``who`` and ``via``
        (e.g. ``the status page``) go to the audit, the log line and a failure's error. Task
        instances already in ``state`` (or that do not exist) are left out of the result."""
        if state not in MARK_STATES:
            marks = ", ".join(sorted(MARK_STATES))
            raise ValueError(f"a task can be marked {marks}, not {state!r}")
        return await self._override("mark_tasks", ti_ids, state, who, via)

    async def clear_tasks(
        self, ti_ids: Sequence[int], *, who: str, via: str = VIA_PAGE
    ) -> list[Override]:
        """Make the task instances ``ti_ids`` run again, whatever they were doing: see the
        module's docstring. Their next claim is a new try (try number + 1) with its retries
        counted afresh; a running try is stopped first (the new one waits for it). A mapped
        task whose every instance is cleared (none still stopping) goes back to one
        unexpanded instance and expands again over its upstream's values as they are then
        (``collapse_cleared_mapped``)."""
        return await self._override("clear_tasks", ti_ids, who, via)

    async def mark_task(
        self, ti_id: int, state: str, *, who: str, via: str = VIA_PAGE
    ) -> Override | None:
        """:meth:`mark_tasks` for one task instance; None if it was in ``state`` already."""
        done = await self.mark_tasks([ti_id], state, who=who, via=via)
        return done[0] if done else None

    async def clear_task(self, ti_id: int, *, who: str, via: str = VIA_PAGE) -> Override | None:
        """:meth:`clear_tasks` for one task instance; None if it does not exist."""
        done = await self.clear_tasks([ti_id], who=who, via=via)
        return done[0] if done else None

    async def _override(self, query: str, ti_ids: Sequence[int], *args: str) -> list[Override]:
        ids = sorted(set(ti_ids))
        if not ids:
            return []
        async with self._pool.acquire() as conn, in_tx(conn):
            await conn.execute(self._q["begin_override"])
            # The triggers first, as a firing trigger locks them before its waiters.
            left = [r["id"] for r in await conn.fetch(self._q["lock_left_triggers"], ids)]
            rows = await conn.fetch(self._q[query], ids, *args)
            if query == "clear_tasks":
                await conn.fetch(self._q["collapse_cleared_mapped"], ids)
            if left:
                await conn.fetch(self._q["delete_orphan_triggers"], left)
        done = structs(rows, Override)
        return await _settle(self, done)


async def _settle(store: RunQueries, done: list[Override]) -> list[Override]:
    """Resolve what the change lets move: the cleared tasks with upstreams by their trigger
    rules (their state as resolved is returned), the downstream tasks of the marked ones;
    wake the workers and the scheduler."""
    moved = [
        MovedTask(
            id=o.id, dag_run_id=o.dag_run_id, task_id=o.task_id, state=o.state, is_leaf=o.is_leaf
        )
        for o in done
    ]
    pending_runs = sorted({o.dag_run_id for o in done if o.state == "pending"})
    if pending_runs:
        try:
            resolved = await store.resolve_pending(pending_runs, None)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            # Committed already: the scheduler's backstop resolves them.
            log.warning("resolving cleared tasks failed (%s: %s)", type(exc).__name__, exc)
        else:
            moved += resolved
            now = {m.id: m.state for m in resolved}
            done = [msgspec.structs.replace(o, state=now.get(o.id, o.state)) for o in done]
    await settle(store, moved)
    return done
