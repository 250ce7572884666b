"""What a mark or a clear changed (engine/store/overrides.py)."""

from __future__ import annotations

import msgspec

__all__ = [
    "Override",
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
