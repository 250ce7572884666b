"""The worker: runs task instances in a fixed number of slots.

It claims runnable task instances up to its free slots (``FOR UPDATE SKIP LOCKED``),
woken by ``LISTEN`` and polling as a backstop. A plain ``def`` runs in a worker
thread, an ``async def`` on the loop. The outcome is one write: success (the
return value is the result), failure (the traceback; retries apply), a deferral
(trigger stored and slot freed in one transaction), or a reschedule. Successes and
failures queue for one writer, which ends every try queued meanwhile in one statement
(the slot stays held until its outcome is written).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import functools
import inspect
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
from anyio.abc import TaskStatus

from engine.config import (
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_WORKER_SLOTS,
    DEFAULT_XCOM_MAX_BYTES,
)
from engine.dags.dagbag import DagBag
from engine.runtime import logs
from engine.runtime import metrics as _metrics
from engine.runtime.crashpoints import crash_point
from engine.runtime.health import Check, freshness
from engine.runtime.keepalive import KeepAlive
from engine.runtime.outbox import Outbox
from engine.runtime.retry import MAX_DELAY_S, TRANSIENT_ERRORS, Backoff, with_db_retry
from engine.runtime.wakeup import Wakeup
from engine.security.allow import TriggerNotAllowed, check_trigger
from engine.states import TaskOutcomeKind
from engine.store import CHANNEL_STOP, CHANNEL_TASKS, ClaimedTask, Deferral, Store, TaskOutcome
from engine.store.downstream import settle
from engine.usercode import guard as usercode
from engine.usercode.logsink import NOT_STORED, LogLimits, LogSink, capture_line, capture_record
from engine.usercode.tracebacks import format_user_exception
from engine.worker import isolation, templating, xcom
from operators.base import (
    DEFAULT_QUEUE,
    MAX_WAIT_S,
    BaseOperator,
    Context,
    FailTask,
    RescheduleRequested,
    SkipTask,
    TaskDeferred,
)
from operators.xcom import current_context
from triggers.base import (
    TriggerSerializationError,
    decode_value,
    encode_value,
)

__all__ = ["ExecutionTimeout", "Worker"]

log = logging.getLogger("engine.worker")  # the process's logger: its package's name

#: At most this many outcomes, and about this many bytes of results and errors, per write.
FINISH_BATCH = 500
FINISH_BATCH_BYTES = 4 << 20

#: The shortest time a heartbeat gets to be answered (see :func:`heartbeat_timeout_s`).
MIN_HEARTBEAT_TIMEOUT_S = 2.0


def heartbeat_timeout_s(heartbeat_s: float) -> float:
    """How long one heartbeat may wait for its answer: twice the heartbeat interval, at least
    ``MIN_HEARTBEAT_TIMEOUT_S``. Past it the heartbeat is given up, its connection dropped, and
    the next one goes on a fresh connection: a connection that hangs must not keep the worker
    silent until the scheduler reaps its tasks while the database itself answers."""
    return max(2 * heartbeat_s, MIN_HEARTBEAT_TIMEOUT_S)


class _Queued:
    """An outcome waiting for the writer, and what the write made of it."""

    __slots__ = ("done", "outcome", "state")

    def __init__(self, outcome: TaskOutcome) -> None:
        self.outcome = outcome
        self.done = anyio.Event()
        self.state: str | None = None

    @property
    def size(self) -> int:
        o = self.outcome
        return 64 + len(o.result or b"") + len(o.error or "")


def _substitute_failure(queued: _Queued, exc: Exception) -> _Queued:
    """The failure written in place of an outcome the database refused: without retries
    (the same data would be refused again), saying why."""
    outcome = queued.outcome
    return _Queued(
        TaskOutcome(
            ti_id=outcome.ti_id,
            worker_id=outcome.worker_id,
            try_number=outcome.try_number,
            kind="failed",
            error=f"the outcome of this try could not be stored: {type(exc).__name__}: {exc}",
            no_retry=True,
        )
    )


class ExecutionTimeout(Exception):
    """The try ran longer than the task's execution_timeout (counted across deferrals)."""


class _Lingering:
    """A thread still running after its try was failed at the execution_timeout, or was told
    to stop (a mark or a clear)."""

    __slots__ = ("ended", "stopped_by", "ti", "timed_out_at")

    def __init__(self, ti: ClaimedTask) -> None:
        self.ti = ti
        self.ended = False
        self.timed_out_at: float | None = None
        #: Why the try was told to stop (None: it timed out).
        self.stopped_by: str | None = None


