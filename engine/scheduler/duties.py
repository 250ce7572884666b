"""The scheduler's housekeeping: what no single completion does, as a list of named periodic
duties run by one loop.

Each :class:`Duty` is a name, how often it is due and one coroutine. :data:`DUTIES` lists them
in the order a round runs them; :class:`DutyLoop` runs whichever are due whenever the
scheduling loop asks (once a pass), so a duty's interval is its own, not a timer kept by hand
beside the others:

* every pass interval (``scheduler_interval_s``): reap the task instances of dead workers (the
  contact rule: nothing is reaped while the scheduler cannot tell a dead worker from a
  database it could not reach, engine/scheduler/contact.py); free the triggers of triggerers
  whose lease expired; time out deferrals no triggerer ended (the backstop); resolve pending
  task instances no completion resolved (the backstop); start queued runs whose admission was
  missed (the backstop); the scheduler's own heartbeat (last of the round: a test can tell
  from it that a round ended);
* every half ``zombie_threshold_s``: free triggers no registered triggerer owns, drop triggers
  nobody waits on (the look reads every trigger: every pass was most of an idle database's
  CPU at 100,000 waiting);
* every ``LOG_RETENTION_EVERY_S``: delete log lines past ``log_retention_days``;
* every ``FLEET_INTERVAL_S``: the fleet gauges (tasks by state, unassigned triggers).

A duty returns how many things it changed. When a duty marked ``ends_runs`` changed something,
the scheduling loop makes its next pass at once, and that pass ends the runs that are done.
A duty that raises ends the round, which is run again whole at the next pass (the loop backs
off on database errors).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from engine.runtime import metrics as _metrics
from engine.scheduler.contact import Contact
from engine.scheduler.fleetmetrics import export_fleet as fleet_gauges
from engine.store import Store
from engine.store.downstream import resolve_all_pending, settle

__all__ = [
    "DUTIES",
    "FLEET_INTERVAL_S",
    "LOG_RETENTION_BATCH",
    "LOG_RETENTION_BATCHES",
    "LOG_RETENTION_EVERY_S",
    "Duty",
    "DutyLoop",
    "Housekeeper",
    "delete_old_logs",
    "export_fleet",
    "log_started",
]

log = logging.getLogger("engine.scheduler")  # the scheduler process's logger

#: How often the fleet gauges (tasks by state, unassigned triggers) are counted: counting
#: reads every task instance, too much for every pass.
FLEET_INTERVAL_S = 15.0
#: How often the scheduler deletes log lines past their retention, and how many rows of each
#: log table one statement deletes (a round stops after ``LOG_RETENTION_BATCHES`` of them and
#: goes on at the next: housekeeping is not held up).
LOG_RETENTION_EVERY_S = 60.0
LOG_RETENTION_BATCH = 1000
LOG_RETENTION_BATCHES = 20


class Housekeeper(Protocol):
    """What the duties read and keep of the scheduler that runs them."""

    store: Store
    contact: Contact
    metrics: _metrics.Metrics
    #: This scheduler's row in deferral_schedulers (kept by the heartbeat).
    id: int | None
    interval_s: float
    zombie_threshold_s: float
    timeout_backstop_grace_s: float
    log_retention_days: float

    @property
    def max_gap_s(self) -> float: ...


@dataclasses.dataclass(frozen=True)
class Duty:
    """One periodic duty of the scheduler."""

    name: str
    #: Seconds between two runs, read before each look (settings may change while the
    #: scheduler runs); ``math.inf``: off.
    every_s: Callable[[Housekeeper], float]
    #: The work; returns how many things it changed (and logs them itself).
    run: Callable[[Housekeeper], Awaitable[int]]
    #: What it changes may end DAG runs: the scheduler ends them without waiting for a pass.
    ends_runs: bool = False


# -- the duties ------------------------------------------------------------------------------


async def reap_zombies(h: Housekeeper) -> int:
    """Fail the tries whose worker stopped heartbeating (retries apply), counting silence only
    over the scheduler's current unbroken contact with the database."""
    if h.contact.broken:  # no contact since the last failure: nothing is reaped until there is
        return 0
    zombies = await h.store.reap_zombie_tasks(
        h.zombie_threshold_s,
        contact_since=h.contact.since,
        last_contact=h.contact.last,
        max_gap_s=h.max_gap_s,
    )
    await settle(h.store, zombies)
    for row in zombies:
        if row.state == "scheduled":
            # (a resume a fire handed to a worker that did not read it: given back, not failed)
            log.warning(
                "task instance %s: the worker a resume was handed to did not read it; "
                "runnable again for any worker",
                row.id,
            )
        else:
            log.warning("reaped task instance %s of a dead worker (now %s)", row.id, row.state)
    return len(zombies)


