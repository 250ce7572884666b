"""Task instance states and every transition between them, in one place.

``docs/explanation/states.md`` draws this table (``tests/test_docs.py`` keeps the two equal).
"""

from __future__ import annotations

__all__ = ["TERMINAL_STATES", "TRANSITIONS"]


TERMINAL_STATES = frozenset({"success", "failed", "skipped", "upstream_failed"})

#: (from, to) -> what makes the move.
TRANSITIONS: dict[tuple[str, str], str] = {
    ("pending", "scheduled"): "upstreams satisfy the trigger rule",
    ("pending", "skipped"): "trigger rule can no longer be met (skipped upstreams)",
    ("pending", "upstream_failed"): "trigger rule can no longer be met (failed upstreams)",
    ("scheduled", "queued"): "pool admission (reserved)",
    ("queued", "running"): "a worker claims it (reserved)",
    ("scheduled", "running"): "a worker claims it (FOR UPDATE SKIP LOCKED)",
    ("up_for_retry", "running"): "a worker claims it at run_after (the new try)",
    ("up_for_reschedule", "running"): "a worker claims it at run_after (the next check)",
    ("running", "success"): "execute() or the resumed method returned",
    ("running", "failed"): "an error with no retries left, or FailTask",
    ("running", "up_for_retry"): "an error with retries left",
    ("running", "skipped"): "SkipTask, or a sensor's soft_fail timeout",
    ("running", "deferred"): "defer(): trigger stored, slot freed, one transaction",
    ("running", "up_for_reschedule"): "a reschedule-mode sensor's check was false",
    ("deferred", "scheduled"): "the trigger fired; resume at method_name with the payload",
    ("deferred", "success"): "the trigger yielded TaskSuccessEvent",
    ("deferred", "skipped"): "TaskSkippedEvent, or a soft_fail deferral timeout",
    ("deferred", "failed"): "trigger error or timeout, no retries left; TaskFailedEvent",
    ("deferred", "up_for_retry"): "trigger error or timeout with retries left",
}
