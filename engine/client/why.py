""" "Why is this task not running?": the one answer ``deferral tasks why``, ``waiting_reason`` in
``tasks list --json`` and the status page's task try page give.

The answer is the first reason that holds, in this order: upstream tasks not done; the run not
started (queued behind max_active_runs); an earlier try told to stop (a mark or a clear) that
has not stopped yet; the pool (missing, too small for the task's
pool_slots, or full); the DAG at max_active_tasks; the task at max_active_tis_per_dag; the
global parallelism; no live worker serving the task's queue; a retry (or reschedule) not due
yet; for a deferred task, its trigger, or that no triggerer takes the trigger (none alive for
its trigger queue, or all at capacity). A runnable task none of these explain waits for a free
worker slot. Each answer starts with a short label (``pool full:``, ``retry not due:``, ...)
that says which reason it is; the rest says what to look at.

The facts come from the store in one read-only statement for any number of task instances
(engine/store/why.py); the limits that are worker settings (``parallelism``) and when a worker
counts as gone (``zombie_threshold_s``) come from this process's settings.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.states import TERMINAL_STATES

if TYPE_CHECKING:
    from engine.config import Settings
    from engine.store import Store
    from engine.store.models import RunWait, TaskWait

__all__ = [
    "LISTED_UPSTREAM",
    "WAITING_STATES",
    "NoSuchTask",
    "explain_run",
    "explain_task",
    "waiting_reason",
    "waiting_reasons",
    "why_not_running",
]

#: Upstream tasks an answer names; the others are counted by state.
LISTED_UPSTREAM = 10

#: The states of a task instance that waits for something (the others run or have ended).
WAITING_STATES = frozenset(
    {"pending", "scheduled", "queued", "up_for_retry", "up_for_reschedule", "deferred"}
)
#: The states a worker claims from, once due and admitted.
_CLAIMABLE = frozenset({"scheduled", "queued", "up_for_retry", "up_for_reschedule"})


class NoSuchTask(LookupError):
    """No such run, or the run has no such task."""


# -- wording ----------------------------------------------------------------------------------


def _span(seconds: float) -> str:
    seconds = abs(seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    return f"{hours // 24}d{hours % 24:02d}h"


def _when(at: dt.datetime, now: dt.datetime) -> str:
    """A time in UTC to the second, and how far from now (``in 4m10s``, ``5s ago``)."""
    stamp = at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    left = (at - now).total_seconds()
    return f"{stamp} ({'in ' + _span(left) if left >= 0 else _span(left) + ' ago'})"


def _last_seen(at: dt.datetime | None, now: dt.datetime) -> str:
    return "never seen" if at is None else f"last seen {_when(at, now)}"


# -- the reasons, in order --------------------------------------------------------------------


def _listed(ids: list[str], states: dict[str, str]) -> str:
    """Tasks with their states, the first LISTED_UPSTREAM of them, the others counted by
    state (a join of 5,000 tasks is one line, not 5,000 names)."""
    shown = ", ".join(f"{u} ({states.get(u, 'not created')})" for u in ids[:LISTED_UPSTREAM])
    rest = Counter(states.get(u, "not created") for u in ids[LISTED_UPSTREAM:])
    if not rest:
        return shown
    counted = ", ".join(f"{n} {state}" for state, n in sorted(rest.items()))
    return f"{shown} and {len(ids) - LISTED_UPSTREAM} more ({counted})"


def _upstream(w: TaskWait) -> str:
    states = w.upstream_states or {}
    waiting = [u for u in w.upstream if states.get(u) not in TERMINAL_STATES]
    if waiting:
        return f"upstream not done: waiting for {_listed(waiting, states)}"
    done = _listed([u for u in w.upstream if u in states], states)
    return (
        f"upstream done ({done or 'none'}): waiting for the scheduler to apply the trigger "
        f"rule {w.trigger_rule}"
    )


def _pool(w: TaskWait) -> str | None:
    if not w.pool_exists or w.pool_total is None:
        return (
            f"pool missing: pool {w.pool!r} does not exist, so the task cannot run (a worker "
            f"that claims it fails it): create it (deferral pools set {w.pool} --slots N) or "
            "set the task's pool to one deferral pools list shows"
        )
    if w.pool_slots > w.pool_total:
        return (
            f"pool too small: the task needs {w.pool_slots} slots of pool {w.pool!r}, which "
            f"has {w.pool_total}: it can never run (deferral pools set {w.pool} --slots "
            f"{w.pool_slots}, or lower the task's pool_slots)"
        )
    counted = w.pool_deferred if w.include_deferred else 0
    used = w.pool_running + counted
    if w.pool_slots <= w.pool_total - used:
        return None
    held = f"{w.pool_running} by running tasks"
    if counted:
        held += f", {counted} by deferred tasks, which the pool counts: include_deferred"
    return (
        f"pool full: pool {w.pool!r} has {used}/{w.pool_total} slots in use ({held}); the "
        f"task needs {w.pool_slots}"
    )


def _limits(w: TaskWait, parallelism: int) -> str | None:
    if w.max_active_tasks is not None and w.dag_running >= w.max_active_tasks:
        return (
            f"DAG at max_active_tasks: DAG {w.dag_id!r} runs "
            f"{w.dag_running}/{w.max_active_tasks} tasks"
        )
    if w.max_active_tis_per_dag is not None and w.task_running >= w.max_active_tis_per_dag:
        return (
            f"task at max_active_tis_per_dag: {w.task_running}/{w.max_active_tis_per_dag} "
            f"tries of task {w.task_id!r} run across the DAG's runs"
        )
    if parallelism > 0 and w.fleet_running >= parallelism:
        return (
            f"global parallelism reached: {w.fleet_running}/{parallelism} tasks run across "
            "all workers (setting parallelism)"
        )
    return None


def _no_worker(w: TaskWait) -> str | None:
    if w.live_workers:
        return None
    return (
        f"no worker serves queue {w.queue!r}: no live worker takes it (deferral worker "
        f"--queues {w.queue}); a worker serving it was {_last_seen(w.worker_last_seen, w.db_now)}"
    )


def _not_due(w: TaskWait) -> str | None:
    if w.run_after <= w.db_now:
        return None
    when = _when(w.run_after, w.db_now)
    if w.state == "up_for_retry":
        return f"retry not due: try {w.try_number + 1} of {w.retries + 1} runs at {when}"
    if w.state == "up_for_reschedule":
        return f"next check not due: the sensor checks again at {when}"
    return f"not due: runnable at {when}"


def _deferred(w: TaskWait) -> str:
    if w.trigger_id is None or not w.trigger_found:
        return (
            f"deferred: its trigger {w.trigger_id} has just fired (or gone): the task "
            "resumes (or ends) shortly"
        )
    since = _when(w.trigger_created_at, w.db_now) if w.trigger_created_at else "-"
    if w.trigger_timeout_at is None:
        deadline = "no deadline"
    else:
        kind = f"{w.deadline_kind} " if w.deadline_kind else ""
        deadline = f"next deadline: {kind}at {_when(w.trigger_timeout_at, w.db_now)}"
    what = f"trigger {w.trigger_id} ({w.trigger_classpath})"
    wait = f"waiting since {since}, {deadline}"
    if w.triggerer_id is not None:
        return (
            f"deferred on {what}: held by triggerer {w.triggerer_id} on "
            f"{w.triggerer_hostname} [{w.triggerer_pid}]; {wait}"
        )
    queue = f"trigger queue {w.trigger_queue!r}"
    if not w.live_triggerers:
        return (
            f"trigger unassigned: {what} waits for a triggerer, and no live triggerer serves "
            f"{queue} (deferral triggerer --queues {w.trigger_queue}); one serving it was "
            f"{_last_seen(w.triggerer_last_seen, w.db_now)}; {wait}"
        )
    if not w.triggerers_with_room:
        full = (
            f"the one live triggerer of {queue} is at capacity"
            if w.live_triggerers == 1
            else f"all {w.live_triggerers} live triggerers of {queue} are at capacity"
        )
        return f"trigger unassigned: {what} waits for a triggerer, and {full}; {wait}"
    return (
        f"deferred on {what}: held by no triggerer yet (a live triggerer of {queue} with room "
        f"claims it; {w.triggerers_with_room} of {w.live_triggerers} have room); {wait}"
    )


def _stopping(w: TaskWait) -> str | None:
    if w.stopping_try is None:
        return None
    since = _when(w.stopping_since, w.db_now) if w.stopping_since else "-"
    return (
        f"stopping: try {w.stopping_try} was told to stop ({w.stopping_reason}) at {since} and "
        f"still runs on worker {w.stopping_worker_id}; the next try starts once it has stopped "
        "(a def task's thread cannot be stopped: it ends when its code returns)"
    )


def _not_waiting(w: TaskWait) -> str:
    if w.state == "running":
        where = (
            f"worker {w.worker_id} on {w.worker_hostname} [{w.worker_pid}]"
            if w.worker_hostname is not None
            else f"worker {w.worker_id}"
        )
        since = _when(w.try_started_at, w.db_now) if w.try_started_at else "-"
        return f"running: try {w.try_number} on {where}, since {since}"
    ended = f"ended at {_when(w.ended_at, w.db_now)}" if w.ended_at else "ended"
    if w.stopping_try is not None:
        ended += f" (try {w.stopping_try} still stopping on worker {w.stopping_worker_id})"
    if w.state == "failed" and w.error:
        lines = [line.strip() for line in w.error.strip().splitlines() if line.strip()]
        return f"failed: {ended}: {lines[-1]}" if lines else f"failed: {ended}"
    if w.state == "upstream_failed":
        return f"upstream_failed: {ended}: an upstream task failed, so it does not run"
    return f"{w.state}: {ended}"


def explain_task(w: TaskWait, *, parallelism: int) -> str:
    """Why this task instance is not running (or, when it runs or has ended, its state)."""
    if w.state == "pending":
        return _upstream(w)
    if w.state == "deferred":
        return _deferred(w)
    if w.state not in _CLAIMABLE:
        return _not_waiting(w)
    for reason in (_stopping(w), _pool(w), _limits(w, parallelism), _no_worker(w), _not_due(w)):
        if reason is not None:
            return reason
    return (
        f"runnable: waiting for a free worker slot (live workers serving queue {w.queue!r}: "
        f"{w.live_workers})"
    )


def waiting_reason(w: TaskWait, *, parallelism: int) -> str | None:
    """The answer for a task instance that waits; None for one that runs or has ended."""
    return explain_task(w, parallelism=parallelism) if w.state in WAITING_STATES else None


def explain_run(run: RunWait, task_id: str) -> str:
    """Why a task of a run that has no task instance yet is not running: the run has not
    started. Raises NoSuchTask when the run has no such task."""
    if not run.has_task or run.state != "queued":
        raise NoSuchTask(
            f"run {run.run_id!r} of DAG {run.dag_id!r} has no task {task_id!r} (TASK)"
            + ("" if run.has_task else ": the DAG has no task of that id")
        )
    if run.run_type == "backfill":
        return (
            f"run not started: backfill run {run.run_id!r} is queued: the scheduler starts it "
            "at its next pass"
        )
    limit = run.max_active_runs
    ahead = f", {run.queued_before} queued before it" if run.queued_before else ""
    if limit is not None and run.active_runs >= limit:
        return (
            f"run not started: run {run.run_id!r} is queued behind max_active_runs: "
            f"{run.active_runs}/{limit} runs of DAG {run.dag_id!r} run{ahead}"
        )
    return (
        f"run not started: run {run.run_id!r} is queued and max_active_runs has room "
        f"({run.active_runs}/{limit} runs of DAG {run.dag_id!r} run{ahead}): a scheduler "
        "starts it at its next pass"
    )


# -- with the store ---------------------------------------------------------------------------


async def waiting_reasons(
    store: Store, ti_ids: Sequence[int], settings: Settings
) -> dict[int, str]:
    """The answer for each of these task instances that waits (by id), in one statement."""
    waits = await store.why_tasks(ti_ids, worker_stale_s=settings.zombie_threshold_s)
    reasons = {w.id: waiting_reason(w, parallelism=settings.parallelism) for w in waits}
    return {ti_id: reason for ti_id, reason in reasons.items() if reason is not None}


async def why_not_running(
    store: Store,
    dag_id: str,
    run_id: str,
    task_id: str,
    settings: Settings,
    *,
    map_index: int = -1,
) -> str:
    """The answer of ``deferral tasks why``: why the task instance (``map_index``: of a mapped
    task) is not running, or its state when it runs or has ended. Raises NoSuchTask when
    there is no such run or task."""
    found = await store.why_task(
        dag_id, run_id, task_id, worker_stale_s=settings.zombie_threshold_s, map_index=map_index
    )
    if found is None:
        raise NoSuchTask(f"DAG {dag_id!r} (DAG) has no run {run_id!r} (RUN)")
    if found.task is None:
        return explain_run(found.run, task_id)
    return explain_task(found.task, parallelism=settings.parallelism)
