"""Recording how a try ended: one :data:`~engine.worker.outcomes.TryOutcome`, one ``match``.

A success, a skip or a failure joins the outcomes' outbox, whose one writer ends every try
queued meanwhile in one statement (``finish_tasks``) and settles what that changed
downstream; a deferral joins the deferrals' outbox, whose writer parks every try queued
meanwhile on its trigger in one statement (``defer_tasks``: the triggers stored and the slots
freed in one transaction); a reschedule is a statement of its own. Every write is fenced: it
changes nothing unless this worker still holds that try, and a try it no longer holds is only
logged. The slot stays held until the outcome is written.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Any, assert_never

import anyio

from engine.runtime import metrics as _metrics
from engine.runtime.outbox import Outbox
from engine.runtime.retry import with_db_retry
from engine.security.allow import TriggerNotAllowed, check_trigger
from engine.states import TaskOutcomeKind
from engine.store import ClaimedTask, Deferral, Store, TaskOutcome
from engine.store.downstream import settle
from engine.worker.outcomes import (
    Deferred,
    Expanded,
    Failed,
    InvalidDeferral,
    Raised,
    Rescheduled,
    Returned,
    Skipped,
    TryOutcome,
)
from engine.worker.trylogs import UNSTORED, TryLogs
from operators.base import MAX_WAIT_S
from triggers.base import TriggerSerializationError, decode_value

__all__ = ["DEFER_BATCH", "DEFER_BATCH_BYTES", "FINISH_BATCH", "FINISH_BATCH_BYTES", "Recorder"]

log = logging.getLogger("engine.worker")  # the process's logger

#: At most this many outcomes, and about this many bytes of results and errors, per write.
FINISH_BATCH = 500
FINISH_BATCH_BYTES = 4 << 20
#: A write lingers (setting ``worker_outcome_linger_s``) only while fewer outcomes than this
#: wait: from there the statement's fixed cost is a small share of it.
LINGER_ITEMS = 16
#: At most this many deferrals, and about this many bytes of their kwargs, per write.
DEFER_BATCH = 500
DEFER_BATCH_BYTES = 4 << 20


class _Queued:
    """An outcome waiting for the writer, and what the write made of it."""

    __slots__ = ("done", "outcome", "state")

    def __init__(self, outcome: TaskOutcome) -> None:
        self.outcome = outcome
        self.done = asyncio.Event()  # (anyio's asks which event loop runs, each time)
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


class _QueuedDeferral:
    """A deferral waiting for its writer, and what the write made of it. ``failure``: the
    failure written in its place instead (the database refused the deferral)."""

    __slots__ = ("deferral", "done", "failure", "state", "ti_id", "try_number", "worker_id")

    def __init__(
        self,
        ti_id: int,
        worker_id: int,
        try_number: int,
        deferral: Deferral,
        failure: TaskOutcome | None = None,
    ) -> None:
        self.ti_id = ti_id
        self.worker_id = worker_id
        self.try_number = try_number
        self.deferral = deferral
        self.failure = failure
        self.done = asyncio.Event()
        #: "deferred", the state the substitute failure led to, or None: not written.
        self.state: str | None = None

    @property
    def size(self) -> int:
        d = self.deferral
        return 128 + len(d.kwargs) + len(d.method_kwargs) + len(d.line or "")


def _substitute_deferral_failure(queued: _QueuedDeferral, exc: Exception) -> _QueuedDeferral:
    """The failure written in place of a deferral the database refused: for that try alone,
    without retries (the same deferral would be refused again), saying why. The queued item
    itself becomes the failure, so that its waiter learns what was written."""
    queued.failure = TaskOutcome(
        ti_id=queued.ti_id,
        worker_id=queued.worker_id,
        try_number=queued.try_number,
        kind="failed",
        error=f"the task's deferral could not be stored: {type(exc).__name__}: {exc}",
        no_retry=True,
    )
    return queued


class Recorder:
    """Writes the outcomes of one worker's tries. ``allow``: the trigger allow-list (setting
    trigger_allow; a deferral it refuses fails its task); ``abandoned``: the worker's set of
    task instances it gave up on without an outcome (never adopted again)."""

    def __init__(
        self,
        store: Store,
        logs: TryLogs,
        metrics: _metrics.Metrics,
        *,
        allow: Callable[[str], bool] | None,
        abandoned: set[int],
        linger_s: float = 0.0,
    ) -> None:
        self._store = store
        self._logs = logs
        self._metrics = metrics
        self._allow = allow
        self._abandoned = abandoned
        self._outbox = self._new_outbox(linger_s)
        self._deferrals = self._new_deferrals_outbox()

    async def run(self) -> None:
        """The outboxes' writers (the worker's task group)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._deferrals.run)
            await self._outbox.run()

    async def record(
        self, ti: ClaimedTask, worker_id: int, outcome: TryOutcome, *, started: float
    ) -> None:
        """Write how try ``ti`` ended (``started``: its ``time.perf_counter()`` at the start)."""
        match outcome:
            case Returned(result=payload, asset_events=events, skip=skip):
                # (A branch's skips are written with its success: both land or neither.)
                await self._record_end(ti, worker_id, "success", payload, events, skip)
                what = f"resume at {ti.next_method}" if ti.next_method else "execute"
                log.info("%s succeeded in %.1f ms", what, (time.perf_counter() - started) * 1000)
            case Raised(error=error, no_retry=no_retry):
                await self._record_failure(ti, worker_id, error, no_retry=no_retry)
            case Deferred():
                await self._record_deferral(ti, worker_id, outcome)
            case Rescheduled(at=at):
                await self._record_reschedule(ti, worker_id, at)
            case Skipped(message=message):
                await self._record_end(ti, worker_id, "skipped", None)
                log.info("skipped: %s", message)
            case Failed(message=message):
                await self._record_failure(ti, worker_id, f"FailTask: {message}", no_retry=True)
            case Expanded(count=count, values=values):
                await self._record_expansion(ti, worker_id, count, values)
            case _:
                assert_never(outcome)

    async def _record_deferral(self, ti: ClaimedTask, worker_id: int, deferred: Deferred) -> None:
        trigger = deferred.trigger
        if self._allow is not None:
            try:
                check_trigger(self._allow, trigger.classpath, decode_value(trigger.kwargs))
            except (TriggerNotAllowed, TriggerSerializationError) as exc:
                await self._record_failure(ti, worker_id, str(exc), no_retry=True)
                return
        deferral = _deferral(ti, deferred)
        # Written by the deferrals' writer with every deferral queued meanwhile; what the try
        # logged so far is stored first (its line about the deferral, written with it, comes
        # after them, and before the trigger's line about firing).
        queued = _QueuedDeferral(ti.id, worker_id, ti.try_number, deferral)
        self._deferrals.put(queued)
        await queued.done.wait()
        if queued.failure is not None:  # the database refused it: the try failed instead
            error = queued.failure.error or ""
            self._logs.failure(ti.try_number, error)
            self._lost_if_not(queued.state is not None, ti)
            if queued.state is not None:
                log.error(
                    "try %d failed (now %s):\n%s", ti.try_number, queued.state, error,
                    extra=UNSTORED,
                )  # fmt: skip
            return
        self._lost_if_not(queued.state is not None, ti)
        log.info(
            "deferred to %s (resume at %s%s)",
            deferral.classpath,
            deferral.method_name,
            f", timeout {deferral.timeout_s:.1f}s" if deferral.timeout_s is not None else "",
        )

    async def _record_expansion(
        self, ti: ClaimedTask, worker_id: int, count: int, values: list[bytes] | None
    ) -> None:
        """A mapped task becomes ``count`` instances (see engine/worker/mapping.py)."""
        try:
            made = await with_db_retry(
                "expand",
                lambda: self._store.expand_task(ti.id, worker_id, ti.try_number, count, values),
            )
        except Exception as exc:  # not transient: the database refused it
            await self._refuse(ti, worker_id, "the mapped task could not be expanded", exc)
            return
        self._lost_if_not(made > 0, ti)
        if made:
            log.info("expanded into %d mapped instances", made)

    async def _record_reschedule(self, ti: ClaimedTask, worker_id: int, at: dt.datetime) -> None:
        # (The try may have run a while since the claim: allow for a day of that.)
        if (at - ti.db_now).total_seconds() > MAX_WAIT_S + 86400:
            exc = InvalidDeferral(
                f"the reschedule time lies more than {MAX_WAIT_S:.0f}s (ten years) ahead"
            )
            await self._refuse(ti, worker_id, "the task's reschedule is invalid", exc)
            return
        try:
            ok = await with_db_retry(
                "reschedule",
                lambda: self._store.reschedule_task(ti.id, worker_id, at, try_number=ti.try_number),
            )
        except Exception as exc:  # not transient: the database refused it
            await self._refuse(ti, worker_id, "the task's reschedule could not be stored", exc)
            return
        self._lost_if_not(ok, ti)
        if ok:
            self._metrics.task_outcomes.labels("up_for_reschedule").inc()
        log.info("up for reschedule at %s", at.isoformat())

    async def _refuse(self, ti: ClaimedTask, worker_id: int, what: str, exc: Exception) -> None:
        """End the try as failed, without retries (the same data would be refused again)."""
        await self._record_failure(
            ti, worker_id, f"{what}: {type(exc).__name__}: {exc}", no_retry=True
        )

    async def _record_end(
        self,
        ti: ClaimedTask,
        worker_id: int,
        state: TaskOutcomeKind,
        payload: bytes | None,
        asset_events: list[dict[str, Any]] | None = None,
        skip: tuple[str, ...] = (),
    ) -> None:
        outcome = TaskOutcome(
            ti_id=ti.id,
            worker_id=worker_id,
            try_number=ti.try_number,
            kind=state,
            result=payload,
            asset_events=asset_events,
            skip=skip,
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
        self._logs.failure(ti.try_number, error)
        state = await self._finish(outcome)
        self._lost_if_not(state is not None, ti)
        if state is not None:
            log.error(
                "try %d failed (now %s):\n%s",
                ti.try_number,
                state,
                error,
                extra=UNSTORED,
            )

    async def _finish(self, outcome: TaskOutcome) -> str | None:
        """Queue the outcome for the writer and wait until it is written; the new state, or
        None if the worker no longer held the task."""
        queued = _Queued(outcome)
        self._outbox.put(queued)
        await queued.done.wait()
        return queued.state

    def refuse_claimed(self, outcomes: list[TaskOutcome]) -> None:
        """Claimed tries that cannot run (a resume no configured key opens, a pool that does
        not exist) fail, written by the writer like every outcome."""
        for outcome in outcomes:
            log.error("task instance %s cannot run: %s", outcome.ti_id, outcome.error)
            self._outbox.put(_Queued(outcome))

    def _new_outbox(self, linger_s: float) -> Outbox[_Queued, tuple[int, int], str]:
        """Outcomes are written by one writer (engine/runtime/outbox.py), every try queued
        while the last write was in flight in one statement; ``linger_s``: how long a write
        that follows the last closely waits for more (setting ``worker_outcome_linger_s``)."""
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
            linger_s=linger_s,
            linger_items=LINGER_ITEMS,
        )

    def _new_deferrals_outbox(self) -> Outbox[_QueuedDeferral, tuple[int, int], str]:
        """Deferrals are written by a writer of their own, every deferral queued while the
        last write was in flight in one statement (``defer_tasks``); a deferral the database
        refuses is replaced by a failure of its try alone."""
        return Outbox(
            "record deferrals",
            write=self._write_deferrals,
            substitute=_substitute_deferral_failure,
            on_written=self._deferrals_written,
            on_lost=lambda q, _exc: self._abandoned.add(q.ti_id),
            describe=lambda q: f"the deferral of task instance {q.ti_id}",
            max_items=DEFER_BATCH,
            size=lambda q: q.size,
            max_bytes=DEFER_BATCH_BYTES,
            crash_before="worker.defer.before_write",
            crash_after="worker.defer.after_write",
            observe=self._observe_deferrals,
        )

    def _observe_write(self, size: int, duration_s: float) -> None:
        self._metrics.write_batch.labels("task_outcomes").observe(size)
        self._metrics.write_duration.labels("task_outcomes").observe(duration_s)

    def _observe_deferrals(self, size: int, duration_s: float) -> None:
        self._metrics.write_batch.labels("task_deferrals").observe(size)
        self._metrics.write_duration.labels("task_deferrals").observe(duration_s)

    async def _write_deferrals(self, batch: list[_QueuedDeferral]) -> dict[tuple[int, int], str]:
        # The lines these tries logged go first (nothing when they logged none).
        await self._logs.flush([(q.ti_id, q.try_number) for q in batch])
        states: dict[tuple[int, int], str] = {}
        by_worker: dict[int, list[_QueuedDeferral]] = collections.defaultdict(list)
        failures: list[TaskOutcome] = []
        for q in batch:
            if q.failure is None:
                by_worker[q.worker_id].append(q)
            else:
                failures.append(q.failure)
        for worker_id, deferring in by_worker.items():
            parked = await self._store.defer_tasks(
                worker_id, [(q.ti_id, q.deferral) for q in deferring]
            )
            states.update({(ti_id, worker_id): "deferred" for ti_id in parked})
        if failures:  # written alone (the outbox substitutes one item at a time)
            states.update(await self._end_tries(failures))
        return states

    def _deferrals_written(
        self, batch: list[_QueuedDeferral], states: dict[tuple[int, int], str]
    ) -> None:
        for queued in batch:
            queued.state = states.get((queued.ti_id, queued.worker_id))
            queued.done.set()
        self._count_states(states)

    async def _write_outcomes(self, batch: list[_Queued]) -> dict[tuple[int, int], str]:
        # The lines these tries logged go first (nothing when they logged none): a reader
        # that sees a try ended has every line it logged before its outcome.
        await self._logs.flush([(q.outcome.ti_id, q.outcome.try_number) for q in batch])
        return await self._end_tries([q.outcome for q in batch])

    async def _end_tries(self, outcomes: list[TaskOutcome]) -> dict[tuple[int, int], str]:
        """End these tries in one statement and settle what that changed downstream; the
        state each try of the batch now has, by (task instance, worker)."""
        finished = await self._store.finish_tasks(outcomes)
        await settle(self._store, finished)
        # (worker_id None: a task a branch skipped, not a try of this batch)
        return {(f.id, f.worker_id): f.state for f in finished if f.worker_id is not None}

    def _written(self, batch: list[_Queued], states: dict[tuple[int, int], str]) -> None:
        for queued in batch:
            queued.state = states.get((queued.outcome.ti_id, queued.outcome.worker_id))
            queued.done.set()
        self._count_states(states)

    def _count_states(self, states: dict[tuple[int, int], str]) -> None:
        for state, n in collections.Counter(states.values()).items():
            self._metrics.task_outcomes.labels(state).inc(n)

    def _outcome_lost(self, queued: _Queued, _exc: Exception) -> None:
        """Not even a failure could be stored: the try is left to the reaper."""
        self._abandoned.add(queued.outcome.ti_id)

    async def write(self, batch: list[_Queued]) -> None:
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


def _deferral(ti: ClaimedTask, deferred: Deferred) -> Deferral:
    """What the store keeps of a deferral: only try ``ti.try_number`` may write it."""
    trigger = deferred.trigger
    return Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name=deferred.method_name,
        method_kwargs=deferred.method_kwargs,
        timeout_s=deferred.timeout_s,
        try_number=ti.try_number,
        line=TryLogs.deferral_line(
            trigger.classpath,
            trigger.kwargs,
            deferred.method_name,
            deferred.timeout_s,
            trigger.dedup_key is not None,
        ),
    )
