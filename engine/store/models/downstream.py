"""The task instances a committed write moved (finish_tasks, fire_triggers, timeout_deferrals,
reap_zombie_tasks, resolve_pending, ...): the caller settles them with
:func:`engine.store.downstream.settle`."""

from __future__ import annotations

import msgspec

__all__ = [
    "FinishedTask",
    "FiredTriggers",
    "MovedTask",
    "TimedOutTask",
]


class MovedTask(msgspec.Struct, frozen=True, kw_only=True):
    """A task instance a committed write moved to ``state`` (resolve_pending, reap_zombie_tasks,
    fire_triggers)."""

    id: int
    dag_run_id: int
    task_id: str
    state: str
    is_leaf: bool


class FinishedTask(MovedTask, frozen=True, kw_only=True):
    """A try finish_tasks ended, with the worker that ran it; or (``worker_id`` None) a task
    that a branching try's success skipped in the same statement."""

    worker_id: int | None


class TimedOutTask(MovedTask, frozen=True, kw_only=True):
    """A deferral timeout_deferrals ended, with the trigger it waited on (its classpath: None
    when the trigger row was gone already)."""

    trigger_id: int | None
    classpath: str | None = None


class FiredTriggers(msgspec.Struct, frozen=True, kw_only=True):
    """What fire_triggers wrote: the triggers whose outcome was accepted (the others were
    refused by the fencing check), the task instances that moved, and whether the statement
    already woke the workers."""

    accepted: frozenset[int]
    moved: list[MovedTask]
    woke: bool
