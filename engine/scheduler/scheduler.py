"""The scheduler: creates runs from schedules, and the housekeeping no single completion does.

* creates the runs of scheduled DAGs when their data interval ends (:mod:`engine.scheduler.dagruns`:
  one indexed look for due DAGs, woken at the earliest due time), and starts queued runs as
  max_active_runs lets them;
* ends DAG runs whose tasks are all finished (woken when a leaf task finishes);
* resolves pending tasks that no completion resolved (a backstop);
* reaps task instances whose worker stopped heartbeating (retries apply);
* ends deferrals whose deadline passed while no triggerer was alive to do it;
* frees the triggers of triggerers whose lease expired, drops triggers nobody waits on;
* records the DAGs of its DAGs folder in the store, so ``dags trigger`` finds them: every
  ``dag_rescan_interval_s``, and at once when asked (:func:`request_rescan`, which
  ``dags trigger`` uses for a DAG it does not know yet).

The folder is scanned by a task of its own, beside the scheduling loop: a file that takes a
minute to import holds up the recording of the DAGs, never a pass of the loop (runs are
created, started and ended meanwhile, and readiness holds). A scan imports only the files
whose content changed and writes only the DAGs whose record changed (engine/dags/dagbag.py,
engine/scheduler/dagrecord.py): a scan of an unchanged folder costs a ``stat`` per file and two
statements.

A third task probes the database every second or so, to know when the scheduler could reach
it (engine/scheduler/contact.py): heartbeats missed while the database hung are not a worker's
silence.

Rescan requests go over two channels: a requester LISTENs on ``deferral_dag_rescanned``, then
NOTIFYs ``deferral_dag_rescan`` with a token of its own (and the id of the DAG it looks for,
``<token> <dag_id>``); a scheduler answers ``scanning <token>`` when it starts the rescan and
``done <token>`` when the DAGs are recorded. A DAG file whose import is slow is waited for by
that rescan only if the DAG asked for was not found without it (or no DAG was named).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskStatus

from engine.dags.dagbag import DagBag
from engine.runtime import metrics as _metrics
from engine.runtime.health import Check, freshness
from engine.runtime.retry import TRANSIENT_ERRORS, Backoff, with_db_retry
from engine.runtime.wakeup import Wakeup
from engine.scheduler.contact import Contact, max_gap_s, probe_interval_s
from engine.scheduler.dagrecord import DagRecorder
from engine.scheduler.dagruns import create_due_runs
from engine.scheduler.fleetmetrics import export_fleet, observe_ended_runs
from engine.store import CHANNEL_FINISHED, Listener, Store
from engine.store.downstream import resolve_all_pending, settle

__all__ = [
    "CHANNEL_DAG_RESCAN",
    "CHANNEL_DAG_RESCANNED",
    "RESCAN_ANSWER_S",
    "Scheduler",
    "request_rescan",
    "sync_dags",
]

log = logging.getLogger("engine.scheduler")  # the process's logger: its package's name
T = TypeVar("T")

#: Asks running schedulers to rescan their DAGs folder now (payload: the requester's token, and
#: after a space the DAG id it looks for, if any).
CHANNEL_DAG_RESCAN = "deferral_dag_rescan"
#: Their answers: ``scanning <token>``, then ``done <token>``.
CHANNEL_DAG_RESCANNED = "deferral_dag_rescanned"
#: How long a requester waits for a scheduler to start the rescan before deciding none runs.
RESCAN_ANSWER_S = 3.0
#: How long it then waits for the rescan to end.
RESCAN_DONE_S = 120.0
#: How often the fleet gauges (tasks by state, unassigned triggers) are counted: counting
#: reads every task instance, too much for every pass.
FLEET_INTERVAL_S = 15.0

#: The shortest wait between passes when a scheduled run is due (another scheduler may be
#: creating it right now).
MIN_WAIT_S = 0.01

#: How often the scheduler deletes log lines past their retention, and how many rows of each
#: log table one statement deletes (a pass stops after ``LOG_RETENTION_BATCHES`` of them and
#: goes on at the next: housekeeping is not held up).
LOG_RETENTION_EVERY_S = 60.0
LOG_RETENTION_BATCH = 1000
LOG_RETENTION_BATCHES = 20


async def sync_dags(
    store: Store,
    dagbag: DagBag,
    recorder: DagRecorder | None = None,
    *,
    wait_slow: bool = True,
) -> int:
    """Parse the DAGs folder and record every DAG's structure and schedule; returns how many.
    The DAGs recorded from this folder that it no longer holds (file removed, or DAG removed
    from its file) are marked inactive: no more scheduled runs of them. ``recorder``: the one
    that recorded this bag's DAGs before (it remembers what it serialized). ``wait_slow``:
    wait for files whose import is slow (else they are recorded by a later call)."""
    dags = await in_daemon_thread(lambda: dagbag.collect(wait_slow=wait_slow), name="dag-scan")
    count = await (recorder or DagRecorder(store)).record(dags.values())
    if dagbag.folder is not None:
        # (A file still importing keeps its DAGs as they were, as one that failed to import.)
        kept = [*dagbag.import_errors.keys(), *map(str, dagbag.slow_imports)]
        # (Shown by `dags list` and the status page until the file imports again or is gone.)
        await store.record_import_errors(
            str(dagbag.folder), dagbag.import_errors, map(str, dagbag.slow_imports)
        )
        gone = await store.deactivate_missing_dags(str(dagbag.folder), dags.keys(), kept)
        for dag_id in gone:
            log.warning(
                "DAG %s is no longer in %s: no more scheduled runs of it (its runs stay; it "
                "is active again once its file defines it)",
                dag_id,
                dagbag.folder,
            )
    return count


async def in_daemon_thread(func: Callable[[], T], *, name: str) -> T:
    """``func()`` in a daemon thread of its own. Unlike a worker thread of anyio, a cancelled
    caller does not wait for it, and it does not hold up the process's exit: a DAG file that
    takes minutes to import must not delay a stopping scheduler (its import child notices
    that its parent is gone and ends, engine/dags/dagparse.py)."""
    done = anyio.Event()
    token = anyio.lowlevel.current_token()
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append((True, func()))
        except BaseException as exc:  # handed to the caller
            outcome.append((False, exc))
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
            anyio.from_thread.run_sync(done.set, token=token)

    threading.Thread(target=target, name=name, daemon=True).start()
    await done.wait()
    ok, value = outcome[0]
    if not ok:
        raise value
    result: T = value
    return result


async def request_rescan(
    store: Store,
    dag_id: str | None = None,
    *,
    answer_s: float = RESCAN_ANSWER_S,
    done_s: float = RESCAN_DONE_S,
) -> bool:
    """Ask the running schedulers to rescan their DAGs folders now and wait until one has
    recorded what it found (``dag_id``: the DAG looked for; a slow file is waited for only if
    that DAG is not found without it); False when no scheduler answered within ``answer_s``
    (none is running, or it is busy) or the rescan did not end within ``done_s``."""
    token = uuid.uuid4().hex
    started, done = anyio.Event(), anyio.Event()

    def on_answer(_channel: str, payload: str) -> None:
        state, _, of = payload.partition(" ")
        if of == token:
            (done if state == "done" else started).set()

    listener = store.listener(CHANNEL_DAG_RESCANNED)
    listener.on_notify(on_answer)
    await listener.ensure_connected()
    try:
        if not listener.connected:
            return False
        await store.notify(CHANNEL_DAG_RESCAN, token if dag_id is None else f"{token} {dag_id}")
        with anyio.move_on_after(answer_s):
            await started.wait()
        if not started.is_set():
            return False
        with anyio.move_on_after(done_s):
            await done.wait()
        return done.is_set()
    finally:
        with anyio.move_on_after(5, shield=True):
            await listener.close()


class Scheduler:
    def __init__(
        self,
        store: Store,
        dagbag: DagBag | None = None,
        *,
        interval_s: float = 1.0,
        zombie_threshold_s: float = 30.0,
        timeout_backstop_grace_s: float = 5.0,
        dag_rescan_interval_s: float = 10.0,
        metrics: _metrics.Metrics | None = None,
        log_retention_days: float = 30.0,
    ) -> None:
        self.store = store
        self.dagbag = dagbag
        self.interval_s = interval_s
        self.zombie_threshold_s = zombie_threshold_s
        self.timeout_backstop_grace_s = timeout_backstop_grace_s
        #: Seconds between two scans of the DAGs folder (setting ``dag_rescan_interval_s``).
        self.dag_rescan_interval_s = dag_rescan_interval_s
        #: The rescan requests not yet served: their token, and the DAG each looks for.
        self._rescan_tokens: list[tuple[str, str | None]] = []
        self._dag_ids: frozenset[str] | None = None
        self._wake = Wakeup()
        #: Wakes the DAG scan task (a rescan request, a stop).
        self._rescan = Wakeup()
        self._stopping = False
        self._orphans_swept_at = -math.inf
        #: When this scheduler could reach the database (engine/scheduler/contact.py): heartbeats
        #: are counted as missed only over its current unbroken contact.
        self.contact = Contact()
        #: Records the DAGs of the folder, remembering what it serialized.
        self.recorder = DagRecorder(store)
        #: Scans of the DAGs folder completed (for tests and introspection).
        self.dag_scans = 0
        #: Setting ``log_retention_days`` (0: log lines are kept forever).
        self.log_retention_days = log_retention_days
        self._logs_swept_at = -math.inf
        #: Housekeeping passes completed (for tests and introspection).
        self.housekeeping_passes = 0
        #: Scheduled runs this scheduler created.
        self.runs_created = 0
        #: This scheduler's row in deferral_schedulers (the status page's fleet), kept by each
        #: housekeeping pass.
        self.id: int | None = None
        self.metrics = metrics if metrics is not None else _metrics.current()
        #: When the last pass of the loop completed (monotonic clock; readiness).
        self.pass_at: float | None = None
        self._fleet_at = -math.inf

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

    def stop(self) -> None:
        """Graceful stop; safe before ``run`` (which then returns at once) and more than once;
        a stopped scheduler stays stopped."""
        self._stopping = True
        self._wake.set()
        self._rescan.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # (``_stopping`` is not reset here: a stop() that came before run() must hold.)
        channels = [CHANNEL_FINISHED]
        if self.dagbag is not None:
            channels.append(CHANNEL_DAG_RESCAN)
        listener = self.store.listener(*channels)
        listener.on_notify(self._on_notify)
        try:
            # Listening before the first scan: a rescan asked for once that scan is logged
            # is seen.
            await self._listen(listener)
            self.id = await with_db_retry("register the scheduler", self.store.register_scheduler)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._keep_contact, name="scheduler-contact")
                if self.dagbag is not None:
                    tg.start_soon(self._scan_dags, self.dagbag, name="scheduler-dag-scan")
                task_status.started()
                await self._schedule(listener)
                tg.cancel_scope.cancel()
        finally:
            with anyio.move_on_after(5, shield=True):
                await listener.close()
                if self.id is not None:
                    with contextlib.suppress(*TRANSIENT_ERRORS):
                        await self.store.unregister_scheduler(self.id)

    async def _schedule(self, listener: Listener) -> None:
        """The scheduling loop: passes until stopped. No pass waits for the DAGs folder."""
        last_housekeeping = time.monotonic()
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
                now = time.monotonic()
                if now - last_housekeeping >= self.interval_s:
                    last_housekeeping = now
                    await self.housekeeping()
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

    async def _scan_dags(self, dagbag: DagBag) -> None:
        """Scan the folder and record its DAGs every ``dag_rescan_interval_s`` and when asked,
        beside the scheduling loop (which never waits for it)."""
        backoff = Backoff()
        while not self._stopping:
            try:
                await self._sync_dags(dagbag)
            except TRANSIENT_ERRORS as exc:
                await backoff.wait("recording DAGs", exc)
                continue
            except Exception:  # not the scheduling loop's end: logged, tried again
                log.exception("recording the DAGs of %s failed", dagbag.folder)
                await self._rescan.wait(self.dag_rescan_interval_s)
                continue
            backoff.reset()
            self.dag_scans += 1
            if not self._rescan_tokens:
                await self._rescan.wait(self.dag_rescan_interval_s)

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel == CHANNEL_DAG_RESCAN:
            token, _, dag_id = payload.partition(" ")
            self._rescan_tokens.append((token, dag_id or None))
            self._rescan.set()
        else:
            self._wake.set()

    async def _sync_dags(self, dagbag: DagBag) -> None:
        """Scan the folder and record its DAGs, answering the rescan requests it serves. Logs
        a line when the DAGs or the import errors changed (the errors themselves are logged by
        the bag, once per change of their file), saying when the next scan is."""
        tokens, self._rescan_tokens = self._rescan_tokens, []
        for token, _ in tokens:
            await self.store.notify(CHANNEL_DAG_RESCANNED, f"scanning {token}")
        imports, written = dagbag.imports, self.recorder.written
        try:
            await sync_dags(self.store, dagbag, self.recorder, wait_slow=False)
            wanted = {dag_id for _, dag_id in tokens}
            if tokens and dagbag.slow_imports and not wanted <= set(dagbag.dags):
                # A DAG asked for (or any, when none was named) may be in a slow file.
                await sync_dags(self.store, dagbag, self.recorder, wait_slow=True)
        except BaseException:
            self._rescan_tokens[:0] = tokens  # served by the next try
            raise
        for token, _ in tokens:
            await self.store.notify(CHANNEL_DAG_RESCANNED, f"done {token}")
        dag_ids = frozenset(dagbag.dags)
        imported, wrote = dagbag.imports - imports, self.recorder.written - written
        if dag_ids != self._dag_ids or dagbag.newly_reported or imported or wrote:
            errors = len(dagbag.import_errors)
            log.info(
                "recorded %d DAG(s) from %s (%d file(s) imported, %d DAG(s) written)%s; next "
                "scan in %g s (setting dag_rescan_interval_s)",
                len(dag_ids),
                dagbag.folder,
                imported,
                wrote,
                f", {errors} file(s) failed to import" if errors else "",
                self.dag_rescan_interval_s,
            )
        else:
            log.debug("rescanned %s: nothing changed", dagbag.folder)
        self._dag_ids = dag_ids

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
            await self._started(
                await self.store.start_queued_runs(sorted({r.dag_id for r in ended}))
            )

    async def _started(self, started: list[Any]) -> None:
        for run in started:
            log.info("DAG run %s/%s started (was queued)", run.dag_id, run.run_id)

    async def create_runs(self) -> int:
        """Create the runs of the DAGs whose next scheduled run is due."""
        created = await create_due_runs(self.store)
        if created:
            log.info("created %d scheduled run(s)", created)
        self.runs_created += created
        return created

    async def _until_next_pass(self) -> float:
        """Seconds to wait: the pass interval, or less when a scheduled run is due sooner."""
        next_in = await self.store.next_due_in()
        if next_in is None:
            return self.interval_s
        return min(self.interval_s, max(next_in, MIN_WAIT_S))

    async def housekeeping(self) -> None:
        # (No contact since the last failure: nothing is reaped until there is.)
        zombies = (
            []
            if self.contact.broken
            else await self.store.reap_zombie_tasks(
                self.zombie_threshold_s,
                contact_since=self.contact.since,
                last_contact=self.contact.last,
                max_gap_s=self.max_gap_s,
            )
        )
        await settle(self.store, zombies)
        for row in zombies:
            log.warning("reaped task instance %s of a dead worker (now %s)", row.id, row.state)
        await self.store.reap_triggerers()
        late = await self.store.timeout_deferrals(None, grace_s=self.timeout_backstop_grace_s)
        await settle(self.store, late)
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
        resolved = await resolve_all_pending(self.store)
        if resolved:
            log.info("resolved %d pending task instance(s)", resolved)
        # Orphans are dropped once older than zombie_threshold_s; looking every half of that
        # keeps them at most 1.5 times as long. The look reads every trigger (about 90 ms at
        # 100,000 waiting), which every second was most of the database's idle CPU.
        now = time.monotonic()
        if now - self._orphans_swept_at >= self.zombie_threshold_s / 2:
            self._orphans_swept_at = now
            ownerless = await self.store.release_ownerless_triggers()
            if ownerless:
                log.warning("freed %d trigger(s) owned by no registered triggerer", ownerless)
            orphans = await self.store.delete_orphan_triggers(self.zombie_threshold_s)
            if orphans:
                log.info("dropped %d trigger(s) nobody waits on", orphans)
        if self.log_retention_days > 0 and now - self._logs_swept_at >= LOG_RETENTION_EVERY_S:
            self._logs_swept_at = now
            deleted = await self.delete_old_logs()
            if deleted:
                log.info("deleted %d log line(s) past log_retention_days", deleted)
        if zombies or late or resolved:
            await self.finish_runs()
        # The backstop for queued runs whose admission was missed (a scheduler that stopped
        # between ending a run and starting the next).
        await self._started(await self.store.start_queued_runs())
        if self.id is not None:
            self.id = await self.store.heartbeat_scheduler(self.id)
        if now - self._fleet_at >= FLEET_INTERVAL_S:
            self._fleet_at = now
            await self.export_fleet()
        self.housekeeping_passes += 1

    async def export_fleet(self) -> None:
        """Set the fleet gauges (engine/scheduler/fleetmetrics.py)."""
        await export_fleet(self.store, self.metrics)

    def health_checks(self) -> dict[str, Check]:
        """Readiness: a pass of the scheduler's loop completed recently
        (engine/runtime/health.py)."""
        limit = max(5 * self.interval_s, 15.0)
        return {"scheduler_loop": freshness("scheduler pass", lambda: self.pass_at, limit)}

    async def delete_old_logs(self) -> int:
        """Delete log lines older than ``log_retention_days``, in small batches (at most
        ``LOG_RETENTION_BATCHES`` of them a table); returns how many rows went."""
        return await self.store.delete_old_logs(
            self.log_retention_days * 86400.0,
            batch=LOG_RETENTION_BATCH,
            max_batches=LOG_RETENTION_BATCHES,
        )
