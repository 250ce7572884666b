"""The triggerer: one event loop that runs up to ``capacity`` trigger coroutines at once.

It claims unowned triggers in large batches (woken by ``NOTIFY``, polling as the
backstop), rebuilds each from its ``(classpath, kwargs)`` and runs its ``run()`` as
an asyncio task named after the trigger. The first event is queued; a writer task
writes queued outcomes in batches, each batch one transaction in which every
waiting task instance moves by a conditional update, and only while this triggerer
still owns the trigger with the fencing token it claimed. Deferral deadlines are
loop timers. A lease, renewed on the database clock by a thread with a connection of
its own (engine/lease.py), says the triggerer is alive; that connection's session holds
the triggerer's advisory lock, so its death is seen at once and other triggerers adopt
its triggers within a fraction of a second (or when the lease lapses).

Trigger code is untrusted: whatever it raises (SystemExit, KeyboardInterrupt, a
CancelledError of its own, ...) fails that trigger's tasks and nothing else. Every loop
here survives any database error, backing off (jittered) and carrying on.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import gc
import logging
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskStatus

from engine import logs, usercode
from engine.config import (
    DEFAULT_BLOCKED_LOOP_S,
    DEFAULT_CLAIM_BATCH,
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_TRIGGERER_CAPACITY,
    DEFAULT_TRIGGERER_LEASE_S,
    DEFAULT_TRIGGERER_MAX_BLOCK_S,
)
from engine.crashpoints import crash_point
from engine.lease import LeaseKeeper
from engine.retry import REFUSED_DATA_ERRORS, Backoff, with_db_retry
from engine.security.allow import check_classpath, check_import_paths
from engine.store import (
    CHANNEL_DEADLINES,
    CHANNEL_TRIGGERS,
    ClaimedTrigger,
    Listener,
    Store,
    TriggerOutcome,
)
from engine.wakeup import Wakeup
from engine.watchdog import BlockReport, LoopWatchdog
from triggers.base import (
    MAX_PAYLOAD_BYTES,
    BaseTrigger,
    TaskEndEvent,
    TriggerEvent,
    TriggerSerializationError,
    decode_value,
    encode_value,
    import_trigger_class,
    rebuild_trigger,
)

__all__ = ["Triggerer"]

log = logging.getLogger(__name__)

#: Outcomes written per transaction at most. asyncpg encodes the arrays on the loop (~50 us an
#: outcome): 1,000 keeps that under ~60 ms of loop time per write.
WRITE_BATCH = 1000
#: Claimed triggers started per loop iteration.
START_SLICE = 1000


def _trigger_of(task_name: str | None) -> tuple[int, int] | None:
    """The trigger id and fence in a trigger task's name ("trigger-<id>:<fence>"): the
    watchdog's thread learns them without reading the loop's state."""
    if not task_name or not task_name.startswith("trigger-"):
        return None
    trigger_id, _, fence = task_name[len("trigger-") :].partition(":")
    if not trigger_id.isdigit() or not fence.isdigit():
        return None
    return int(trigger_id), int(fence)


def _culprit(task_name: str | None) -> str:
    of = _trigger_of(task_name)
    if of is not None:
        return f"trigger {of[0]}"
    return task_name or "(no task: a callback)"


def _cancelled_by_us() -> bool:
    """The current task is being cancelled by the triggerer (not by trigger code raising
    CancelledError of its own, as a cancelled inner task does)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _Held:
    """One trigger this triggerer runs."""

    __slots__ = ("classpath", "fence", "task", "timer")

    def __init__(self, fence: int, classpath: str) -> None:
        self.fence = fence
        self.classpath = classpath
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None


