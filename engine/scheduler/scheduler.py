"""The scheduler process: creates runs from schedules, ends runs, and keeps the house.

Three tasks in one task group:

* the scheduling loop (:meth:`Scheduler._schedule`): each pass ends the DAG runs whose tasks
  are all finished (woken when a leaf task finishes) and starts the queued runs their end
  admits, creates the runs of scheduled DAGs when their data interval ends
  (:mod:`engine.scheduler.dagruns`: one indexed look for due DAGs, woken at the earliest due
  time), then runs the housekeeping duties that are due (:mod:`engine.scheduler.duties`:
  zombies, backstops, triggers nobody runs or waits on, log retention, fleet gauges, the
  scheduler's heartbeat);
* the DAG scan (:class:`engine.scheduler.dagsync.DagScan`), beside the loop: records the DAGs
  of its DAGs folder in the store, so ``dags trigger`` finds them, every
  ``dag_rescan_interval_s`` and at once when asked
  (:func:`engine.scheduler.dagsync.request_rescan`). No pass waits for the folder: runs are
  created, started and ended meanwhile, and readiness holds;
* the contact probe (:meth:`Scheduler._keep_contact`): ``SELECT now()`` every second or so, to
  know when the scheduler could reach the database (engine/scheduler/contact.py): heartbeats
  missed while the database hung are not a worker's silence.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import time
from typing import Any

import anyio
from anyio.abc import TaskStatus

from engine.dags.dagbag import DagBag
from engine.runtime import metrics as _metrics
from engine.runtime.health import Check, freshness
from engine.runtime.overrides import overridden
from engine.runtime.retry import TRANSIENT_ERRORS, Backoff, with_db_retry
from engine.runtime.wakeup import Wakeup
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.contact import Contact, max_gap_s, probe_interval_s
from engine.scheduler.dagrecord import DagRecorder
from engine.scheduler.dagruns import create_due_runs
from engine.scheduler.dagsync import CHANNEL_DAG_RESCAN, DagScan
from engine.scheduler.duties import DutyLoop, log_started
from engine.scheduler.fleetmetrics import observe_ended_runs
from engine.store import CHANNEL_ASSETS, CHANNEL_FINISHED, Listener, Store

__all__ = ["MIN_WAIT_S", "Scheduler"]

log = logging.getLogger("engine.scheduler")  # the process's logger: its package's name

#: The shortest wait between passes when a scheduled run is due (another scheduler may be
#: creating it right now).
MIN_WAIT_S = 0.01
#: How long one attempt to register may hold up a stop (it is shielded from it, as a rollback
#: is: Scheduler._register).
REGISTER_S = 5.0


class Scheduler:
    #: ``stop()`` cancels the work in flight rather than letting it finish (the process runner
    #: logs so: engine.runtime.runner.stops_at_once).
    stops_at_once = True

    def __init__(
        self,
        store: Store,
        dagbag: DagBag | None = None,
        config: SchedulerConfig | None = None,
        *,
        metrics: _metrics.Metrics | None = None,
        **overrides: Any,
    ) -> None:
        """``config``: how it runs (:class:`SchedulerConfig`, its defaults when None); keyword
        arguments named like its fields override them (``Scheduler(store, None,
        interval_s=0.1)``), any other name is a TypeError. ``dagbag``: its DAGs folder (None:
        no folder to scan)."""
        self.config = config = overridden(
            SchedulerConfig() if config is None else config, overrides, "Scheduler"
        )
        self.store = store
        self.dagbag = dagbag
        #: Seconds between two passes at most, and between two rounds of the duties run every
        #: pass (setting ``scheduler_interval_s``).
        self.interval_s = config.interval_s
        self.zombie_threshold_s = config.zombie_threshold_s
        self.timeout_backstop_grace_s = config.timeout_backstop_grace_s
        #: Seconds between two scans of the DAGs folder (setting ``dag_rescan_interval_s``).
        self.dag_rescan_interval_s = config.dag_rescan_interval_s
        #: Setting ``log_retention_days`` (0: log lines are kept forever).
        self.log_retention_days = config.log_retention_days
        self.metrics = metrics if metrics is not None else _metrics.current()
        #: When this scheduler could reach the database (engine/scheduler/contact.py): heartbeats
        #: are counted as missed only over its current unbroken contact.
        self.contact = Contact()
        #: Records the DAGs of the folder, remembering what it serialized.
        self.recorder = DagRecorder(store)
        #: The scan of the DAGs folder, beside the scheduling loop (None: no folder).
        self.dag_scan = (
            None
            if dagbag is None
            else DagScan(store, dagbag, self.recorder, interval_s=config.dag_rescan_interval_s)
        )
        #: The housekeeping (engine/scheduler/duties.py), run by the scheduling loop.
        self.duties = DutyLoop()
        #: Scheduled runs this scheduler created.
        self.runs_created = 0
        #: This scheduler's row in deferral_schedulers (the status page's fleet), kept by the
        #: heartbeat duty.
        self.id: int | None = None
        #: When the last pass of the loop completed (monotonic clock; readiness).
        self.pass_at: float | None = None
        self._wake = Wakeup()
        self._stopping = False
        #: What ``stop()`` cancels: everything ``run`` does but its clean-up (made by ``run``).
        self._scope: anyio.CancelScope | None = None

    @property
    def contact_since(self) -> dt.datetime | None:
        """Database time at which the scheduler's current unbroken contact with the database
        began (None: none yet). Heartbeats are not counted as missed before then."""
        return self.contact.since

    @property
    def max_gap_s(self) -> float:
        """The longest gap between two contacts that counts as unbroken contact (half of
        ``zombie_threshold_s``)."""
        return max_gap_s(self.zombie_threshold_s)

    @property
    def housekeeping_passes(self) -> int:
        """Rounds of housekeeping duties completed (for tests and introspection)."""
        return self.duties.rounds

    @property
    def dag_scans(self) -> int:
        """Scans of the DAGs folder completed (for tests and introspection)."""
        return 0 if self.dag_scan is None else self.dag_scan.scans

    def stop(self) -> None:
        """Stop now: the pass in flight, the DAG scan and the contact probe are cancelled.
        A scheduler holds no work that a graceful stop would let finish: each write of a pass
        is a transaction of its own, and what a cut pass leaves undone the next pass (of this
        scheduler or another) does. Waiting for the pass instead made a SIGTERM look ignored
        for as long as a statement can wait (a lock, a hung or overloaded database: up to
        the connection's command timeout, a minute). Safe before ``run`` (which then returns
        at once) and more than once; a stopped scheduler stays stopped."""
        self._stopping = True
        self._wake.set()
        if self.dag_scan is not None:
            self.dag_scan.stop()
        if self._scope is not None:
            self._scope.cancel()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # (``_stopping`` is not reset here: a stop() that came before run() must hold.)
        if self._stopping:
            task_status.started()
            return
        channels = [CHANNEL_FINISHED, CHANNEL_ASSETS]
        if self.dag_scan is not None:
            channels.append(CHANNEL_DAG_RESCAN)
        listener = self.store.listener(*channels)
        listener.on_notify(self._on_notify)
        started = False
        self._scope = anyio.CancelScope()
        try:
            with self._scope:
                # Listening before the first scan: a rescan asked for once that scan is
                # logged is seen.
                await self._listen(listener)
                await with_db_retry("register the scheduler", self._register)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._keep_contact, name="scheduler-contact")
                    if self.dag_scan is not None:
                        tg.start_soon(self.dag_scan.run, name="scheduler-dag-scan")
                    task_status.started()
                    started = True
                    await self._schedule(listener)
                    tg.cancel_scope.cancel()
        finally:
            with anyio.move_on_after(5, shield=True):
                await listener.close()
                if self.id is not None:
                    with contextlib.suppress(*TRANSIENT_ERRORS):
                        await self.store.unregister_scheduler(self.id)
        if not started:  # stopped before it registered
            task_status.started()

    async def _register(self) -> None:
        """One attempt at the scheduler's row, shielded from ``stop()`` for up to
        ``REGISTER_S``: a stop that cut the attempt short could let its INSERT commit with
        its id never known here, and the row, never unregistered, would stay on the status
        page for an hour (until the heartbeat duty drops it). Shielded, the id is kept and
        ``run`` unregisters it. An attempt still unanswered after ``REGISTER_S`` is given up
        as a timeout (tried again, unless the scheduler is stopping)."""
        with anyio.move_on_after(REGISTER_S, shield=True):
            self.id = await self.store.register_scheduler()
            return
        raise TimeoutError(f"no answer within {REGISTER_S:g} s")

    async def _schedule(self, listener: Listener) -> None:
        """The scheduling loop: passes until stopped. No pass waits for the DAGs folder."""
        backoff = Backoff()
        failed = False
        while not self._stopping:
            try:
                if failed or self.contact.broken:
                    # Silence counts from here: this loop could not do its work until now.
                    self.contact.restart(await self.store.now())
                    failed = False
                await self.finish_runs()
                await self.create_runs()
                ran, ends_runs = await self.duties.run_due(self)
                if ends_runs:
                    self._wake.set()  # the next pass, at once, ends the runs now done
                if ran:
                    await self._listen(listener)
                # Inside the try: the query that finds the next due run can lose its
                # connection as any other (it once took the scheduler down).
                wait_s = await self._until_next_pass()
            except TRANSIENT_ERRORS as exc:
                # The workers may have lost the database too: their heartbeats are counted
                # again only from when contact is back.
                self.contact.lost()
                failed = True
                await backoff.wait("scheduler pass", exc)
                continue
            backoff.reset()
            self.pass_at = time.monotonic()
            await self._wake.wait(wait_s)

    async def _keep_contact(self) -> None:
        """Probe the database every :func:`engine.scheduler.contact.probe_interval_s`: each answer
        is a contact at the database time its statement started."""
        while not self._stopping:
            try:
                at = await self.store.now()
            except TRANSIENT_ERRORS:
                self.contact.lost()  # (the scheduling loop reports its own errors)
            else:
                self.contact.seen(at, self.max_gap_s)
            await anyio.sleep(probe_interval_s(self.zombie_threshold_s))

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel == CHANNEL_DAG_RESCAN and self.dag_scan is not None:
            self.dag_scan.request(payload)
        else:
            self._wake.set()

    @staticmethod
    async def _listen(listener: Listener) -> None:
        try:
            await listener.ensure_connected()
        except TRANSIENT_ERRORS as exc:
            log.warning("cannot LISTEN (%s: %s); polling only for now", type(exc).__name__, exc)

    async def finish_runs(self) -> None:
        ended = await self.store.finish_dag_runs()
        for run in ended:
            log.info("DAG run %s/%s ended: %s", run.dag_id, run.run_id, run.state)
        await observe_ended_runs(self.store, self.metrics, ended)
        if ended:
            log_started(await self.store.start_queued_runs(sorted({r.dag_id for r in ended})))

    async def create_runs(self) -> int:
        """Create the runs of the DAGs whose next scheduled run is due."""
        created = await create_due_runs(self.store)
        if created:
            log.info("created %d scheduled run(s)", created)
        created += await self.create_asset_runs()
        self.runs_created += created
        return created

    async def create_asset_runs(self) -> int:
        """Create the runs of the DAGs whose asset condition holds over their queued events
        (woken by NOTIFY deferral_assets), then start those max_active_runs admits."""
        made = await self.store.create_asset_runs()
        for run in made:
            log.info(
                "created asset-triggered run %s/%s (%d event(s))",
                run.dag_id,
                run.run_id,
                run.events,
            )
        if made:
            log_started(await self.store.start_queued_runs(sorted({r.dag_id for r in made})))
        return len(made)

    async def _until_next_pass(self) -> float:
        """Seconds to wait: the pass interval, or less when a scheduled run or a duty is due
        sooner."""
        wait_s = min(self.interval_s, self.duties.due_in(self))
        next_in = await self.store.next_due_in()
        if next_in is None:
            return wait_s
        return min(wait_s, max(next_in, MIN_WAIT_S))

    def health_checks(self) -> dict[str, Check]:
        """Readiness: a pass of the scheduler's loop completed recently
        (engine/runtime/health.py)."""
        limit = max(5 * self.interval_s, 15.0)
        return {"scheduler_loop": freshness("scheduler pass", lambda: self.pass_at, limit)}
