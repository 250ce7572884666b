"""One try of a task instance: its operator, its context, its method, and how it ended.

:meth:`Attempts.run` finds the operator (importing its DAG file off the loop when it
changed), builds the context with the templated fields rendered, and calls ``execute`` or
the resumed method: a plain ``def`` in a worker thread, an ``async def`` on the loop, either
in a child process for ``isolation="process"`` (``isolation.py``). Whatever happens, it
returns one :data:`~engine.worker.outcomes.TryOutcome` and raises nothing but the worker's
own cancellation (a stop request): the task's errors, the engine's errors before the call
(a DAG that fails to import, a template that fails to render) and the execution_timeout
are outcomes like the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import msgspec

from engine.dags.dagbag import DagBag
from engine.runtime.crashpoints import crash_point
from engine.runtime.retry import with_db_retry
from engine.store import ClaimedTask, Store
from engine.usercode import guard as usercode
from engine.worker import isolation, mapping, templating, xcom
from engine.worker.callbacks import call_callbacks
from engine.worker.outcomes import (
    Raised,
    Returned,
    TryOutcome,
    describe,
    outcome_of_call,
    outcome_of_coroutine,
    outcome_of_error,
    timed_out,
    worker_cancelled,
)
from engine.worker.trylogs import TryLogs
from operators.assets import OutletEventAccessors
from operators.base import BaseOperator, Context, MappedOperator
from operators.callbacks import callbacks_of
from operators.xcom import current_context
from triggers.base import decode_value, encode_value
from triggers.values import encode_data

__all__ = ["Attempts"]

log = logging.getLogger("engine.worker")  # the process's logger


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


class Attempts:
    """Runs the tries of one worker. ``stopping``: the reasons of the tries told to stop, by
    (task instance, try), as the worker keeps them; ``freed(stopped)``: a thread that held a
    slot past its try ended (``stopped``: its try had been told to stop)."""

    def __init__(
        self,
        store: Store,
        dagbag: DagBag,
        logs: TryLogs,
        *,
        slots: int,
        default_deferrable: bool,
        kill_grace_s: float,
        stopping: Mapping[tuple[int, int], str],
        freed: Callable[[bool], None],
        xcom_max_bytes: int,
        callback_timeout_s: float = 60.0,
        max_map_length: int = 1024,
    ) -> None:
        self._store = store
        self._dagbag = dagbag
        self._logs = logs
        self._default_deferrable = default_deferrable
        self._kill_grace_s = kill_grace_s
        self._stopping = stopping
        self._freed = freed
        #: Setting xcom_max_bytes: the largest return value or pushed XCom, encoded.
        self._xcom_max_bytes = xcom_max_bytes
        #: Setting callback_timeout_s: how long on_execute_callback may run.
        self._callback_timeout_s = callback_timeout_s
        #: Setting max_map_length: the most instances of one mapped task.
        self._max_map_length = max_map_length
        self._limiter = anyio.CapacityLimiter(slots)
        #: The event loop the tries run on (the worker's).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dag_lock = anyio.Lock()
        #: Threads of tries failed at their execution_timeout (or told to stop) that still run
        #: (Python cannot stop a thread), by (task instance, try): each keeps its slot until
        #: it ends.
        self.lingering: dict[tuple[int, int], _Lingering] = {}

    async def run(
        self, ti: ClaimedTask, worker_id: int, *, claimed_at: float | None = None
    ) -> TryOutcome:
        """Run one try of ``ti``; how it ended. ``claimed_at``: when the reply of the claim
        that brought it arrived (``time.monotonic()``): a check of its DAG file made since
        then stands for this try's (the tries of one claim share one ``stat``)."""
        usercode.enter_user_code()  # tasks an async execute starts cannot end the process
        try:
            outcome = await self._run(ti, worker_id, claimed_at)
            # (its size checked, what it pushed written before the outcome)
            return await xcom.finish_try(self._store, ti, worker_id, outcome, self._xcom_max_bytes)
        except BaseException as exc:
            if worker_cancelled(exc):
                raise  # the worker is cancelling this try (a stop)
            return outcome_of_error(exc)

    async def _run(self, ti: ClaimedTask, worker_id: int, claimed_at: float | None) -> TryOutcome:
        op = await self._operator(ti, claimed_at)
        if isinstance(op, MappedOperator):
            # Expand it (map index -1), or build the operator of this instance.
            made = await mapping.prepare(op, ti, self._store, self._max_map_length)
            if not isinstance(made, BaseOperator):
                return made
            op = made
        context = await self._context(op, ti, worker_id)
        outlets: OutletEventAccessors = context["outlet_events"]
        outcome = await self._call(op, ti, context)
        if isinstance(outcome, Returned) and op.outlets and outcome.asset_events is None:
            # (the events its success records, written with it: finish_tasks)
            try:
                events = outlets.events()
            except ValueError as exc:
                return Raised(f"task {ti.dag_id}.{ti.task_id}: {exc}", no_retry=True)
            return msgspec.structs.replace(outcome, asset_events=events)
        return outcome

    async def _call(self, op: BaseOperator, ti: ClaimedTask, context: Context) -> TryOutcome:
        """Call the try's method (execute, or the one a deferral resumes at)."""
        fn, kwargs = _method(op, ti)
        remaining = _remaining_s(ti)
        if remaining is not None and remaining <= 0:
            return timed_out(ti)
        if ti.next_method:
            crash_point("worker.resume.before_method")
        elif op.on_execute_callback is not None:  # (before execute, not before a resume)
            with current_context(context):
                await call_callbacks(
                    callbacks_of(op.on_execute_callback),
                    (context,),
                    timeout_s=self._callback_timeout_s,
                    what="on_execute_callback",
                )
        if getattr(op, "isolation", "none") == "process":
            return await self._in_child(op, ti, context, kwargs, remaining)
        call = functools.partial(fn, context, **kwargs)
        task = f"{ti.dag_id}.{ti.task_id}"
        with current_context(context):  # get_current_context(); threads get a copy
            if not inspect.iscoroutinefunction(fn):
                in_thread = functools.partial(outcome_of_call, call, task=task)
                return await self._in_thread(ti, in_thread, remaining)
            if remaining is None:  # (no timeout: no cancel scope to enter and leave)
                return await outcome_of_coroutine(call, task=task)
            with anyio.move_on_after(remaining):
                return await outcome_of_coroutine(call, task=task)
        return timed_out(ti)

    async def _operator(self, ti: ClaimedTask, claimed_at: float | None = None) -> BaseOperator:
        bag = self._dagbag
        if bag.is_current(ti.dag_id, checked_since=claimed_at):
            # (The DAG as loaded: get_task would look at its file a second time.)
            dag = bag.dags.get(ti.dag_id)
            if dag is not None:
                return dag.get_task(ti.task_id).fresh_copy()
        else:
            # Importing DAG files is blocking work: keep it off the loop, one at a time. (The
            # tries that waited for another's import find it loaded: no turn in a thread each.)
            async with self._dag_lock:
                if not bag.is_current(ti.dag_id):
                    await anyio.to_thread.run_sync(bag.get_dag, ti.dag_id)
        return bag.get_task(ti.dag_id, ti.task_id).fresh_copy()

    async def _context(self, op: BaseOperator, ti: ClaimedTask, worker_id: int) -> Context:
        """The call's context, with ``op``'s templated fields rendered in place (before
        ``execute`` and again before a resumed method, from the same values; what they
        rendered to is stored at the start of the try): the worker's one visit to
        ``templating``."""
        loop = self._loop
        if loop is None or not loop.is_running():
            # (Asked once: on Python 3.11 asking the running loop costs a getpid() call.)
            loop = self._loop = asyncio.get_running_loop()
        rti = xcom.bind(ti, self._store, max_bytes=self._xcom_max_bytes, loop=loop)
        rendered = await templating.render_task(
            ti,
            op,
            store=self._store,
            default_deferrable=self._default_deferrable,
            task_instance=rti,
        )
        # XComArgs in templated fields: their values (after rendering: values are not templates)
        await xcom.resolve_refs(op, rti, rendered.fields)
        if rendered.fields is not None and not ti.next_method:
            await self._store_rendered(ti, worker_id, templating.jsonable(rendered.fields))
        return rendered.context  # type: ignore[return-value]

    async def _store_rendered(self, ti: ClaimedTask, worker_id: int, value: Any) -> None:
        """Keep what the fields rendered to; a failure to do so only costs the display."""
        try:
            await with_db_retry(
                "store rendered fields",
                lambda: self._store.set_rendered_fields(ti.id, worker_id, ti.try_number, value),
            )
        except Exception as exc:
            log.warning(
                "the rendered fields of task %s were not stored: %s: %s",
                describe(ti),
                type(exc).__name__,
                exc,
            )

    async def _in_thread(
        self, ti: ClaimedTask, call: Callable[[], TryOutcome], remaining: float | None
    ) -> TryOutcome:
        """Run ``call`` in a worker thread. Past the timeout the try fails, but the thread
        cannot be stopped: its slot stays taken (the worker counts :attr:`lingering`) until it
        ends. So does a try told to stop (its task was marked or cleared): the thread is left
        to end, its slot (and its pool's, as the database counts it) taken until then."""
        loop = asyncio.get_running_loop()
        run = _Lingering(ti)

        def body() -> TryOutcome:
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
            reason = self._stopping.get(key)
            if reason is not None and not run.ended:
                run.stopped_by = reason
                self.lingering[key] = run
                log.warning(
                    "task %s was told to stop (%s), but its thread cannot be stopped and still "
                    "runs; its slot, and its pool's, stay taken until it ends (give the task "
                    'isolation="process" to have it stopped)',
                    describe(ti),
                    reason,
                )
            raise
        if not run.ended:
            run.timed_out_at = time.monotonic()
            self.lingering[key] = run
            log.warning(
                "task %s is past its execution_timeout of %ss and is failed, but its thread "
                "cannot be stopped and still runs; its slot stays taken until it ends (give "
                'the task isolation="process" to have it stopped)',
                describe(ti),
                ti.execution_timeout_s,
            )
        return timed_out(ti, "; the thread could not be stopped and still holds its slot")

    def _thread_ended(self, run: _Lingering) -> None:
        """(On the loop.) A worker thread ended; if its try was already failed at its
        timeout, or told to stop, its slot is free now."""
        run.ended = True
        key = (run.ti.id, run.ti.try_number)
        if self.lingering.get(key) is not run:
            return
        del self.lingering[key]
        if run.stopped_by is not None:
            log.warning(
                "the thread of task %s, told to stop (%s), ended; its slot is free",
                describe(run.ti),
                run.stopped_by,
            )
        else:
            late = time.monotonic() - (run.timed_out_at or 0.0)
            log.warning(
                "the thread of task %s ended %.1fs after its execution_timeout; its slot is free",
                describe(run.ti),
                late,
            )
        self._freed(run.stopped_by is not None)

    async def _in_child(
        self,
        op: BaseOperator,
        ti: ClaimedTask,
        context: Context,
        kwargs: dict[str, Any],
        remaining: float | None,
    ) -> TryOutcome:
        """Run the call in a child process (isolation="process"), stopped at the timeout;
        the child classifies what came of it and sends that back."""
        dag = self._dagbag.get_dag(ti.dag_id)
        folder = self._dagbag.folder
        if folder is None or not dag.fileloc or not Path(dag.fileloc).is_relative_to(folder):
            return Raised(
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
            map_value=_map_value(op),
            map_resolved=list(getattr(op, "mapped_resolved", None) or []),
        )
        try:
            outcome = await isolation.run_isolated(
                request,
                timeout_s=remaining,
                kill_grace_s=self._kill_grace_s,
                on_output=self._logs.child_output,
                max_line_bytes=self._logs.max_line_bytes,
            )
        except isolation.ChildEnded as exc:
            return Raised(str(exc))
        if outcome is None:
            return timed_out(ti, "; its child process was stopped")
        return outcome


def _method(op: BaseOperator, ti: ClaimedTask) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The method to call (``execute``, or the one to resume at) and its keyword arguments
    besides the context (a resumed method's kwargs and its trigger's event)."""
    if not ti.next_method:
        return op.execute, {}
    fn = getattr(op, ti.next_method, None)
    if not callable(fn):
        raise AttributeError(
            f"cannot resume: {type(op).__qualname__} has no method {ti.next_method!r}"
        )
    kwargs = decode_value(ti.next_kwargs) if ti.next_kwargs else {}
    kwargs["event"] = decode_value(ti.next_event) if ti.next_event else None
    return fn, kwargs


def _map_value(op: BaseOperator) -> bytes | None:
    """A mapped instance's own arguments, for its child process (None: not mapped)."""
    values = getattr(op, "mapped_values", None)
    return None if values is None else encode_data(values)


def _remaining_s(ti: ClaimedTask) -> float | None:
    """Seconds left of the try's execution_timeout (counted from its start, on the database
    clock, across deferrals); None without one."""
    if ti.execution_timeout_s is None:
        return None
    elapsed = (ti.db_now - ti.try_started_at).total_seconds()
    return ti.execution_timeout_s - elapsed