async def reap_triggerers(h: Housekeeper) -> int:
    """Free the triggers of triggerers whose lease expired."""
    await h.store.reap_triggerers()
    return 0


async def timeout_backstop(h: Housekeeper) -> int:
    """End the deferrals whose deadline passed while no triggerer was alive to do it."""
    late = await h.store.timeout_deferrals(None, grace_s=h.timeout_backstop_grace_s)
    await settle(h.store, late)
    for row in late:
        log.warning(
            "deferral of task instance %s (%s) on trigger %s (%s) timed out (no triggerer "
            "ended it; now %s)",
            row.id,
            row.task_id,
            row.trigger_id,
            row.classpath or "classpath unknown",
            row.state,
        )
    return len(late)


async def resolve_pending(h: Housekeeper) -> int:
    """Resolve the pending task instances that no completion resolved."""
    resolved = await resolve_all_pending(h.store)
    if resolved:
        log.info("resolved %d pending task instance(s)", resolved)
    return resolved


async def free_ownerless_triggers(h: Housekeeper) -> int:
    """Free the triggers owned by no registered triggerer."""
    ownerless = await h.store.release_ownerless_triggers()
    if ownerless:
        log.warning("freed %d trigger(s) owned by no registered triggerer", ownerless)
    return ownerless


async def drop_orphan_triggers(h: Housekeeper) -> int:
    """Drop the triggers nobody waits on, once older than ``zombie_threshold_s``."""
    orphans = await h.store.delete_orphan_triggers(h.zombie_threshold_s)
    if orphans:
        log.info("dropped %d trigger(s) nobody waits on", orphans)
    return orphans


async def sync_asset_watchers(h: Housekeeper) -> int:
    """Give each watcher of an asset an active, unpaused DAG is scheduled on a trigger row again
    if it lost it (a trigger cancelled from the status page, failed for blocking the loop),
    and stop the others (their DAGs paused since): the DAG scan does this too, at each
    scan."""
    done = await h.store.sync_watchers()
    if done.started or done.stopped:
        log.info("asset watchers: %d started, %d stopped", done.started, done.stopped)
    return done.started + done.stopped


async def delete_old_logs(h: Housekeeper) -> int:
    """Delete log lines older than ``log_retention_days``, in small batches (at most
    ``LOG_RETENTION_BATCHES`` of them a table); returns how many rows went."""
    deleted = await h.store.delete_old_logs(
        h.log_retention_days * 86400.0,
        batch=LOG_RETENTION_BATCH,
        max_batches=LOG_RETENTION_BATCHES,
    )
    if deleted:
        log.info("deleted %d log line(s) past log_retention_days", deleted)
    return deleted


async def start_queued_runs(h: Housekeeper) -> int:
    """Start the queued runs that max_active_runs admits: the backstop for runs whose
    admission was missed (a scheduler that stopped between ending a run and starting the
    next)."""
    started = await h.store.start_queued_runs()
    log_started(started)
    return len(started)


async def heartbeat(h: Housekeeper) -> int:
    """Keep the scheduler's row in deferral_schedulers (the status page's fleet)."""
    if h.id is not None:
        h.id = await h.store.heartbeat_scheduler(h.id)
    return 0


