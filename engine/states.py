"""Task instance states, the outcome kinds that move them, and every transition, in one place.

``docs/explanation/states.md`` draws the transition table (``tests/test_docs.py`` keeps the two
equal). The SQL names the same sets: the ``state`` column's CHECK constraint lists the states,
the domains ``deferral_task_outcome`` and ``deferral_trigger_outcome`` the outcome kinds, and
the ``deadline_kind`` column's CHECK constraint the deadlines (``tests/test_state_machine.py``
compares them with these, and the literals ``queries.sql`` uses with them).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "DEADLINE_KINDS",
    "RUN_STATES",
    "STATES",
    "TASK_OUTCOME_KINDS",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "TRIGGER_OUTCOME_KINDS",
    "TRY_OUTCOME_STATES",
    "DeadlineKind",
    "RunState",
    "TaskOutcomeKind",
    "TaskState",
    "TriggerOutcomeKind",
]

TaskState = Literal[
    "pending",
    "scheduled",
    "queued",
    "running",
    "deferred",
    "up_for_reschedule",
    "up_for_retry",
    "success",
    "failed",
    "skipped",
    "upstream_failed",
]
STATES: frozenset[TaskState] = frozenset(get_args(TaskState))

#: How a worker ends a running try (``failed``: the retry policy decides up_for_retry/failed).
TaskOutcomeKind = Literal["success", "skipped", "failed"]
TASK_OUTCOME_KINDS: frozenset[TaskOutcomeKind] = frozenset(get_args(TaskOutcomeKind))

#: How a trigger ends a deferral: ``event`` resumes the task on a worker, the others end it
#: (``failed``: the retry policy applies).
TriggerOutcomeKind = Literal["event", "success", "skipped", "failed"]
TRIGGER_OUTCOME_KINDS: frozenset[TriggerOutcomeKind] = frozenset(get_args(TriggerOutcomeKind))

#: Which deadline bounds a deferral (the earliest, chosen when the task defers): the trigger's
#: ``defer(timeout=)``, the task's ``execution_timeout`` (counted from the start of the try) or,
#: for a sensor, its ``timeout`` (counted from the first try). A timeout error names it.
DeadlineKind = Literal["trigger_timeout", "execution_timeout", "sensor_timeout"]
DEADLINE_KINDS: frozenset[DeadlineKind] = frozenset(get_args(DeadlineKind))

#: The states of a DAG run (the ``deferral_dag_runs.state`` CHECK constraint lists them).
RunState = Literal["queued", "running", "success", "failed"]
RUN_STATES: frozenset[RunState] = frozenset(get_args(RunState))

TERMINAL_STATES: frozenset[TaskState] = frozenset(
    {"success", "failed", "skipped", "upstream_failed"}
)

#: The states a try ends in: each try of a task instance reaches one of these at most once.
TRY_OUTCOME_STATES: frozenset[TaskState] = frozenset(
    {"success", "failed", "skipped", "up_for_retry"}
)

#: (from, to) -> what makes the move.
TRANSITIONS: dict[tuple[TaskState, TaskState], str] = {
    ("pending", "scheduled"): "upstreams satisfy the trigger rule",
    (
        "pending",
        "skipped",
    ): "trigger rule can no longer be met (skipped upstreams), or a branch skipped it",
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
    ("deferred", "skipped"): "TaskSkippedEvent, or a soft_fail sensor timeout",
    ("deferred", "failed"): "trigger error or a deadline, no retries left; TaskFailedEvent",
    ("deferred", "up_for_retry"): "trigger error or a deadline with retries left",
}