class Triggerer:
    """Runs trigger coroutines; see the module docstring."""

    def __init__(
        self,
        store: Store,
        *,
        capacity: int = DEFAULT_TRIGGERER_CAPACITY,
        lease_s: float = DEFAULT_TRIGGERER_LEASE_S,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        claim_batch: int = DEFAULT_CLAIM_BATCH,
        blocked_loop_s: float = DEFAULT_BLOCKED_LOOP_S,
        cleanup_timeout_s: float = 5.0,
        cancel_blocking_after: int = 0,
        max_block_s: float = DEFAULT_TRIGGERER_MAX_BLOCK_S,
        allow: Callable[[str], bool] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.store = store
        self.capacity = capacity
        self.lease_s = lease_s
        self.poll_interval_s = poll_interval_s
        self.claim_batch = claim_batch
        self.blocked_loop_s = blocked_loop_s
        self.cleanup_timeout_s = cleanup_timeout_s
        #: Cancel a trigger (and fail its tasks) the n-th time it blocks the loop; 0 = never.
        self.cancel_blocking_after = cancel_blocking_after
        #: A trigger that blocks the loop longer than this is failed (from another thread).
        self.max_block_s = max_block_s
        self._lease: LeaseKeeper | None = None
        self._allow = allow
        self._block_counts: dict[int, int] = {}
        #: One string object per classpath, shared by every trigger of that class.
        self._classpaths: dict[str, str] = {}
        self._classes: dict[str, type[BaseTrigger]] = {}
        self._frozen_at = 0
        self.id: int | None = None
        self.held: dict[int, _Held] = {}
        self.peak_held = 0
        self.fired = 0
        self.blocks: list[BlockReport] = []
        self._outbox: list[TriggerOutcome] = []
        self._due: set[int] = set()
        self._claim_wake = Wakeup()
        self._write_wake = Wakeup()
        self._due_wake = Wakeup()
        self._flushed = Wakeup()
        #: Outcomes in the write in flight (0: none).
        self._in_flight = 0
        #: Triggers ever taken into ``held`` and let go from it: the lease loop compares the
        #: database's count with ``held`` knowing what changed while it asked.
        self._taken = 0
        self._let_go = 0
        self._stopping = False
        self._claiming = False
        #: The last claim stopped at capacity: unowned triggers may wait for room here.
        self._full = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        """Graceful stop: write pending events, cancel the triggers, release them to others.
        Safe before ``run`` and more than once."""
        self._stopping = True
        self._claim_wake.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._stopping = False
        self._loop = asyncio.get_running_loop()
        usercode.install(self._loop)
        watchdog = LoopWatchdog(
            self._loop,
            threshold_s=self.blocked_loop_s,
            on_block=self._on_block,
            limit_s=self.max_block_s,
            on_limit=self._on_limit,
        )
        lease = self._lease = LeaseKeeper(
            self.store.url,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            capacity=self.capacity,
            lease_s=self.lease_s,
            loop=self._loop,
            on_registered=self._on_registered,
            on_reaped=self._claim_wake.set,
            loop_lag_s=watchdog.lag_s,
            # The blocker is failed at max_block_s; the lease is renewed for two leases
            # more, then lapses, letting the triggers go to others if the loop is blocked
            # for good.
            max_unresponsive_s=self.max_block_s + 2 * self.lease_s,
        )
        listener = self.store.listener(CHANNEL_TRIGGERS, CHANNEL_DEADLINES)
        listener.on_notify(self._on_notify)
        watchdog.start()
        lease.start()
        try:
            await self._ensure_listening(listener)
            while self.id is None and not self._stopping:
                await self._claim_wake.wait(None)  # set by _on_registered (and stop)
            if self.id is None:
                return
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._writer_loop, name="triggerer-writer")
                tg.start_soon(self._deadline_loop, name="triggerer-deadlines")
                tg.start_soon(self._ownership_loop, listener, name="triggerer-ownership")
                task_status.started()
                await self._claim_loop()
                await self._drain_outbox()
                tg.cancel_scope.cancel()
        finally:
            watchdog.stop()
            with anyio.move_on_after(self.cleanup_timeout_s + 5, shield=True):
                await self._cancel_all()
                await listener.close()
                if self.id is not None:
                    try:
                        released = await self.store.release_triggerer(self.id)
                        log.info("triggerer %s released %d trigger(s)", self.id, released)
                    except Exception as exc:
                        log.warning(
                            "could not release triggers (%s); they are adopted once this "
                            "process's lease connection closes",
                            exc,
                        )
                # Closing the lease connection frees the lock: peers reap what is left.
                await anyio.to_thread.run_sync(lease.stop)
            log.info("triggerer %s stopped", self.id)

    def _on_registered(self, triggerer_id: int) -> None:
        """On the loop: the lease thread registered this triggerer (again)."""
        previous, self.id = self.id, triggerer_id
        if previous is not None and previous != triggerer_id:
            log.error(
                "triggerer %s lost its registration (its lease connection dropped, or the "
                "loop was blocked for over %.1fs) and its triggers were freed for adoption; "
                "dropping the %d it ran and going on as triggerer %s",
                previous,
                self.max_block_s + 2 * self.lease_s,
                len(self.held),
                triggerer_id,
            )
            for trigger_id in list(self.held):
                self._drop(trigger_id)
            self._outbox.clear()
        else:
            log.info("triggerer %s started with capacity %d", triggerer_id, self.capacity)
        self._claim_wake.set()

    async def _ensure_listening(self, listener: Listener) -> None:
        try:
            await listener.ensure_connected()
        except Exception as exc:  # notifications only wake loops up; polling goes on
            log.warning("cannot LISTEN (%s: %s); polling only for now", type(exc).__name__, exc)

    async def _drain_outbox(self) -> None:
        """Write every event already produced before letting go of the triggers."""
        with anyio.move_on_after(max(self.lease_s, 5.0)):
            while self._outbox or self._in_flight:
                self._write_wake.set()
                await self._flushed.wait(None)

    async def _cancel_all(self) -> None:
        tasks = [h.task for h in self.held.values() if h.task is not None]
        for held in self.held.values():
            if held.timer is not None:
                held.timer.cancel()
            if held.task is not None:
                held.task.cancel()
        self.held.clear()
        if tasks:
            await asyncio.wait(tasks, timeout=self.cleanup_timeout_s + 1)

    # -- claiming ------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        backoff = Backoff()
        while not self._stopping:
            self._claiming = True
            try:
                await self._claim_available()
            except Exception as exc:  # a lost connection, anything: pause, then claim again
                self._claiming = False
                await backoff.wait("claim triggers", exc)
                continue
            finally:
                self._claiming = False
            backoff.reset()
            await self._claim_wake.wait(self.poll_interval_s)

    async def _claim_available(self) -> None:
        # (The lease thread reaps gone triggerers several times a second and wakes this
        # loop when that freed triggers.)
        assert self._loop is not None
        triggerer_id = self.id
        if triggerer_id is None:
            return
        room = self.capacity - len(self.held)
        asked = min(room, self.claim_batch)
        if asked <= 0 or self._stopping:
            self._full = asked <= 0
            return
        batch = await self.store.claim_triggers(triggerer_id, asked)
        crash_point("triggerer.claim.after_commit")
        self._full = False
        while batch:
            # Ask for the next batch while this one starts: the database and the loop overlap.
            room = self.capacity - len(self.held) - len(batch)
            more = len(batch) == asked
            self._full = more and room <= 0
            next_asked = min(room, self.claim_batch) if more else 0
            pending = None
            if next_asked > 0 and not self._stopping:
                pending = self._loop.create_task(
                    self.store.claim_triggers(triggerer_id, next_asked)
                )
            await self._start_batch(batch)
            log.info("claimed %d trigger(s); holding %d", len(batch), len(self.held))
            if pending is None:
                return
            # Always awaited, never cancelled: a claim that committed must be started.
            batch, asked = await pending, next_asked
            crash_point("triggerer.claim.after_commit")

    async def _start_batch(self, rows: list[ClaimedTrigger]) -> None:
        """Start claimed triggers a slice at a time, letting the loop run in between (timers
        of the triggers already held stay on time), and take them out of the garbage
        collector's generations once started."""
        await self._import_new_classes(rows)
        for first in range(0, len(rows), START_SLICE):
            for row in rows[first : first + START_SLICE]:
                self._start(row)
            self.peak_held = max(self.peak_held, len(self.held))
            await asyncio.sleep(0)  # the new tasks take their first step, up to their wait
            self._freeze()

    async def _import_new_classes(self, rows: list[ClaimedTrigger]) -> None:
        """Import the trigger classes not seen yet in a thread: a first import (aiohttp's,
        say) can take a good part of a second, which would stall every held trigger."""
        for classpath in {row.classpath for row in rows} - self._classes.keys():
            if self._allow is not None and not self._allow(classpath):
                continue
            try:
                cls = await anyio.to_thread.run_sync(import_trigger_class, classpath)
            except TriggerSerializationError:
                continue  # _start reports it, for each trigger of that classpath
            self._classes[classpath] = cls

    def _rebuild(self, classpath: str, kwargs: dict[str, Any]) -> BaseTrigger:
        """``rebuild_trigger``, importing and checking each class once per triggerer."""
        if self._allow is not None:
            check_classpath(self._allow, classpath)  # before the import
        cls = self._classes.get(classpath)
        if cls is None:
            cls = self._classes[classpath] = import_trigger_class(classpath)
        if self._allow is not None:
            check_import_paths(self._allow, classpath, cls, kwargs)  # before __init__ imports
        return rebuild_trigger(classpath, kwargs, cls)

    def _freeze(self) -> None:
        # A full collection walks every tracked object: at 100,000 waiting triggers (a dozen
        # objects each) that is a pause of a second or more on the loop, in whichever trigger
        # happened to allocate. Frozen objects are skipped by the collector and still freed by
        # reference counting when their trigger ends; the collector gets them back (and any
        # cycles among them) once the triggerer holds less than half of what it froze.
        gc.freeze()
        self._frozen_at = max(self._frozen_at, len(self.held))

    def _thaw_if_shrunk(self) -> None:
        if self._frozen_at and len(self.held) < self._frozen_at // 2:
            gc.unfreeze()
            self._frozen_at = 0

    def _start(self, row: ClaimedTrigger) -> None:
        assert self._loop is not None
        classpath = self._classpaths.setdefault(row.classpath, row.classpath)
        held = _Held(row.fence, classpath)
        self.held[row.id] = held
        self._taken += 1
        try:
            trigger = self._rebuild(classpath, decode_value(row.kwargs))
        except Exception as exc:
            self._emit(
                TriggerOutcome(
                    trigger_id=row.id,
                    fence=row.fence,
                    kind="failed",
                    error=f"the triggerer could not build the trigger: {exc}",
                )
            )
            return
        # The name carries the fence: the watchdog's thread fails a blocker by it.
        held.task = self._loop.create_task(
            self._watch(row.id, held, trigger), name=f"trigger-{row.id}:{row.fence}"
        )
        if row.timeout_at is not None:
            self._arm(row.id, held, row.timeout_at, row.db_now)

    # -- running one trigger -------------------------------------------------------------

    async def _watch(self, trigger_id: int, held: _Held, trigger: BaseTrigger) -> None:
        logs.bind(trigger=trigger_id, classpath=held.classpath)
        usercode.enter_user_code()  # tasks the trigger starts cannot end the process
        outcome: TriggerOutcome | None = None
        agen = None
        try:
            agen = trigger.run()
            if not hasattr(agen, "__anext__"):
                close = getattr(agen, "close", None)
                if close is not None:
                    close()  # a coroutine (async def without yield): never awaited, closed
                raise TypeError(
                    f"{held.classpath}.run() must be an async generator (async def with yield), "
                    f"got {type(agen).__name__}"
                )
            event = await agen.__anext__()
            outcome = self._outcome(trigger_id, held, event)
        except StopAsyncIteration:
            outcome = self._failed(
                trigger_id, held, f"trigger {held.classpath} returned without yielding an event"
            )
        except BaseException as exc:
            # Anything trigger code raises (SystemExit, KeyboardInterrupt, GeneratorExit, a
            # CancelledError of its own) fails its tasks and ends nothing else; only the
            # triggerer's own cancellation of this task ends it without an outcome.
            if _cancelled_by_us():
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            outcome = self._failed(
                trigger_id,
                held,
                f"trigger {held.classpath} raised:\n"
                + "".join(traceback.format_exception(exc)).rstrip(),
            )
        finally:
            if outcome is not None:
                self._emit(outcome)
            await self._close(trigger, agen, held)

    async def _close(self, trigger: BaseTrigger, agen: object, held: _Held) -> None:
        try:
            async with asyncio.timeout(self.cleanup_timeout_s):
                aclose = getattr(agen, "aclose", None)
                if aclose is not None:
                    await aclose()
                await trigger.cleanup()
        except TimeoutError:
            log.warning(
                "cleanup of %s did not finish within %.1fs; abandoned",
                held.classpath,
                self.cleanup_timeout_s,
            )
        except BaseException as exc:  # trigger code: whatever it raises ends nothing else
            if isinstance(exc, asyncio.CancelledError) and _cancelled_by_us():
                raise
            log.error(
                "cleanup of %s raised %s",
                held.classpath,
                "".join(traceback.format_exception(exc)).rstrip(),
            )

    def _failed(self, trigger_id: int, held: _Held, error: str) -> TriggerOutcome:
        log.error("%s", error)
        return TriggerOutcome(trigger_id=trigger_id, fence=held.fence, kind="failed", error=error)

    def _outcome(self, trigger_id: int, held: _Held, event: object) -> TriggerOutcome:
        if not isinstance(event, TriggerEvent):
            return self._failed(
                trigger_id,
                held,
                f"trigger {held.classpath} yielded {type(event).__name__}, not a TriggerEvent",
            )
        if isinstance(event, TaskEndEvent) and event.state not in ("success", "failed", "skipped"):
            return self._failed(
                trigger_id,
                held,
                f"trigger {held.classpath} yielded a bare {type(event).__name__}, which says "
                "neither how the task ends nor why: yield TaskSuccessEvent, TaskFailedEvent or "
                "TaskSkippedEvent",
            )
        if isinstance(event, TaskEndEvent) and event.state == "failed":
            reason = event.payload if event.payload is not None else "no reason given"
            return TriggerOutcome(
                trigger_id=trigger_id,
                fence=held.fence,
                kind="failed",
                error=f"trigger {held.classpath} failed the task: {reason}",
            )
        try:
            payload = encode_value(event.payload)
        except (TypeError, ValueError, OverflowError) as exc:
            return self._failed(
                trigger_id,
                held,
                f"trigger {held.classpath} yielded an event whose payload cannot be stored: {exc}",
            )
        if len(payload) > MAX_PAYLOAD_BYTES:
            return self._failed(
                trigger_id,
                held,
                f"trigger {held.classpath} yielded a payload of {len(payload)} bytes, over the "
                f"limit of {MAX_PAYLOAD_BYTES}",
            )
        kind = event.state if isinstance(event, TaskEndEvent) else "event"
        return TriggerOutcome(trigger_id=trigger_id, fence=held.fence, kind=kind, payload=payload)

    def _emit(self, outcome: TriggerOutcome) -> None:
        self._outbox.append(outcome)
        self._write_wake.set()

    # -- writing outcomes ----------------------------------------------------------------

    async def _writer_loop(self) -> None:
        backoff = Backoff()
        while True:
            await self._write_wake.wait(None)
            while self._outbox:
                assert self.id is not None
                batch = self._outbox[:WRITE_BATCH]
                del self._outbox[:WRITE_BATCH]
                self._in_flight = len(batch)
                crash_point("triggerer.fire.before_write")
                try:
                    accepted = await self._write(self.id, batch)
                except Exception as exc:  # not transient, not about the data: keep the
                    self._outbox[:0] = batch  # batch, pause, and try it again
                    await backoff.wait("write trigger events", exc)
                    continue
                finally:
                    self._in_flight = 0
                crash_point("triggerer.fire.after_write")
                backoff.reset()
                for outcome in batch:
                    held = self.held.get(outcome.trigger_id)
                    # (A trigger claimed again meanwhile, under a new fence, is a new run of
                    # it: this outcome is not its to end.)
                    if held is not None and held.fence == outcome.fence:
                        del self.held[outcome.trigger_id]
                        self._let_go += 1
                        if held.timer is not None:
                            held.timer.cancel()
                    if outcome.trigger_id not in accepted:
                        log.warning(
                            "outcome of trigger %s refused: this triggerer no longer owns it "
                            "(its lease lapsed and another triggerer adopted it)",
                            outcome.trigger_id,
                        )
                self.fired += len(accepted)
                self._thaw_if_shrunk()
                log.debug("wrote %d outcome(s)", len(batch))
                if self._full:
                    self._claim_wake.set()  # room again for the backlog
            self._flushed.set()

    async def _write(self, triggerer_id: int, batch: list[TriggerOutcome]) -> set[int]:
        """Write a batch of outcomes; returns the ids of the triggers whose outcome was
        accepted. An outcome the database refuses for good (not a transient error) must not
        take the others with it: the batch is then written one by one, and an outcome whose
        data is refused is replaced by a failure of its tasks that says why."""
        try:
            accepted, _moved = await with_db_retry(
                "write trigger events",
                functools.partial(self.store.fire_triggers, triggerer_id, batch),
            )
            return accepted
        except Exception as exc:
            if len(batch) > 1:
                log.warning("writing %d outcomes failed (%s); writing each alone", len(batch), exc)
                accepted = set()
                for outcome in batch:
                    accepted |= await self._write(triggerer_id, [outcome])
                return accepted
            if not isinstance(exc, REFUSED_DATA_ERRORS):
                raise  # neither transient nor about this outcome's data: stop, loudly
            (outcome,) = batch
            log.error(
                "the outcome of trigger %s could not be stored (%s: %s); failing its tasks",
                outcome.trigger_id,
                type(exc).__name__,
                exc,
            )
            substitute = TriggerOutcome(
                trigger_id=outcome.trigger_id,
                fence=outcome.fence,
                kind="failed",
                error=f"the trigger's outcome could not be stored: {type(exc).__name__}: {exc}",
            )
            accepted, _moved = await with_db_retry(
                "write a substitute trigger failure",
                functools.partial(self.store.fire_triggers, triggerer_id, [substitute]),
            )
            return accepted

    # -- deferral deadlines --------------------------------------------------------------

    def _arm(
        self, trigger_id: int, held: _Held, deadline: dt.datetime, db_now: dt.datetime
    ) -> None:
        assert self._loop is not None
        if held.timer is not None:
            held.timer.cancel()
        delay = (deadline - db_now).total_seconds()
        held.timer = self._loop.call_at(self._loop.time() + delay, self._deadline, trigger_id)

    def _deadline(self, trigger_id: int) -> None:
        self._due.add(trigger_id)
        self._due_wake.set()

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel != CHANNEL_DEADLINES:
            self._claim_wake.set()
        elif payload.isdigit() and int(payload) in self.held:
            # A task joined a trigger held here with an earlier deadline than its timer's: a
            # deadline pass re-reads the trigger's earliest deadline and re-arms the timer.
            self._deadline(int(payload))

    async def _deadline_loop(self) -> None:
        backoff = Backoff()
        while True:
            await self._due_wake.wait(None)
            due = [tid for tid in self._due if tid in self.held]
            self._due.clear()
            if not due:
                continue
            try:
                await self._pass_deadlines(due)
            except Exception as exc:  # keep the deadlines for the next pass
                self._due.update(due)
                self._due_wake.set()
                await backoff.wait("time out deferrals", exc)
                continue
            backoff.reset()

    async def _pass_deadlines(self, due: list[int]) -> None:
        """End the deferrals of ``due`` past their deadline, re-arm the others' timers, and
        drop the triggers nobody waits on any more."""
        rows = await with_db_retry(
            "time out deferrals", functools.partial(self.store.timeout_deferrals, due)
        )
        for row in rows:
            log.warning(
                "task instance %s timed out waiting on trigger %s (now %s)",
                row["id"],
                row["trigger_id"],
                row["state"],
            )
        waiters = await with_db_retry(
            "read trigger waiters", functools.partial(self.store.trigger_waiters, due)
        )
        unused = []
        for trigger_id, waiting, deadline, db_now in waiters:
            held = self.held.get(trigger_id)
            if held is None:
                continue
            if waiting == 0:
                unused.append(trigger_id)
            elif deadline is not None:
                self._arm(trigger_id, held, deadline, db_now)
        if unused and self.id is not None:
            dropped = await with_db_retry(
                "drop unused triggers",
                functools.partial(self.store.delete_owned_triggers, self.id, unused),
            )
            joined: set[int] = set()
            if len(dropped) < len(unused):
                # The drop refused some: a task joined them meanwhile (keep running them,
                # timed for the new waiters), or this triggerer no longer owns them.
                refused = [tid for tid in unused if tid not in dropped]
                again = await with_db_retry(
                    "read trigger waiters",
                    functools.partial(self.store.trigger_waiters, refused),
                )
                for trigger_id, waiting, deadline, db_now in again:
                    held = self.held.get(trigger_id)
                    if held is not None and waiting > 0:
                        joined.add(trigger_id)
                        if deadline is not None:
                            self._arm(trigger_id, held, deadline, db_now)
            for trigger_id in unused:
                if trigger_id not in joined:
                    self._drop(trigger_id)

    def _drop(self, trigger_id: int) -> None:
        """Stop running a trigger without writing anything (nobody waits, or not ours)."""
        held = self.held.pop(trigger_id, None)
        if held is None:
            return
        self._let_go += 1
        if held.timer is not None:
            held.timer.cancel()
        if held.task is not None:
            held.task.cancel()
        if self._full:
            self._claim_wake.set()

    # -- ownership (the lease itself is kept by engine/lease.py) -------------------------

    async def _ownership_loop(self, listener: Listener) -> None:
        backoff = Backoff()
        while True:
            await anyio.sleep(self.lease_s / 3)
            try:
                await self._check_ownership()
            except Exception as exc:
                await backoff.wait("check the triggers this triggerer owns", exc)
                continue
            backoff.reset()
            await self._ensure_listening(listener)

    async def _check_ownership(self) -> None:
        """Compare what the database says this triggerer owns with what runs here."""
        triggerer_id = self.id
        if triggerer_id is None:
            return
        taken, let_go = self._taken, self._let_go
        owned = await self.store.count_owned_triggers(triggerer_id)
        if self.id != triggerer_id:
            return  # registered again meanwhile: everything held was dropped
        # The count is of the moment the statement ran: triggers let go of or taken since
        # (events written, claims started) and outcomes being written account for a
        # difference without anything being wrong.
        if owned > len(self.held) + (self._let_go - let_go) and not self._claiming:
            await self._release_unheld()
        elif owned + self._in_flight + (self._taken - taken) < len(self.held):
            still = await self.store.owned_triggers(triggerer_id)
            if self.id != triggerer_id:
                return
            for trigger_id, held in list(self.held.items()):
                if still.get(trigger_id) != held.fence:
                    if held.task is not None and not held.task.done():
                        # (A finished trigger here is one whose event was just written.)
                        log.warning(
                            "trigger %s is no longer this triggerer's in the database "
                            "(removed or taken over); stopping it without writing an event",
                            trigger_id,
                        )
                    self._drop(trigger_id)

    async def _release_unheld(self) -> None:
        """Give back triggers the database says are ours but that run nowhere here.

        No path is meant to leave such triggers; if one does, they would wait unseen for as
        long as this triggerer lives. Releasing them lets any triggerer claim them again."""
        triggerer_id = self.id
        assert triggerer_id is not None
        still = await self.store.owned_triggers(triggerer_id)
        if self._claiming or self.id != triggerer_id:
            return  # a claim started meanwhile: its rows may not be held yet
        unheld = [trigger_id for trigger_id in still if trigger_id not in self.held]
        released = await self.store.release_triggers(triggerer_id, unheld) if unheld else set()
        # (An event written meanwhile deletes its trigger: such ids are not released.)
        if released:
            log.warning(
                "%d trigger(s) were owned by triggerer %s in the database but not running "
                "here (first: %s); released them to be claimed again",
                len(released),
                triggerer_id,
                sorted(released)[:5],
            )

    # -- a blocked loop ------------------------------------------------------------------

    def _on_block(self, report: BlockReport) -> None:
        """Runs on the watchdog's thread: reads nothing the loop owns (the task's name says
        which trigger blocks); what needs the loop's state hops to it."""
        assert self._loop is not None
        if not report.ended:
            log.warning(
                "event loop blocked for over %.3fs by %s at %s; trigger code must not block "
                "(use await, or run blocking calls in a thread)",
                report.duration_s,
                _culprit(report.task_name),
                report.location,
            )
        self._loop.call_soon_threadsafe(self._block_seen, report)

    def _on_limit(self, report: BlockReport) -> None:
        """Runs on the watchdog's thread while the loop is still blocked past ``max_block_s``:
        the blocker's failure is written from the lease thread, fenced, at once (the loop
        cannot write it), so that no triggerer starts it again."""
        assert self._loop is not None
        of = _trigger_of(report.task_name) if report.stable else None
        if of is None:
            log.error(
                "event loop blocked for over %.1fs (triggerer_max_block_s) by %s at %s, not by "
                "one trigger: nothing to fail",
                self.max_block_s,
                _culprit(report.task_name),
                report.location,
            )
            return
        trigger_id, fence = of
        reason = (
            f"trigger {trigger_id} was failed: it blocked the triggerer's event loop for over "
            f"{self.max_block_s:g}s, the limit (setting triggerer_max_block_s), at "
            f"{report.location}; trigger code must not block (use await, or run blocking "
            "calls in a thread)"
        )
        if self._lease is not None:
            self._lease.fail_trigger(trigger_id, fence, reason)
        self._loop.call_soon_threadsafe(self._blocker_failed, trigger_id, fence)

    def _blocker_failed(self, trigger_id: int, fence: int) -> None:
        """On the loop, once it runs again: stop the trigger whose failure was written."""
        held = self.held.get(trigger_id)
        if held is not None and held.fence == fence:
            log.error(
                "stopped trigger %s (%s): it blocked the event loop past the limit of %gs",
                trigger_id,
                held.classpath,
                self.max_block_s,
            )
            self._drop(trigger_id)

    def _block_seen(self, report: BlockReport) -> None:
        """On the loop: record a block, and count an ended one against its trigger."""
        if not report.ended:
            self.blocks.append(report)
            return
        of = _trigger_of(report.task_name)
        held = self.held.get(of[0]) if of is not None else None
        if of is None or held is None or held.fence != of[1]:
            held = None
        culprit = (
            f"trigger {of[0]} ({held.classpath})"
            if of is not None and held is not None
            else _culprit(report.task_name)
        )
        if not report.stable:
            # Different tasks were running each time the watchdog looked: the loop was busy
            # (many callbacks at once, a garbage collection), not blocked by one trigger.
            log.warning(
                "event loop was busy for %.3fs with many callbacks (first seen: %s)",
                report.duration_s,
                culprit,
            )
            return
        log.warning(
            "event loop was blocked for %.3fs by %s at %s",
            report.duration_s,
            culprit,
            report.location,
        )
        if of is None or held is None or self.cancel_blocking_after <= 0:
            return
        # Only a block seen at least twice, in the same trigger each time, counts against it.
        if report.samples < 2:
            return
        trigger_id = of[0]
        count = self._block_counts.get(trigger_id, 0) + 1
        self._block_counts[trigger_id] = count
        if count >= self.cancel_blocking_after:
            reason = (
                f"trigger {held.classpath} was cancelled: it blocked the triggerer's event loop "
                f"{count} time(s) (last for {report.duration_s:.3f}s at {report.location})"
            )
            self._cancel_blocker(trigger_id, held, reason)

    def _cancel_blocker(self, trigger_id: int, held: _Held, reason: str) -> None:
        """On the loop: end a repeat offender; its tasks fail with the reason."""
        if self.held.get(trigger_id) is not held or held.task is None or held.task.done():
            return
        log.error("%s", reason)
        self._block_counts.pop(trigger_id, None)
        self._emit(
            TriggerOutcome(trigger_id=trigger_id, fence=held.fence, kind="failed", error=reason)
        )
        held.task.cancel()

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        return {
            "held": len(self.held),
            "peak_held": self.peak_held,
            "fired": self.fired,
            "outbox": len(self._outbox),
            "time": time.time(),
        }