async def export_fleet(h: Housekeeper) -> int:
    """Set the fleet gauges: task instances by state, triggers no triggerer runs, the pools'
    slots, runs by DAG and state (engine/scheduler/fleetmetrics.py)."""
    await fleet_gauges(h.store, h.metrics)
    return 0


def log_started(runs: Sequence[Any]) -> None:
    for run in runs:
        log.info("DAG run %s/%s started (was queued)", run.dag_id, run.run_id)


def _each_pass(h: Housekeeper) -> float:
    return h.interval_s


def _half_zombie_threshold(h: Housekeeper) -> float:
    # Orphans are dropped once older than zombie_threshold_s; looking every half of that
    # keeps them at most 1.5 times as long.
    return h.zombie_threshold_s / 2


def _log_retention(h: Housekeeper) -> float:
    return LOG_RETENTION_EVERY_S if h.log_retention_days > 0 else math.inf


#: The scheduler's duties, in the order a round runs them.
DUTIES: tuple[Duty, ...] = (
    Duty("reap zombies", _each_pass, reap_zombies, ends_runs=True),
    Duty("reap triggerers", _each_pass, reap_triggerers),
    Duty("timeout backstop", _each_pass, timeout_backstop, ends_runs=True),
    Duty("resolve pending", _each_pass, resolve_pending, ends_runs=True),
    Duty("free ownerless triggers", _half_zombie_threshold, free_ownerless_triggers),
    Duty("drop orphan triggers", _half_zombie_threshold, drop_orphan_triggers),
    Duty("sync asset watchers", _half_zombie_threshold, sync_asset_watchers),
    Duty("log retention", _log_retention, delete_old_logs),
    Duty("start queued runs", _each_pass, start_queued_runs),
    Duty("heartbeat", _each_pass, heartbeat),
    Duty("fleet gauges", lambda h: FLEET_INTERVAL_S, export_fleet),
)


# -- the loop that runs them -----------------------------------------------------------------


class DutyLoop:
    """Runs whichever duties are due, in their order; remembers when each last ran (monotonic
    clock). Every duty is due at the first round."""

    def __init__(
        self, duties: Sequence[Duty] = DUTIES, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        names = [duty.name for duty in duties]
        if len(set(names)) != len(names):
            raise ValueError(f"duty names must be unique: {names}")
        self.duties = tuple(duties)
        self._clock = clock
        self._last: dict[str, float] = dict.fromkeys(names, -math.inf)
        #: Completed runs of each duty, by name (for tests and introspection).
        self.runs: Counter[str] = Counter()
        #: Rounds completed: rounds that ran at least one duty, every duty due, without an
        #: error.
        self.rounds = 0

    def _next_at(self, h: Housekeeper, duty: Duty) -> float:
        """When the duty is due next (``-inf``: now; ``inf``: never, it is off)."""
        every = duty.every_s(h)
        return math.inf if every == math.inf else self._last[duty.name] + every

    async def run_due(self, h: Housekeeper) -> tuple[list[str], bool]:
        """Run the duties due now; returns their names and whether one marked ``ends_runs``
        changed something. An error ends the round, and the whole round is due again (a round
        completed has run every duty that was due)."""
        now = self._clock()
        ran: list[str] = []
        ends_runs = False
        for duty in self.duties:
            if self._next_at(h, duty) > now:
                continue
            changed = await duty.run(h)
            self.runs[duty.name] += 1
            ran.append(duty.name)
            ends_runs = ends_runs or (duty.ends_runs and changed > 0)
        # Each interval counts from the end of the round that ran the duty: duties of one
        # interval stay in step, and a slow round is not followed at once by the next.
        ended = self._clock()
        for name in ran:
            self._last[name] = ended
        if ran:
            self.rounds += 1
        return ran, ends_runs

    def due_in(self, h: Housekeeper) -> float:
        """Seconds until the next duty is due (0: one is due now)."""
        next_at = min((self._next_at(h, duty) for duty in self.duties), default=math.inf)
        return max(0.0, next_at - self._clock())
