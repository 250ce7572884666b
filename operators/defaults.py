"""The constants of the operator contract: defaults and bounds that the runtime and the store
need as well (the store imports these, never :mod:`operators.base`). Imports nothing.
``operators.base`` re-exports them, so a DAG file may import them from there."""

from __future__ import annotations

__all__ = [
    "DEFAULT_POOL",
    "DEFAULT_QUEUE",
    "DEFAULT_RETRY_DELAY_S",
    "INT32_MAX",
    "ISOLATION_MODES",
    "MAX_WAIT_S",
    "TRIGGER_RULES",
    "WEIGHT_RULES",
]

TRIGGER_RULES = frozenset(
    {
        "all_success",
        "all_failed",
        "all_done",
        "all_skipped",
        "one_success",
        "one_failed",
        "one_done",
        "none_failed",
        "none_failed_min_one_success",
        "none_skipped",
        "always",
    }
)

DEFAULT_RETRY_DELAY_S = 300.0

#: The longest wait a task may ask for, in seconds (ten years): the largest ``defer(timeout=)``
#: and the furthest a reschedule may lie ahead. Deadlines are stored as database timestamps;
#: beyond a bound like this one (or for nan and infinity) the database refuses to make one.
MAX_WAIT_S = 10 * 365 * 24 * 3600.0
#: Where ``execute`` runs: "none", in the worker process (a ``def`` in a worker thread, an
#: ``async def`` on its loop); "process", in a child process (``engine.worker.isolation``) that the
#: execution_timeout can stop, at the cost of starting one per call.
ISOLATION_MODES = ("none", "process")
#: The pool of a task that names none; it exists from the start (128 slots).
DEFAULT_POOL = "default_pool"
#: The queue of tasks and triggers that name none, and of workers and triggerers by default.
DEFAULT_QUEUE = "default"
#: How a task's priority is computed from ``priority_weight``s.
WEIGHT_RULES = ("downstream", "upstream", "absolute")

#: The database stores these counts and weights as 32-bit integers.
INT32_MAX = 2**31 - 1
