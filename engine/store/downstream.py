"""Moving downstream work on after a committed change: resolve the pending task instances
whose upstreams just finished (cascading), wake the workers when a task became runnable, and
the scheduler when a run may have nothing left to do.

The store's writes return what they moved and do nothing more; the code that wrote them
(worker, triggerer, scheduler) settles them here. Only named queries of the store run here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import asyncpg

from engine.states import TERMINAL_STATES
from engine.store.models import MovedTask
from engine.store.runs import RunQueries

__all__ = ["resolve_all_pending", "settle"]

log = logging.getLogger(__name__)


async def settle(store: RunQueries, moved: Sequence[MovedTask], *, woke: bool = False) -> None:
    """After task instances changed state (committed): resolve their downstreams, cascading,
    and signal workers and the scheduler. ``woke``: the statement that moved them already
    woke the workers.

    Best effort: the change is committed, so an error here must not make the caller write it
    again (it would find nothing to change and report the tries lost). What is left, and what
    a process that dies here leaves, the scheduler's backstop resolves."""
    if not moved:
        return
    try:
        await _resolve_and_signal(store, moved, woke)
    except (
        OSError,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        asyncpg.InternalClientError,  # a connection killed mid-operation
    ) as exc:
        log.warning(
            "resolving downstream tasks after a committed change failed (%s: %s); the "
            "scheduler's backstop will",
            type(exc).__name__,
            exc,
        )


async def resolve_all_pending(store: RunQueries) -> int:
    """The scheduler's backstop: resolve every run that still has pending task instances (and
    settle what that moved); returns how many moved first."""
    run_ids = await store.runs_with_pending()
    if not run_ids:
        return 0
    moved = await store.resolve_pending(run_ids, None)
    await settle(store, moved)
    return len(moved)


async def _resolve_and_signal(store: RunQueries, rows: Sequence[MovedTask], woke: bool) -> None:
    runnable = False
    leaf_runs: set[int] = set()
    first = True
    while rows:
        runs: set[int] = set()
        finished: set[str] = set()
        for row in rows:
            state = row.state
            if state == "scheduled":
                runnable = runnable or not (first and woke)
            elif state in TERMINAL_STATES:
                if row.is_leaf:
                    leaf_runs.add(row.dag_run_id)
                else:
                    runs.add(row.dag_run_id)
                    finished.add(row.task_id)
        if not runs:
            break
        first = False
        rows = await store.resolve_pending(sorted(runs), sorted(finished))
    if runnable:
        await store.wake_workers()
    if leaf_runs:
        await store.notify_finished_runs(sorted(leaf_runs))