class _Leaving:
    """A try this worker was told to stop (a mark or a clear of its task), until it has."""

    __slots__ = ("reason", "ti")

    def __init__(self, ti: ClaimedTask, reason: str) -> None:
        self.ti = ti
        self.reason = reason


class InvalidDeferral(ValueError):
    """A deferral (or reschedule) the worker will not store: it fails its task, no retry."""


class Worker:
    """Claims and runs task instances; ``slots`` of them at a time."""

    def __init__(
        self,
        store: Store,
        dagbag: DagBag,
        *,
        slots: int = DEFAULT_WORKER_SLOTS,
        queues: Sequence[str] = (DEFAULT_QUEUE,),
        parallelism: int = 0,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        heartbeat_s: float = 5.0,
        shutdown_grace_s: float = 30.0,
        allow: Callable[[str], bool] | None = None,
        default_deferrable: bool = False,
        isolation_kill_grace_s: float = isolation.DEFAULT_KILL_GRACE_S,
        metrics: _metrics.Metrics | None = None,
        log_limits: LogLimits | None = None,
        xcom_max_bytes: int = DEFAULT_XCOM_MAX_BYTES,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if not queues:
            raise ValueError("queues must name at least one queue")
        self.store = store
        self.dagbag = dagbag
        self.slots = slots
        #: The queues whose tasks this worker claims.
        self.queues = tuple(queues)
        #: Running tasks across all workers at once (setting parallelism; 0: no limit).
        self.parallelism = parallelism
        self.poll_interval_s = poll_interval_s
        self.heartbeat_s = heartbeat_s
        self.shutdown_grace_s = shutdown_grace_s
        #: For isolation="process": time between SIGTERM and SIGKILL once a task's time is up.
        self.isolation_kill_grace_s = isolation_kill_grace_s
        #: Trigger allow-list (setting trigger_allow): a deferral it refuses fails the task.
        self._allow = allow
        #: Setting default_deferrable, handed to operators in their context.
        self.default_deferrable = default_deferrable
        #: Setting xcom_max_bytes: the largest return value or pushed XCom, encoded.
        self.xcom_max_bytes = xcom_max_bytes
        self.id: int | None = None
        self.running: dict[int, ClaimedTask] = {}
        self.peak_running = 0
        self.finished = 0
        self._wake = Wakeup()
        self._idle = Wakeup()
        self._stopping = False
        self._limiter = anyio.CapacityLimiter(slots)
        self._dag_lock = anyio.Lock()
        self._outbox = self._new_outbox()
        #: What the tries log and print (engine/usercode/logsink.py), stored per try in batches,
        #: within the bounds of the settings log_* (``log_limits``).
        self.logs = LogSink(store, "task", limits=log_limits)
        # A claim failed after it may have committed: look for claims whose reply was lost.
        self._claims_unsure = False
        # Tasks this process gave up on without recording an outcome: never adopted again.
        self._abandoned: set[int] = set()
        # Threads of tries failed at their execution_timeout (or told to stop) that still run
        # (Python cannot stop a thread), by (task instance, try): each keeps its slot until it
        # ends.
        self._lingering: dict[tuple[int, int], _Lingering] = {}
        # Tries told to stop (their task was marked or cleared), by (task instance, try), until
        # they have: they keep their slots, and the heartbeat reports them as still running
        # (the database counts them in their pools until it no longer does).
        self._leaving: dict[tuple[int, int], _Leaving] = {}
        # The cancel scope of each try running here, by (task instance, try).
        self._scopes: dict[tuple[int, int], anyio.CancelScope] = {}
        self._keepalive: KeepAlive | None = None
        self.metrics = metrics if metrics is not None else _metrics.current()
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
        self._wake.set()

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
                tg.start_soon(self._outbox.run, name="worker-writer")
                tg.start_soon(self.logs.run, name="worker-logs")
                task_status.started()
                async with anyio.create_task_group() as tasks:
                    await self._claim_loop(tasks)
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
                    for run in self._lingering.values():
                        log.warning(
                            "stopping while the thread of task %s (failed at its "
                            "execution_timeout) still runs; the process exits when it ends",
                            _name(run.ti),
                        )
                    tasks.cancel_scope.cancel()
                tg.cancel_scope.cancel()
        finally:
            with anyio.move_on_after(5, shield=True):
                await listener.close()
                if self.id is not None and not self.running:
                    await self._unregister(self.id)
            log.info("worker %s stopped", self.id)

    async def _register(self) -> int:
        worker_id = await with_db_retry(
            "register worker",
            lambda: self.store.register_worker(
                socket.gethostname(), os.getpid(), self.slots, self.queues
            ),
        )
        self.heartbeat_at = time.monotonic()
        return worker_id

    async def _unregister(self, worker_id: int) -> None:
        try:
            await with_db_retry(
                "unregister worker",
                functools.partial(self.store.unregister_worker, worker_id),
                attempts=5,
            )
        except TRANSIENT_ERRORS as exc:
            log.warning(
                "could not unregister worker %s (%s: %s); the scheduler removes it once its "
                "heartbeats stop",
                worker_id,
                type(exc).__name__,
                exc,
            )

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
        return len(self.running) + len(self._leaving) + len(self._lingering)

    def _notified(self, channel: str, payload: str) -> None:
        if channel == CHANNEL_STOP:
            # A try of this worker was marked or cleared: the heartbeat says which, now.
            if payload == str(self.id) and self._keepalive is not None:
                self._keepalive.poke()
            return
        self._wake.set()

    async def _claim_loop(self, tasks: anyio.abc.TaskGroup) -> None:
        backoff = Backoff()
        while not self._stopping:
            free = self.slots - self._busy()
            timeout = self.poll_interval_s
            if free > 0:
                try:
                    if self._claims_unsure:
                        self._adopt(tasks, await self._unacknowledged_claims())
                        free = self.slots - self._busy()
                    claimed, next_in = await self._claim(free) if free > 0 else ([], None)
                except TRANSIENT_ERRORS as exc:
                    await backoff.wait("claiming tasks", exc)
                    continue
                backoff.reset()
                if next_in is not None:
                    timeout = max(0.0, min(timeout, next_in))
                self._adopt(tasks, claimed)
                if claimed and len(claimed) == free:
                    continue
            await self._wake.wait(timeout)

    async def _claim(self, limit: int) -> tuple[list[ClaimedTask], float | None]:
        assert self.id is not None
        # Until the reply arrives, the claim may commit with nobody to run what it took.
        self._claims_unsure = True
        started = time.perf_counter()
        claimed, next_in = await self.store.claim_tasks(
            self.id, limit, queues=self.queues, parallelism=self.parallelism
        )
        if claimed:
            crash_point("worker.claim.after_commit")
        self._claims_unsure = False
        self._observe_claim(claimed, time.perf_counter() - started)
        return claimed, next_in

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
        found = await self.store.unacknowledged_claims(self.id, known)
        self._claims_unsure = False
        if found:
            log.warning(
                "found %d claim(s) whose reply was lost with the connection (first: task "
                "instance %s); running them in their claimed try",
                len(found),
                found[0].id,
            )
        return found

    def _adopt(self, tasks: anyio.abc.TaskGroup, claimed: list[ClaimedTask]) -> None:
        for ti in claimed:
            held = self.running.get(ti.id)
            if held is not None:
                if held.try_number == ti.try_number:
                    continue  # (a claim found again among the unacknowledged ones)
                # The database gave the task a new try while an earlier one still runs here
                # (this worker was declared dead and registered again): the earlier one ended
                # there, so it stops here too, and the new one runs.
                self._stop_try(held, f"superseded by try {ti.try_number}")
            self.running[ti.id] = ti
            tasks.start_soon(self._execute, ti, name=f"ti-{ti.id}")
        self.peak_running = max(self.peak_running, self._busy())

    async def _heartbeat_loop(self, listener: Any) -> None:
        async def beat() -> None:
            await self._heartbeat()
            await self._listen(listener)

        # Retries come at least as often as heartbeats, so a short outage costs no reaping.
        self._keepalive = KeepAlive(
            "heartbeat",
            beat,
            interval_s=self.heartbeat_s,
            max_backoff_s=min(MAX_DELAY_S, self.heartbeat_s),
            errors=TRANSIENT_ERRORS,
            first_after_s=self.heartbeat_s,
        )
        await self._keepalive.run()

    def _tries_here(self) -> list[tuple[int, int]]:
        """(task instance, try) of every try whose code may still run here."""
        here = {(ti.id, ti.try_number) for ti in self.running.values()}
        return sorted(here | self._leaving.keys() | self._lingering.keys())

    async def _heartbeat(self) -> None:
        assert self.id is not None
        beat = await self.store.heartbeat_worker(
            self.id, self._tries_here(), timeout_s=heartbeat_timeout_s(self.heartbeat_s)
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
        self.id = await self.store.register_worker(
            socket.gethostname(), os.getpid(), self.slots, self.queues
        )
        self.heartbeat_at = time.monotonic()
        self._abandoned.clear()  # ids of the old registration: never held by the new one

    def _stop_try(self, ti: ClaimedTask, reason: str) -> None:
        """Stop a try running here (its task was marked or cleared): cancelled as at its
        execution_timeout (a thread cannot be stopped: it keeps its slot until it ends, see
        :meth:`_in_thread`; a child process is stopped). It keeps its slot until it has
        stopped, and the heartbeat reports it until then."""
        key = (ti.id, ti.try_number)
        if self.running.get(ti.id) is ti:
            del self.running[ti.id]
        if key in self._leaving:
            return
        self._leaving[key] = _Leaving(ti, reason)
        log.warning("stopping task %s: %s", _name(ti), reason)
        scope = self._scopes.get(key)
        if scope is not None:
            scope.cancel()

    async def _execute(self, ti: ClaimedTask) -> None:
        worker_id = self.id
        assert worker_id is not None
        key = (ti.id, ti.try_number)
        with logs.binding(dag=ti.dag_id, run=ti.run_id, task=ti.task_id, attempt=ti.try_number):
            # (A try this claim started has nothing stored yet: its total starts at 0.)
            fresh = ti.next_method is None and ti.try_started_at == ti.db_now
            token = self.logs.bind_task(
                ti.id, ti.dag_id, ti.run_id, ti.task_id, ti.try_number, fresh=fresh
            )
            try:
                # (Cancelled when the try is told to stop; a stop before it started: at once.)
                with anyio.CancelScope() as scope:
                    self._scopes[key] = scope
                    if key in self._leaving:
                        scope.cancel()
                    try:
                        await self._run_and_record(ti, worker_id)
                    except anyio.get_cancelled_exc_class():
                        raise
                    except Exception:
                        # A bug of the worker's own, not the task's: the task is left to the
                        # reaper (retries apply), the process and the other tasks carry on.
                        self._abandoned.add(ti.id)
                        log.exception("recording the end of task instance %s failed", ti.id)
                leaving = self._leaving.get(key)
                if scope.cancelled_caught and leaving is not None:
                    still = " (its thread still runs)" if key in self._lingering else ""
                    log.warning("try %d stopped%s: %s", ti.try_number, still, leaving.reason)
                    # Its lines are stored before it is reported stopped (as a try's are before
                    # its outcome): a reader that sees its slot free has them all.
                    self.logs.end(key)
                    await self.logs.flush_keys([key])
            finally:
                self._scopes.pop(key, None)
                self.logs.end(key)
                self.logs.unbind(token)
                if self.running.get(ti.id) is ti:
                    del self.running[ti.id]
                if self._leaving.pop(key, None) is not None and key not in self._lingering:
                    self._report_stopped()
                self.finished += 1
                self._wake.set()
                self._idle.set()

    def _report_stopped(self) -> None:
        """A try told to stop has: the next heartbeat, at once, says so (its slot frees)."""
        if self._keepalive is not None:
            self._keepalive.poke()

    async def _context(self, op: BaseOperator, ti: ClaimedTask) -> Context:
        """The call's context, with ``op``'s templated fields rendered in place (before
        ``execute`` and again before a resumed method, from the same values; what they
        rendered to is stored at the start of the try)."""
        loop = asyncio.get_running_loop()
        rti = xcom.bind(ti, self.store, max_bytes=self.xcom_max_bytes, loop=loop)
        rendered = await templating.render_task(
            ti,
            op,
            store=self.store,
            default_deferrable=self.default_deferrable,
            task_instance=rti,
        )
        # XComArgs in templated fields: their values (after rendering: values are not templates)
        await xcom.resolve_refs(op, rti, rendered.fields)
        if rendered.fields is not None and not ti.next_method:
            await self._store_rendered(ti, rendered.fields)
        return rendered.context  # type: ignore[return-value]

    async def _store_rendered(self, ti: ClaimedTask, rendered: dict[str, Any]) -> None:
        """Keep what the fields rendered to; a failure to do so only costs the display."""
        assert self.id is not None
        worker_id, value = self.id, templating.jsonable(rendered)
        try:
            await with_db_retry(
                "store rendered fields",
                lambda: self.store.set_rendered_fields(ti.id, worker_id, ti.try_number, value),
            )
        except Exception as exc:
            log.warning(
                "the rendered fields of task %s were not stored: %s: %s",
                _name(ti),
                type(exc).__name__,
                exc,
            )

    def _remaining_s(self, ti: ClaimedTask) -> float | None:
        if ti.execution_timeout_s is None:
            return None
        elapsed = (ti.db_now - ti.try_started_at).total_seconds()
        return ti.execution_timeout_s - elapsed

    async def _call(self, op: BaseOperator, ti: ClaimedTask) -> Any:
        usercode.enter_user_code()  # tasks an async execute starts cannot end the process
        context = await self._context(op, ti)
        kwargs: dict[str, Any] = {}
        if ti.next_method:
            fn = getattr(op, ti.next_method, None)
            if not callable(fn):
                raise AttributeError(
                    f"cannot resume: {type(op).__qualname__} has no method {ti.next_method!r}"
                )
            kwargs = decode_value(ti.next_kwargs) if ti.next_kwargs else {}
            kwargs["event"] = decode_value(ti.next_event) if ti.next_event else None
        else:
            fn = op.execute
        remaining = self._remaining_s(ti)
        if remaining is not None and remaining <= 0:
            raise ExecutionTimeout(_timeout_message(ti))
        if ti.next_method:
            crash_point("worker.resume.before_method")
        if getattr(op, "isolation", "none") == "process":
            return await self._in_child(op, ti, context, kwargs, remaining)
        with current_context(context):  # get_current_context(); threads get a copy
            if not inspect.iscoroutinefunction(fn):
                call = functools.partial(fn, context, **kwargs)
                return await self._in_thread(ti, call, remaining)
            with anyio.move_on_after(remaining):
                return await fn(context, **kwargs)
        raise ExecutionTimeout(_timeout_message(ti))

    async def _in_thread(
        self, ti: ClaimedTask, call: Callable[[], Any], remaining: float | None
    ) -> Any:
        """Run ``call`` in a worker thread. Past the timeout the try fails, but the thread
        cannot be stopped: its slot stays taken (see :meth:`_busy`) until it ends. So does a
        try told to stop (its task was marked or cleared): the thread is left to end, its slot
        (and its pool's, as the database counts it) taken until then."""
        loop = asyncio.get_running_loop()
        run = _Lingering(ti)

        def body() -> Any:
            try:
                return call()
            finally:
                # (A loop that is closed has no slot left to free.)
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._thread_ended, run)

        key = (ti.id, ti.try_number)
        try:
            with anyio.move_on_after(remaining):
                return await anyio.to_thread.run_sync(
                    body, limiter=self._limiter, abandon_on_cancel=True
                )
        except anyio.get_cancelled_exc_class():
            leaving = self._leaving.get(key)
            if leaving is not None and not run.ended:
                run.stopped_by = leaving.reason
                self._lingering[key] = run
                log.warning(
                    "task %s was told to stop (%s), but its thread cannot be stopped and still "
                    "runs; its slot, and its pool's, stay taken until it ends (give the task "
                    'isolation="process" to have it stopped)',
                    _name(ti),
                    leaving.reason,
                )
            raise
        if not run.ended:
            run.timed_out_at = time.monotonic()
            self._lingering[(ti.id, ti.try_number)] = run
            log.warning(
                "task %s is past its execution_timeout of %ss and is failed, but its thread "
                "cannot be stopped and still runs; its slot stays taken until it ends (give "
                'the task isolation="process" to have it stopped)',
                _name(ti),
                ti.execution_timeout_s,
            )
        raise ExecutionTimeout(
            _timeout_message(ti) + "; the thread could not be stopped and still holds its slot"
        )

    def _thread_ended(self, run: _Lingering) -> None:
        """(On the loop.) A worker thread ended; if its try was already failed at its
        timeout, its slot is free now."""
        run.ended = True
        key = (run.ti.id, run.ti.try_number)
        if self._lingering.get(key) is not run:
            return
        del self._lingering[key]
        if run.stopped_by is not None:
            log.warning(
                "the thread of task %s, told to stop (%s), ended; its slot is free",
                _name(run.ti),
                run.stopped_by,
            )
            self._report_stopped()
        else:
            late = time.monotonic() - (run.timed_out_at or 0.0)
            log.warning(
                "the thread of task %s ended %.1fs after its execution_timeout; its slot is free",
                _name(run.ti),
                late,
            )
        self._wake.set()
        self._idle.set()

    async def _in_child(
        self,
        op: BaseOperator,
        ti: ClaimedTask,
        context: Context,
        kwargs: dict[str, Any],
        remaining: float | None,
    ) -> Any:
        """Run the call in a child process (isolation="process"), stopped at the timeout."""
        dag = self.dagbag.get_dag(ti.dag_id)
        folder = self.dagbag.folder
        if folder is None or not dag.fileloc or not Path(dag.fileloc).is_relative_to(folder):
            raise isolation.TaskError(
                f'task {op.task_id} has isolation="process", but its DAG {ti.dag_id!r} was '
                "not loaded from a file of the DAGs folder: the child process could not find it",
                no_retry=True,
            )
        request = isolation.Request(
            folder=str(folder),
            file=dag.fileloc,
            dag_id=ti.dag_id,
            task_id=ti.task_id,
            method=ti.next_method,
            context=encode_value(templating.child_context(xcom.plain_context(context))),
            kwargs=encode_value(kwargs),
            log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            log_format="json",  # read back line by line and stored with the try's lines
            parent_pid=os.getpid(),
        )
        try:
            reply = await isolation.run_isolated(
                request,
                timeout_s=remaining,
                kill_grace_s=self.isolation_kill_grace_s,
                on_output=_child_output,
                max_line_bytes=self.logs.max_line_bytes,
            )
        except isolation.ChildEnded as exc:
            raise isolation.TaskError(str(exc)) from None
        if reply is None:
            raise ExecutionTimeout(_timeout_message(ti) + "; its child process was stopped")
        return isolation.outcome_of(reply)

    async def _run_and_record(self, ti: ClaimedTask, worker_id: int) -> None:
        started = time.perf_counter()
        what = f"resume at {ti.next_method}" if ti.next_method else "execute"
        try:
            if not self.dagbag.is_current(ti.dag_id):
                # Importing DAG files is blocking work: keep it off the loop, one at a time.
                async with self._dag_lock:
                    await anyio.to_thread.run_sync(self.dagbag.get_dag, ti.dag_id)
            op = self.dagbag.get_task(ti.dag_id, ti.task_id).fresh_copy()
            result = await self._call(op, ti)
        except anyio.get_cancelled_exc_class() as exc:
            current = asyncio.current_task()
            if current is None or current.cancelling():
                raise  # the worker is cancelling this task (a stop, or the try's timeout)
            # The task's own CancelledError (an inner task it awaited was cancelled): a failure
            # of this try, not a reason to leave it running unrecorded.
            error = format_user_exception(exc)
            await self._record_failure(ti, worker_id, error)
            return
        except TaskDeferred as deferred:
            await self._record_deferral(ti, worker_id, deferred)
            return
        except RescheduleRequested as req:
            await self._record_reschedule(ti, worker_id, req)
            return
        except SkipTask as exc:
            await xcom.write_pushes(self.store, ti, worker_id)
            await self._record_end(ti, worker_id, "skipped", None)
            log.info("skipped: %s", exc)
            return
        except FailTask as exc:
            await self._record_failure(ti, worker_id, f"FailTask: {exc}", no_retry=True)
            return
        except xcom.XComError as exc:  # a value the store cannot keep: it would fail again
            await self._record_failure(ti, worker_id, format_user_exception(exc), no_retry=True)
            return
        except isolation.TaskError as exc:  # raised in a child process: its traceback
            await self._record_failure(ti, worker_id, exc.error, no_retry=exc.no_retry)
            return
        except BaseException as exc:
            # Whatever task code raises is its own failure, SystemExit and KeyboardInterrupt
            # included (Ctrl-C reaches the process as a signal its runner handles, not as this).
            error = format_user_exception(exc)
            await self._record_failure(ti, worker_id, error)
            return
        try:
            payload = xcom.encode_result(ti, result, self.xcom_max_bytes)
        except xcom.XComError as exc:
            await self._record_failure(ti, worker_id, str(exc), no_retry=True)
            return
        await xcom.write_pushes(self.store, ti, worker_id)
        await self._record_end(ti, worker_id, "success", payload)
        log.info("%s succeeded in %.1f ms", what, (time.perf_counter() - started) * 1000)

    def _deferral(self, ti: ClaimedTask, deferred: TaskDeferred) -> Deferral:
        """What will be stored for this deferral; InvalidDeferral if it cannot be. (A
        TaskDeferred may be built by hand, bypassing the checks of ``defer()``.) The stored
        deadline is not computed here: defer_task takes the earliest of this timeout and the
        task's execution_timeout, on the database clock, when it writes the deferral."""
        timeout_s = deferred.timeout_s
        if timeout_s is not None and not (
            isinstance(timeout_s, int | float)
            and not isinstance(timeout_s, bool)
            and math.isfinite(timeout_s)
            and 0 <= timeout_s <= MAX_WAIT_S
        ):
            raise InvalidDeferral(
                f"the deferral timeout must be a finite number of seconds from 0 to "
                f"{MAX_WAIT_S:.0f}; got a {type(timeout_s).__name__} outside that range"
            )
        method_kwargs = deferred.encoded_kwargs
        if not isinstance(method_kwargs, bytes):  # built by hand: not encoded by defer()
            try:
                method_kwargs = encode_value(deferred.kwargs)
            except (TypeError, ValueError, OverflowError) as exc:
                raise InvalidDeferral(f"the resume kwargs are not plain data: {exc}") from None
        trigger = deferred.trigger
        return Deferral(
            classpath=trigger.classpath,
            kwargs=trigger.kwargs,
            dedup_key=trigger.dedup_key,
            method_name=deferred.method_name,
            method_kwargs=method_kwargs,
            timeout_s=None if timeout_s is None else float(timeout_s),
            try_number=ti.try_number,
        )

    async def _record_deferral(
        self, ti: ClaimedTask, worker_id: int, deferred: TaskDeferred
    ) -> None:
        if self._allow is not None:
            try:
                check_trigger(
                    self._allow, deferred.trigger.classpath, decode_value(deferred.trigger.kwargs)
                )
            except (TriggerNotAllowed, TriggerSerializationError) as exc:
                await self._record_failure(ti, worker_id, str(exc), no_retry=True)
                return
        try:
            deferral = self._deferral(ti, deferred)
        except Exception as exc:  # any bad deferral fails its own task only
            await self._refuse(ti, worker_id, "the task's deferral is invalid", exc)
            return
        await xcom.write_pushes(self.store, ti, worker_id)
        crash_point("worker.defer.before_write")
        try:
            ok = await with_db_retry(
                "defer", lambda: self.store.defer_task(ti.id, worker_id, deferral)
            )
        except Exception as exc:  # not transient: the database refused it
            await self._refuse(ti, worker_id, "the task's deferral could not be stored", exc)
            return
        crash_point("worker.defer.after_write")
        self._lost_if_not(ok, ti)
        if ok:
            self.metrics.task_outcomes.labels("deferred").inc()
        log.info(
            "deferred to %s (resume at %s%s)",
            deferral.classpath,
            deferral.method_name,
            f", timeout {deferral.timeout_s:.1f}s" if deferral.timeout_s is not None else "",
        )

    async def _record_reschedule(
        self, ti: ClaimedTask, worker_id: int, req: RescheduleRequested
    ) -> None:
        at = req.reschedule_at
        try:
            if not isinstance(at, dt.datetime) or at.utcoffset() is None:
                raise InvalidDeferral("the reschedule time must be a timezone-aware datetime")
            # (The try may have run a while since the claim: allow for a day of that.)
            if (at - ti.db_now).total_seconds() > MAX_WAIT_S + 86400:
                raise InvalidDeferral(
                    f"the reschedule time lies more than {MAX_WAIT_S:.0f}s (ten years) ahead"
                )
        except InvalidDeferral as exc:
            await self._refuse(ti, worker_id, "the task's reschedule is invalid", exc)
            return
        await xcom.write_pushes(self.store, ti, worker_id)
        try:
            ok = await with_db_retry(
                "reschedule",
                lambda: self.store.reschedule_task(ti.id, worker_id, at, try_number=ti.try_number),
            )
        except Exception as exc:  # not transient: the database refused it
            await self._refuse(ti, worker_id, "the task's reschedule could not be stored", exc)
            return
        self._lost_if_not(ok, ti)
        if ok:
            self.metrics.task_outcomes.labels("up_for_reschedule").inc()
        log.info("up for reschedule at %s", at.isoformat())

    async def _refuse(self, ti: ClaimedTask, worker_id: int, what: str, exc: Exception) -> None:
        """End the try as failed, without retries (the same data would be refused again)."""
        await self._record_failure(
            ti, worker_id, f"{what}: {type(exc).__name__}: {exc}", no_retry=True
        )

    async def _record_end(
        self, ti: ClaimedTask, worker_id: int, state: TaskOutcomeKind, payload: bytes | None
    ) -> None:
        outcome = TaskOutcome(
            ti_id=ti.id,
            worker_id=worker_id,
            try_number=ti.try_number,
            kind=state,
            result=payload,
        )
        self._lost_if_not(await self._finish(outcome) is not None, ti)

    async def _record_failure(
        self, ti: ClaimedTask, worker_id: int, error: str, *, no_retry: bool = False
    ) -> None:
        outcome = TaskOutcome(
            ti_id=ti.id,
            worker_id=worker_id,
            try_number=ti.try_number,
            kind="failed",
            error=error,
            no_retry=no_retry,
        )
        # The try's own lines get the error before its outcome is written (a reader that sees
        # the try ended has it); the process's log gets it with the state it led to.
        # (Stored past the bounds of lines a second and of the try's total: it is the last.)
        capture_record(
            time.time(), "ERROR", log.name, f"try {ti.try_number} failed:\n{error}", always=True
        )
        state = await self._finish(outcome)
        self._lost_if_not(state is not None, ti)
        if state is not None:
            log.error(
                "try %d failed (now %s):\n%s",
                ti.try_number,
                state,
                error,
                extra={NOT_STORED: True},
            )

    async def _finish(self, outcome: TaskOutcome) -> str | None:
        """Queue the outcome for the writer and wait until it is written; the new state, or
        None if the worker no longer held the task."""
        queued = _Queued(outcome)
        self._outbox.put(queued)
        await queued.done.wait()
        return queued.state

    def _new_outbox(self) -> Outbox[_Queued, tuple[int, int], str]:
        """Outcomes are written by one writer (engine/runtime/outbox.py), every try queued while the
        last write was in flight in one statement."""
        return Outbox(
            "record outcomes",
            write=self._write_outcomes,
            substitute=_substitute_failure,
            on_written=self._written,
            on_lost=self._outcome_lost,
            describe=lambda q: f"the outcome of task instance {q.outcome.ti_id}",
            max_items=FINISH_BATCH,
            size=lambda q: q.size,
            max_bytes=FINISH_BATCH_BYTES,
            crash_before="worker.outcome.before_write",
            crash_after="worker.outcome.after_write",
            observe=self._observe_write,
        )

    def _observe_write(self, size: int, duration_s: float) -> None:
        self.metrics.write_batch.labels("task_outcomes").observe(size)
        self.metrics.write_duration.labels("task_outcomes").observe(duration_s)

    async def _write_outcomes(self, batch: list[_Queued]) -> dict[tuple[int, int], str]:
        # The lines these tries logged go first (nothing when they logged none): a reader
        # that sees a try ended has every line it logged before its outcome.
        await self.logs.flush_keys([(q.outcome.ti_id, q.outcome.try_number) for q in batch])
        finished = await self.store.finish_tasks([q.outcome for q in batch])
        await settle(self.store, finished)
        return {(f.id, f.worker_id): f.state for f in finished}

    def _written(self, batch: list[_Queued], states: dict[tuple[int, int], str]) -> None:
        for queued in batch:
            queued.state = states.get((queued.outcome.ti_id, queued.outcome.worker_id))
            queued.done.set()
        for state, n in collections.Counter(states.values()).items():
            self.metrics.task_outcomes.labels(state).inc(n)

    def _outcome_lost(self, queued: _Queued, _exc: Exception) -> None:
        """Not even a failure could be stored: the try is left to the reaper."""
        self._abandoned.add(queued.outcome.ti_id)

    async def _write(self, batch: list[_Queued]) -> None:
        """Write one batch now, outside the writer (tests); every outcome's waiter is told."""
        states: dict[tuple[int, int], str] = {}
        try:
            states = await self._outbox.write_batch(batch)
        finally:
            self._written(batch, states)

    @staticmethod
    def _lost_if_not(ok: bool, ti: ClaimedTask) -> None:
        if not ok:
            log.warning(
                "task instance %s is no longer held by this worker (reaped after missed "
                "heartbeats?); its outcome was not recorded",
                ti.id,
            )


def _child_output(line: str, cut: int = 0) -> None:
    """A line a task's child process (isolation="process") wrote: one of its log lines (as
    JSON) or a print, stored with the lines of the try (bound in this context). ``cut``: bytes
    of the line cut as it was read (a log line cut so is stored as printed text)."""
    doc: Any = None
    if line.startswith("{") and not cut:
        with contextlib.suppress(msgspec.DecodeError):
            doc = msgspec.json.decode(line)
    if isinstance(doc, dict) and {"ts", "level", "logger", "msg"} <= doc.keys():
        message = str(doc["msg"])
        if doc.get("exc"):
            message += "\n" + str(doc["exc"])
        stored = capture_record(
            float(doc["ts"]), str(doc["level"]).upper(), str(doc["logger"]), message
        )
    else:
        stored = capture_line("stderr", line, cut=cut)
    if not stored and sys.__stderr__ is not None:
        sys.__stderr__.write(line + "\n")


def _name(ti: ClaimedTask) -> str:
    return f"{ti.dag_id}.{ti.task_id} (run {ti.run_id}, try {ti.try_number}, task instance {ti.id})"


def _timeout_message(ti: ClaimedTask) -> str:
    return (
        f"execution_timeout of {ti.execution_timeout_s}s passed (counted from the start of "
        "this try, across deferrals)"
    )
