"""What other parts of the engine fill in on the status page. Each hook returns None when this
build has nothing to say; the page then leaves the field out (or says so).

HOOK (coordinator): ``why_not_running`` is wired to ``tasks why`` (branch i12-admit), and the
log hooks to the log store (branch i13-obs), when those land.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.store import Store
    from engine.store.models import TaskTry

__all__ = ["pools", "set_dag_paused", "task_log_lines", "trigger_log_lines", "why_not_running"]


async def why_not_running(store: Store, ti: TaskTry) -> str | None:
    """The "why not running" answer for a task instance (``deferral tasks why``).

    PLACEHOLDER: returns None until ``tasks why`` is wired here."""
    return None


async def task_log_lines(store: Store, ti: TaskTry) -> list[str] | None:
    """The log of a task try, oldest line first; None when no log is kept.

    PLACEHOLDER: returns None until the log store is wired here."""
    return None


async def trigger_log_lines(store: Store, trigger_id: int) -> list[str] | None:
    """What a trigger is logging right now (its latest lines); None when no log is kept.

    PLACEHOLDER: returns None until the log store is wired here."""
    return None


async def pools(store: Store) -> list[dict[str, object]] | None:
    """The pools, one dict each (name, slots, used, queued, ...: shown as columns in this
    order), or None when this build has no pools (the Pools page is then not offered).

    PLACEHOLDER: returns None until pools are wired here."""
    return None


async def set_dag_paused(store: Store, dag_id: str, paused: bool) -> bool | None:
    """Pause or unpause a DAG: True when done, False when no such DAG, None when this build
    cannot pause DAGs (the action is then not offered).

    PLACEHOLDER: returns None until schedules (and the paused flag) are wired here."""
    return None
