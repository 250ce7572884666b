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
  what, from where.

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
from engine.store.core import structs
from engine.store.downstream import settle
from engine.store.models import MovedTask, Override
from engine.store.runs import RunQueries

__all__ = ["MARK_STATES", "VIA_PAGE", "OverrideQueries"]

log = logging.getLogger(__name__)

#: The states a task instance can be marked with.
MARK_STATES: frozenset[str] = frozenset(get_args(TaskOutcomeKind))

#: How the status page names itself in the audit rows, the errors and the log lines.
VIA_PAGE = "the status page"


class OverrideQueries(RunQueries):
    """The statements that mark and clear task instances (they settle what they moved, with
    the runs reader's statements)."""

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
        counted afresh; a running try is stopped first (the new one waits for it)."""
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
        async with self._pool.acquire() as conn, conn.transaction():
            # The triggers first, as a firing trigger locks them before its waiters.
            left = [r["id"] for r in await conn.fetch(self._q["lock_left_triggers"], ids)]
            rows = await conn.fetch(self._q[query], ids, *args)
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
