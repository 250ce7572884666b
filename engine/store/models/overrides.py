"""What a mark or a clear changed (engine/store/overrides.py)."""

from __future__ import annotations

import msgspec

__all__ = [
    "Override",
    "OverrideTarget",
    "RunOverride",
]


class Override(msgspec.Struct, frozen=True, kw_only=True):
    """A task instance a mark or a clear changed."""

    id: int
    dag_run_id: int
    dag_id: str
    run_id: str
    task_id: str
    #: Its state after (a cleared task with upstreams: as its trigger rule resolved it,
    #: ``pending`` while its upstreams have not ended).
    state: str
    #: Its state before.
    was: str
    #: Its latest try then (a cleared task's next try is this plus one).
    try_number: int
    is_leaf: bool
    #: The worker told to stop the try that was running (None: no try was running).
    stopping_worker_id: int | None
    #: The trigger it was waiting on and left (None: it was not deferred).
    left_trigger_id: int | None
    #: Which instance of a mapped task (-1: not mapped).
    map_index: int = -1


class OverrideTarget(msgspec.Struct, frozen=True, kw_only=True):
    """A task instance a clear or a mark would change (``override_targets``), as it is now."""

    id: int
    dag_id: str
    run_id: str
    task_id: str
    state: str
    try_number: int
    #: Which instance of a mapped task (-1: not mapped).
    map_index: int = -1
    #: Why it is in: ``task`` (named), ``downstream`` or ``upstream`` (of a named one).
    relation: str


class RunOverride(msgspec.Struct, frozen=True, kw_only=True):
    """A run marked as a whole (``mark_run``): its state before and after, and the task
    instances the mark changed."""

    dag_id: str
    run_id: str
    was: str
    state: str
    tasks: list[Override]
