"""The worker process: claims runnable task instances up to its free slots (``FOR UPDATE
SKIP LOCKED``, woken by ``LISTEN``, polling as a backstop) and runs each claimed try in a
task of its own, which ``attempt.py`` runs to one outcome (``outcomes.py``) and
``recorder.py`` writes. This module keeps the process: registration (``registration.py``),
the claim loop, the heartbeat and the stop requests it brings (a mark or a clear of a running
try), each try's frame (its log binding, cancel scope and slot), the graceful stop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

import anyio
from anyio.abc import TaskStatus

from engine.dags.dagbag import DagBag
from engine.runtime import metrics as _metrics
from engine.runtime.crashpoints import crash_point
from engine.runtime.health import Check, freshness
from engine.runtime.keepalive import KeepAlive
from engine.runtime.overrides import overridden
from engine.runtime.retry import TRANSIENT_ERRORS, Backoff, with_db_retry
from engine.runtime.wakeup import Wakeup
from engine.store import (
    CHANNEL_STOP,
    CHANNEL_TASKS,
    HANDED_UNREAD_S,
    PAYLOAD_CALLBACKS,
    PAYLOAD_HANDED,
    ClaimedTask,
    Store,
)
from engine.usercode import guard as usercode
from engine.worker import registration
from engine.worker.attempt import Attempts
from engine.worker.callbacks import CallbackRunner
from engine.worker.config import WorkerConfig
from engine.worker.outcomes import Deferred, Expanded, Returned, Skipped, describe
from engine.worker.recorder import Recorder
from engine.worker.trylogs import TryLogs

__all__ = ["Worker"]

log = logging.getLogger("engine.worker")  # the process's logger: its package's name


class Worker:
    """Claims and runs task instances; ``slots`` of them at a time."""

    def __init__(
        self,
        store: Store,
        dagbag: DagBag,
        config: WorkerConfig | None = None,
        *,
        metrics: _metrics.Metrics | None = None,
        **overrides: Any,
    ) -> None:
        """``config``: how it runs (:class:`WorkerConfig`, its defaults when None); keyword
        arguments named like its fields override them (``Worker(store, bag, slots=3)``), any
        other name is a TypeError."""
        self.config = config = overridden(
            WorkerConfig() if config is None else config, overrides, "Worker"
        )
        slots = config.slots
        self.store = store
        self.dagbag = dagbag
        self.slots = slots
        #: The queues whose tasks this worker claims.
        self.queues = config.queues
        #: Running tasks across all workers at once (setting parallelism; 0: no limit).
        self.parallelism = config.parallelism
        self.poll_interval_s = config.poll_interval_s
        self.heartbeat_s = config.heartbeat_s
        self.shutdown_grace_s = config.shutdown_grace_s
        self.id: int | None = None
        self.running: dict[int, ClaimedTask] = {}
        self.peak_running = 0
        self.finished = 0
        self._wake = Wakeup()
        # Whether the next turn of the claim loop claims: a wake-up that only says a triggerer
        # handed this worker resumes (``_handed``) reads those and claims nothing.
        self._claim_wanted = True
        self._handed = True  # (what was handed before it listened: read at once)
        # The last claim took something or left runnable tasks behind (a limit held them, or
        # its limit was reached): the end of a try, freeing a slot, claims again.
        self._backlog = True
        self._idle = Wakeup()
        self._stopping = False
        # A claim failed after it may have committed: look for claims whose reply was lost.
        self._claims_unsure = False
        # Tasks this process gave up on without recording an outcome: never adopted again.
        self._abandoned: set[int] = set()
        # Tries told to stop (their task was marked or cleared), by (task instance, try), with
        # why, until they have: they keep their slots, and the heartbeat reports them as still
        # running (the database counts them in their pools until it no longer does).
        self._leaving: dict[tuple[int, int], str] = {}
        # Mapped tries writing their expansion, by task instance. Instance 0 keeps the row's
        # id and gets its try number back, so once the expansion commits a claim of it has the
        # (id, try) of the expanding claim, which still runs here until its write returns: that
        # claim is new work, not the expanding one found again (_adopt).
        self._expanding: set[int] = set()
        # The cancel scope of each try running here, by (task instance, try).
        self._scopes: dict[tuple[int, int], anyio.CancelScope] = {}
        self._keepalive: KeepAlive | None = None
        self.metrics = metrics if metrics is not None else _metrics.current()
        #: What the tries log and print, stored per try within the bounds of ``log_limits``.
        self.logs = TryLogs(store, config.log_limits)
        #: Runs a try and says how it ended; threads still running past their try: ``lingering``.
        self.attempts = Attempts(
            store,
            dagbag,
            self.logs,
            slots=slots,
            default_deferrable=config.default_deferrable,
            kill_grace_s=config.isolation_kill_grace_s,
            stopping=self._leaving,
            freed=self._slot_freed,
            xcom_max_bytes=config.xcom_max_bytes,
            max_map_length=config.max_map_length,
            callback_timeout_s=config.callback_timeout_s,
        )
        #: Runs the callbacks of outcomes (written by whoever wrote the outcome) and alerts.
        self.callbacks = CallbackRunner(
            store,
            dagbag,
            self.logs,
            queues=config.queues,
            timeout_s=config.callback_timeout_s,
            limit=slots,
            poll_interval_s=config.poll_interval_s,
            default_deferrable=config.default_deferrable,
            xcom_max_bytes=config.xcom_max_bytes,
        )
        #: Writes how each try ended (``allow``: the trigger allow-list, setting trigger_allow).
        self.recorder = Recorder(
            store,
            self.logs,
            self.metrics,
            allow=config.allow,
            abandoned=self._abandoned,
            linger_s=config.outcome_linger_s,
        )
        self.metrics.watch_worker(self._busy, slots)
        #: When the registration or the last heartbeat was written (monotonic clock).
        self.heartbeat_at: float | None = None

    def health_checks(self) -> dict[str, Check]:
        """Readiness: the worker's heartbeat was written recently (engine/runtime/health.py)."""
        return {
            "heartbeat": freshness(
                "heartbeat", lambda: self.heartbeat_at, 3 * self.heartbeat_s + 1.0
            )
        }

    def stop(self) -> None:
        """Ask for a graceful stop: claim nothing more, let running tries finish (up to the
        grace period). Safe to call before ``run`` (which then starts, sees it and returns)
        or more than once; a stopped worker stays stopped."""
        self._stopping = True
        self._want_claim()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # (``_stopping`` is not reset here: a stop() that came before run() must hold.)
        usercode.install(asyncio.get_running_loop())
        self.logs.open()
        try:
            await self._serve(task_status)
        finally:
            with anyio.move_on_after(5, shield=True):
                await self.logs.close()

    async def _serve(self, task_status: TaskStatus[None]) -> None:
        self.id = await self._register()
        listener = self.store.listener(CHANNEL_TASKS, CHANNEL_STOP)
        listener.on_notify(self._notified)
        await self._listen(listener)
        log.info(
            "worker %s started with %d slots, queues %s",
            self.id,
            self.slots,
            ",".join(self.queues),
        )
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._heartbeat_loop, listener)
                tg.start_soon(self.recorder.run, name="worker-writer")
                tg.start_soon(self.logs.run, name="worker-logs")
                tg.start_soon(self.callbacks.run, self._registration, name="worker-callbacks")
                task_status.started()
                async with anyio.create_task_group() as tasks:
                    await self._claim_loop(tasks)
                    await self._stop_taking_resumes(tasks)
                    if self.running or self._leaving:
                        log.info(
                            "stopping: waiting up to %.0fs for %d running task(s)",
                            self.shutdown_grace_s,
                            len(self.running) + len(self._leaving),
                        )
                        with anyio.move_on_after(self.shutdown_grace_s):
                            while self.running or self._leaving:
                                await self._idle.wait(None)
                        if self.running:
                            log.warning(
                                "grace period over; %d task(s) left running will be reaped and "
                                "retried per their policy",
                                len(self.running),
                            )
                    for run in self.attempts.lingering.values():
                        log.warning(
                            "stopping while the thread of task %s (failed at its "
                            "execution_timeout) still runs; the process exits when it ends",
                            describe(run.ti),
                        )
                    tasks.cancel_scope.cancel()
                # (A callback cut short runs again on another worker: let it finish.)
                self.callbacks.stop()
                with anyio.move_on_after(self.shutdown_grace_s):
                    await self.callbacks.drain()
                tg.cancel_scope.cancel()
        finally:
            with anyio.move_on_after(5, shield=True):
                await listener.close()
                if self.id is not None and not self.running:
                    await registration.unregister(self.store, self.id)
            log.info("worker %s stopped", self.id)

    async def _stop_taking_resumes(self, tasks: anyio.abc.TaskGroup) -> None:
        """As the worker stops: no triggerer hands it resumes any more, and those handed to it
        before run here (within the grace period, as every running try)."""
        if self.id is None:
            return
        try:
            await with_db_retry(
                "stop taking resumes",
                functools.partial(self.store.stop_taking_resumes, self.id),
                attempts=5,
            )
            handed = await with_db_retry("read handed resumes", self._take_handed, attempts=5)
            self._adopt(tasks, handed, time.monotonic(), fresh=True)
        except TRANSIENT_ERRORS as exc:
            log.warning(
                "could not stop taking resumes or read those handed to this worker (%s: %s); "
                "the ones it did not read are given back for other workers as it unregisters, "
                "or within %.0fs",
                type(exc).__name__,
                exc,
                HANDED_UNREAD_S,
            )
        if self._claims_unsure:
            # (a read, or a claim, whose reply was lost after it committed: its tries are this
            # worker's, and nothing else will read them now)
            try:
                found = await with_db_retry(
                    "read lost claims", self._unacknowledged_claims, attempts=5
                )
            except TRANSIENT_ERRORS as exc:
                log.warning(
                    "could not look for claims whose reply was lost (%s: %s); any are reaped "
                    "once this worker's heartbeats stop, and retried per their policy",
                    type(exc).__name__,
                    exc,
                )
            else:
                self._adopt(tasks, found, time.monotonic())

    def _registration(self) -> int | None:
        """The worker's current registration (None: not registered)."""
        return self.id

    async def _register(self) -> int:
        worker_id = await registration.register(
            self.store,
            self.slots,
            self.queues,
            parallelism=self.parallelism,
            heartbeat_s=self.heartbeat_s,
        )
        self.heartbeat_at = time.monotonic()
        return worker_id

    @staticmethod
    async def _listen(listener: Any) -> None:
        """(Re)connect the notification connection; a failure only means polling meanwhile."""
        try:
            await listener.ensure_connected()
        except TRANSIENT_ERRORS as exc:
            log.warning("cannot LISTEN (%s: %s); polling only for now", type(exc).__name__, exc)

    def _busy(self) -> int:
        """Slots taken: running tries, tries told to stop that have not yet, and threads still
        running past their timeout or their stop."""
        return len(self.running) + len(self._leaving) + len(self.attempts.lingering)

    def _notified(self, channel: str, payload: str) -> None:
        if channel == CHANNEL_STOP:
            # A try of this worker was marked or cleared: the heartbeat says which, now.
            if payload == str(self.id) and self._keepalive is not None:
                self._keepalive.poke()
            return
        if payload.startswith(PAYLOAD_HANDED):
            # A triggerer handed resumes to a worker as their triggers fired (migration 0033):
            # this one reads them if they are its own; the others have nothing to claim.
            if payload == f"{PAYLOAD_HANDED}{self.id}":
                self._handed = True
                self._wake.set()
            return
        if payload == PAYLOAD_CALLBACKS:
            # A callback request was written: the callback runner claims it. (Any other
            # notification of the channel is about tasks: asking the database for callback
            # requests on each one cost a query per worker per notification.)
            self.callbacks.wake()
            return
        self._want_claim()

    def _want_claim(self) -> None:
        """Wake the claim loop for a claim."""
        self._claim_wanted = True
        self._wake.set()

    async def _claim_loop(self, tasks: anyio.abc.TaskGroup) -> None:
        backoff = Backoff()
        # Deadlines that wake-ups do not move: a claim at least every poll interval and when
        # the next waiting task becomes runnable (a retry, a reschedule), and a read of what
        # was handed to this worker at least every poll interval (its notification may be
        # lost while the listener reconnects); a busy worker, woken by every try's end, still
        # meets them.
        claim_due = handed_due = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            if now >= claim_due:
                self._claim_wanted = True
            if now >= handed_due:
                self._handed = True
            free = self.slots - self._busy()
            wanted, self._claim_wanted = self._claim_wanted, False
            handed, self._handed = self._handed, False
            try:
                # (Lost replies first: what a claim or a read took is this worker's already,
                # and a read of handed resumes would count its slots free.)
                if self._claims_unsure and free > 0:
                    found = await self._unacknowledged_claims()
                    self._adopt(tasks, found, time.monotonic())
                    free = self.slots - self._busy()
                if handed:
                    handed_due = time.monotonic() + self.poll_interval_s
                    self._adopt(tasks, await self._take_handed(), time.monotonic(), fresh=True)
                    free = self.slots - self._busy()
                claimed: list[ClaimedTask] = []
                if wanted and free > 0:
                    claimed, next_in = await self._claim(free)
                    claim_due = time.monotonic() + min(
                        self.poll_interval_s,
                        self.poll_interval_s if next_in is None else max(0.0, next_in),
                    )
                elif wanted:
                    self._claim_wanted = True  # (no free slot: the claim waits for one)
                claimed_at = time.monotonic()
            except TRANSIENT_ERRORS as exc:
                self._claim_wanted = self._claim_wanted or wanted
                self._handed = self._handed or handed
                await backoff.wait("claiming tasks", exc)
                continue
            backoff.reset()
            self._adopt(tasks, claimed, claimed_at)
            if claimed and len(claimed) == free:
                self._claim_wanted = True
                continue
            # (A claim that waits for a free slot waits for a try's end, which wakes the loop,
            # not for its deadline: that has passed, and would spin the loop.)
            due = handed_due if self._claim_wanted else min(claim_due, handed_due)
            await self._wake.wait(max(0.0, due - time.monotonic()))

    async def _claim(self, limit: int) -> tuple[list[ClaimedTask], float | None]:
        assert self.id is not None
        # Until the reply arrives, the claim may commit with nobody to run what it took.
        self._claims_unsure = True
        started = time.perf_counter()
        claim = await self.store.claim_tasks(
            self.id, limit, queues=self.queues, parallelism=self.parallelism
        )
        claimed = claim.claimed
        if claimed:
            crash_point("worker.claim.after_commit")
        self._claims_unsure = False
        self._backlog = bool(claimed) or bool(claim.refused) or claim.held
        self.recorder.refuse_claimed(claim.refused)
        self._observe_claim(claimed, time.perf_counter() - started)
        return claimed, claim.next_in

    async def _take_handed(self) -> list[ClaimedTask]:
        """The resumes triggerers handed this worker (migration 0033) that it has not read
        yet, marked read as they are read (the fire claimed them; unread, they would be given
        back for another worker)."""
        assert self.id is not None
        # Until the reply arrives, the read may have marked them read with nobody to run them:
        # the lost-claim read (unacknowledged_claims) finds them then.
        unsure, self._claims_unsure = self._claims_unsure, True
        # (At most its free slots as it counts them: the rest are given back at once.)
        handed = await self.store.handed_tasks(self.id, self.slots - self._busy())
        self._claims_unsure = unsure
        self.recorder.refuse_claimed(handed.refused)
        for ti in handed.claimed:
            if ti.next_method is not None and ti.run_after is not None:
                delay = (ti.db_now - ti.run_after).total_seconds()
                self.metrics.resume_latency.observe(max(0.0, delay))
        return handed.claimed

    def _observe_claim(self, claimed: list[ClaimedTask], duration_s: float) -> None:
        m = self.metrics
        m.claim_duration.labels("tasks").observe(duration_s)
        if not claimed:
            return
        m.claim_batch.labels("tasks").observe(len(claimed))
        # A resume's run_after is when its trigger's event was written (fire_triggers).
        for ti in claimed:
            if ti.next_method is not None and ti.run_after is not None:
                m.resume_latency.observe(max(0.0, (ti.db_now - ti.run_after).total_seconds()))

    async def _unacknowledged_claims(self) -> list[ClaimedTask]:
        """Claims of this worker that committed but whose reply was lost with its connection
        (else the task would sit unrun and unheartbeated until reaped, losing its try)."""
        assert self.id is not None
        known = [*self.running, *self._abandoned]
        claim = await self.store.unacknowledged_claims(self.id, known)
        found = claim.claimed
        self._claims_unsure = False
        self.recorder.refuse_claimed(claim.refused)
        if found:
            log.warning(
                "found %d claim(s) whose reply was lost with the connection (first: task "
                "instance %s); running them in their claimed try",
                len(found),
                found[0].id,
            )
        return found

    def _adopt(
        self,
        tasks: anyio.abc.TaskGroup,
        claimed: list[ClaimedTask],
        claimed_at: float,
        *,
        fresh: bool = False,
    ) -> None:
        """Run the tries of a claim whose reply arrived at ``claimed_at`` (monotonic).
        ``fresh``: each is new here whatever this worker still holds of the same try (handed
        resumes: the database had them deferred, so a frame of the same try still here is
        one whose deferral was written and that has not returned yet)."""
        if not claimed:
            # (Nothing to count either: a try past its timeout is counted twice while its
            # failure is written, in ``running`` and as a lingering thread, and an empty read
            # of handed resumes, every poll interval, would take that for a peak.)
            return
        for ti in claimed:
            held = self.running.get(ti.id)
            if held is not None:
                if held.try_number == ti.try_number and not fresh and ti.id not in self._expanding:
                    continue  # (a claim found again among the unacknowledged ones)
                if held.try_number == ti.try_number:
                    # Instance 0 of an expansion still being written here: the expanding try
                    # keeps running until its write returns (its slot, heartbeat and stop stay
                    # covered); the claim runs beside it, and takes its place in ``running``.
                    # (Taken once: the same claim found again later is skipped as above.)
                    self._expanding.discard(ti.id)
                    self.running[ti.id] = ti
                    tasks.start_soon(self._execute, ti, claimed_at, name=f"ti-{ti.id}")
                    continue
                # The database gave the task a new try while an earlier one still runs here
                # (this worker was declared dead and registered again): the earlier one ended
                # there, so it stops here too, and the new one runs.
                self._stop_try(held, f"superseded by try {ti.try_number}")
            self.running[ti.id] = ti
            tasks.start_soon(self._execute, ti, claimed_at, name=f"ti-{ti.id}")
        self.peak_running = max(self.peak_running, self._busy())

    async def _heartbeat_loop(self, listener: Any) -> None:
        async def beat() -> None:
            await self._heartbeat()
            await self._listen(listener)

        self._keepalive = registration.keepalive(beat, self.heartbeat_s)
        await self._keepalive.run()

    def _tries_here(self) -> list[tuple[int, int]]:
        """(task instance, try) of every try whose code may still run here."""
        here = {(ti.id, ti.try_number) for ti in self.running.values()}
        return sorted(here | self._leaving.keys() | self.attempts.lingering.keys())

    async def _heartbeat(self) -> None:
        assert self.id is not None
        beat = await self.store.heartbeat_worker(
            self.id,
            self._tries_here(),
            timeout_s=registration.heartbeat_timeout_s(self.heartbeat_s),
        )
        if beat.alive:
            self.heartbeat_at = time.monotonic()
            for request in beat.stop:
                ti = self.running.get(request.ti_id)
                if ti is not None and ti.try_number == request.try_number:
                    self._stop_try(ti, request.reason)
            return
        log.error(
            "worker %s was declared dead (missed heartbeats); its tasks were reaped. "
            "Registering again",
            self.id,
        )
        # (A registration whose reply is lost leaves a row without heartbeats: the scheduler
        # removes it; the next heartbeat finds this id dead again and registers anew.)
        self.id = await registration.register(
            self.store,
            self.slots,
            self.queues,
            parallelism=self.parallelism,
            heartbeat_s=self.heartbeat_s,
            takes_resumes=not self._stopping,  # (a stopping worker reads handed rows no more)
            retry=False,
        )
        self.heartbeat_at = time.monotonic()
        self._abandoned.clear()  # ids of the old registration: never held by the new one
        if self._stopping:
            # (a stop that came while the registration was in flight, which may have said it
            # takes resumes: it must not, or every fire would prefer the idle new row, and
            # every resume handed to it would wait to be given back)
            await with_db_retry(
                "stop taking resumes",
                functools.partial(self.store.stop_taking_resumes, self.id),
                attempts=5,
            )

    def _stop_try(self, ti: ClaimedTask, reason: str) -> None:
        """Stop a try running here (its task was marked or cleared): cancelled as at its
        execution_timeout (a thread cannot be stopped: it keeps its slot until it ends, see
        attempt.py; a child process is stopped). It keeps its slot until it has
        stopped, and the heartbeat reports it until then."""
        key = (ti.id, ti.try_number)
        if self.running.get(ti.id) is ti:
            del self.running[ti.id]
        if key in self._leaving:
            return
        self._leaving[key] = reason
        log.warning("stopping task %s: %s", describe(ti), reason)
        scope = self._scopes.get(key)
        if scope is not None:
            scope.cancel()

    async def _execute(self, ti: ClaimedTask, claimed_at: float) -> None:
        """One claimed try, from start to outcome written (or stopped, if told to);
        ``claimed_at``: when its claim's reply arrived (monotonic)."""
        worker_id = self.id
        assert worker_id is not None
        key = (ti.id, ti.try_number)
        # (logs.binding and self.logs.bound, without two generators per try)
        entered = self.logs.enter(ti)
        # A try that returned, deferred or skipped leaves nothing to claim by its end alone
        # (what it made runnable downstream comes with a notification): its slot is claimed
        # for only if the last claim left work behind. Any other end claims at once (a retry
        # or a reschedule may be due, or its claim tells when).
        quiet = False
        try:
            try:
                # (Cancelled when the try is told to stop; a stop before it started: at once.)
                with anyio.CancelScope() as scope:
                    self._scopes[key] = scope
                    if key in self._leaving:
                        scope.cancel()
                    try:
                        started = time.perf_counter()
                        outcome = await self.attempts.run(ti, worker_id, claimed_at=claimed_at)
                        if isinstance(outcome, Expanded):
                            # Its instance 0 keeps its id and gets its try number back: once
                            # the expansion commits, a claim of it is (id, try) of this one,
                            # which the claim loop must run, not take for this claim found
                            # again (the instance would stay "running" on nothing, for good).
                            # This try stays in ``running`` until its write returns: a stop, a
                            # heartbeat and the graceful stop's wait still see it.
                            self._expanding.add(ti.id)
                        await self.recorder.record(ti, worker_id, outcome, started=started)
                        quiet = isinstance(outcome, Returned | Deferred | Skipped)
                    except anyio.get_cancelled_exc_class():
                        raise
                    except Exception:
                        # A bug of the worker's own, not the task's: the task is left to the
                        # reaper (retries apply), the process and the other tasks carry on.
                        self._abandoned.add(ti.id)
                        log.exception(
                            "running or recording try %s of task instance %s failed",
                            ti.try_number,
                            ti.id,
                        )
                reason = self._leaving.get(key)
                if scope.cancelled_caught and reason is not None:
                    still = " (its thread still runs)" if key in self.attempts.lingering else ""
                    log.warning("try %d stopped%s: %s", ti.try_number, still, reason)
                    # Its lines are stored before it is reported stopped (as a try's are before
                    # its outcome): a reader that sees its slot free has them all.
                    await self.logs.flush_ended(key)
            finally:
                if self._scopes.get(key) is scope:  # (not a later claim's: see _adopt)
                    del self._scopes[key]
                self._expanding.discard(ti.id)  # (instance 0's claim never expands)
                if self.running.get(ti.id) is ti:
                    del self.running[ti.id]
                if self._leaving.pop(key, None) is not None and key not in self.attempts.lingering:
                    self._report_stopped()
                self.finished += 1
                if self._backlog or not quiet:
                    self._claim_wanted = True
                self._wake.set()  # (a claim asked for while no slot was free goes now)
                self._idle.set()
        finally:
            self.logs.leave(ti, entered)

    def _report_stopped(self) -> None:
        """A try told to stop has: the next heartbeat, at once, says so (its slot frees)."""
        if self._keepalive is not None:
            self._keepalive.poke()

    def _slot_freed(self, stopped: bool) -> None:
        """A thread that held its slot past its try ended (``stopped``: the try was told to
        stop, and the heartbeat says it has)."""
        if stopped:
            self._report_stopped()
        self._want_claim()
        self._idle.set()
