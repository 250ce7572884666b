"""Callbacks, run on a worker: ``on_execute_callback`` before a try's ``execute``, and every
other kind from a callback request (migration 0022).

An outcome whose task (or DAG) declares a callback for it writes a request in the outcome's
own transaction, whoever wrote the outcome: this worker or another, a triggerer (an event
that ended the task, a trigger's failure, a deferral or sensor timeout), the scheduler (a
zombie reaped), a refused claim, a mark. :class:`CallbackRunner` claims requests with a
lease (``claim_callbacks``), runs each request's callbacks in order, and deletes the request
(``finish_callback``). A worker killed while it holds a request loses it to another worker
once its row is reaped (or the lease passes): exactly once, unless the worker dies after a
callback ran and before the request was deleted (then it runs again: at least once).

A callback that raises, or runs past ``callback_timeout_s``, is logged with its traceback (for
a task's callback, with the lines of the try whose outcome it follows) and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from engine.dags.dagbag import DagBag
from engine.runtime import logs
from engine.runtime.crashpoints import crash_point
from engine.runtime.retry import with_db_retry
from engine.runtime.wakeup import Wakeup
from engine.store import ClaimedTask, Store
from engine.store.models.callbacks import ClaimedCallback
from engine.usercode import guard as usercode
from engine.usercode.tracebacks import format_user_exception
from engine.worker import xcom
from engine.worker.context import build_context
from engine.worker.trylogs import TryLogs
from operators.callbacks import TaskFailure, callbacks_of

__all__ = ["MAX_CLAIMS", "CallbackRunner", "call_callbacks"]

log = logging.getLogger("engine.worker")  # the process's logger

#: A request claimed this many times (its workers died running it) is given up.
MAX_CLAIMS = 3
#: The lease of a claimed request beyond its callbacks' timeout.
LEASE_MARGIN_S = 30.0
#: The context keys of a task, absent from a run's callbacks.
_TASK_KEYS = ("task_id", "try_number", "ti_id", "task", "ti", "task_instance",
              "task_instance_key_str", "first_try_at", "claimed_at")  # fmt: skip


async def call_callbacks(
    fns: Sequence[Callable[..., Any]],
    args: tuple[Any, ...],
    *,
    kwargs: dict[str, Any] | None = None,
    timeout_s: float,
    what: str,
) -> int:
    """Call each of ``fns`` with ``args`` (and ``kwargs``), in order: a ``def`` in a worker
    thread, an ``async def`` on the loop, each within ``timeout_s``. What one raises, or its
    running past the timeout, is logged (``what`` names it) and the next one runs. Returns how
    many failed."""
    failed = 0
    for fn in fns:
        name = getattr(fn, "__qualname__", repr(fn))
        call = functools.partial(fn, *args, **(kwargs or {}))
        try:
            with anyio.fail_after(timeout_s):
                if inspect.iscoroutinefunction(fn):
                    await call()
                else:
                    result = await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
                    if inspect.isawaitable(result):
                        await result
        except TimeoutError:
            failed += 1
            log.error(
                "%s %s ran past callback_timeout_s (%.1fs) and was given up (a def's thread "
                "cannot be stopped and runs on); it changes nothing",
                what,
                name,
                timeout_s,
            )
        except anyio.get_cancelled_exc_class():
            raise  # the worker's own cancellation (its stop)
        except BaseException as exc:  # user code: a SystemExit there must not end the worker
            failed += 1
            log.error(
                "%s %s failed; it changes nothing:\n%s", what, name, format_user_exception(exc)
            )
    return failed


class CallbackRunner:
    """Claims and runs a worker's callback requests, up to ``limit`` at once. ``queues``: the
    worker's (a task's callbacks run on a worker of its queue; a run's on any)."""

    def __init__(
        self,
        store: Store,
        dagbag: DagBag,
        logs: TryLogs,
        *,
        queues: Sequence[str],
        timeout_s: float,
        limit: int,
        poll_interval_s: float,
        default_deferrable: bool,
        xcom_max_bytes: int,
    ) -> None:
        self._store = store
        self._dagbag = dagbag
        self._logs = logs
        self._queues = list(queues)
        self._timeout_s = timeout_s
        self._limit = max(1, limit)
        self._poll_interval_s = poll_interval_s
        self._default_deferrable = default_deferrable
        self._xcom_max_bytes = xcom_max_bytes
        self._wake = Wakeup()
        self._stopping = False
        self._dag_lock = anyio.Lock()
        #: Requests being run now, by id.
        self.running: set[int] = set()
        #: Requests run (and deleted) by this runner.
        self.done = 0

    def wake(self) -> None:
        """A notification: a request may be waiting."""
        self._wake.set()

    def stop(self) -> None:
        """Claim nothing more (the requests being run finish)."""
        self._stopping = True
        self._wake.set()

    async def drain(self) -> None:
        """Wait until the requests being run are done."""
        while self.running:
            await self._wake.wait(0.05)

    async def run(self, worker_id: Callable[[], int | None]) -> None:
        """Claim and run requests until cancelled (the worker's task group); ``worker_id``:
        the worker's current registration."""
        failures = 0
        async with anyio.create_task_group() as tg:
            while True:
                wid = worker_id()
                free = self._limit - len(self.running)
                if wid is not None and free > 0 and not self._stopping:
                    try:
                        claimed = await self._store.claim_callbacks(
                            wid,
                            self._queues,
                            free,
                            lease_s=self._timeout_s * 2 + LEASE_MARGIN_S,
                        )
                    except Exception as exc:  # (also a registration reaped meanwhile)
                        failures += 1
                        log.warning(
                            "cannot claim callback requests (%s: %s); trying again",
                            type(exc).__name__,
                            exc,
                        )
                        await self._wake.wait(min(5.0, 0.2 * 2**failures))
                        continue
                    failures = 0
                    for request in claimed:
                        self.running.add(request.id)
                        tg.start_soon(self._run_one, request, wid, name=f"callback-{request.id}")
                    if claimed and len(claimed) == free:
                        continue
                await self._wake.wait(self._poll_interval_s)

    async def _run_one(self, request: ClaimedCallback, worker_id: int) -> None:
        try:
            crash_point("worker.callback.before_run")
            if request.claims > MAX_CLAIMS:
                log.error(
                    "callback request %s (%s of %s) was claimed %d times by workers that died "
                    "running it; given up",
                    request.id,
                    request.kind,
                    _target(request),
                    request.claims - 1,
                )
            else:
                await self._run_request(request)
            crash_point("worker.callback.after_run")
            await with_db_retry(
                "finish a callback request",
                functools.partial(self._store.finish_callback, request.id, worker_id),
            )
            self.done += 1
        except Exception:
            # The request stays; another claim runs it once its lease passes.
            log.exception("running callback request %s failed", request.id)
        finally:
            self.running.discard(request.id)
            self._wake.set()

    async def _run_request(self, request: ClaimedCallback) -> None:
        usercode.enter_user_code()
        dag = await self._dag(request.dag_id)
        if dag is None:
            log.error(
                "callback request %s (%s of %s): DAG %s is not in the DAGs folder any more; "
                "its callback cannot run",
                request.id,
                request.kind,
                _target(request),
                request.dag_id,
            )
            return
        if request.kind == "deadline":
            await self._deadline_callback(request, dag)
        elif request.kind in ("dag_success", "dag_failure"):
            await self._dag_callbacks(request, dag)
        elif request.ti_id is not None and request.task_id is not None:
            await self._task_callbacks(request, dag)

    async def _dag(self, dag_id: str) -> Any:
        try:
            if not self._dagbag.is_current(dag_id):
                async with self._dag_lock:
                    await anyio.to_thread.run_sync(self._dagbag.get_dag, dag_id)
            return self._dagbag.get_dag(dag_id)
        except Exception as exc:
            log.error("DAG %s cannot be loaded for its callback: %s: %s", dag_id,
                      type(exc).__name__, exc)  # fmt: skip
            return None

    async def _task_callbacks(self, request: ClaimedCallback, dag: Any) -> None:
        assert request.ti_id is not None
        assert request.task_id is not None
        try:
            op = dag.get_task(request.task_id).fresh_copy()
        except KeyError:
            log.error("callback request %s: task %s is not in DAG %s any more", request.id,
                      request.task_id, request.dag_id)  # fmt: skip
            return
        fns = callbacks_of(getattr(op, f"on_{request.kind}_callback", None))
        if not fns:
            return  # (the task no longer declares it)
        ti = _claimed_task(request)
        key = (ti.id, ti.try_number)
        with (
            logs.binding(dag=ti.dag_id, run=ti.run_id, task=ti.name, attempt=ti.try_number),
            self._logs.bound(ti),
        ):
            context = build_context(ti, op, dag, default_deferrable=self._default_deferrable)
            loop = asyncio.get_running_loop()
            rti = xcom.bind(ti, self._store, max_bytes=self._xcom_max_bytes, loop=loop)
            context["ti"] = context["task_instance"] = rti
            if request.error is not None:
                context["exception"] = TaskFailure(request.error)
            context["reason"] = request.kind
            log.info("running on_%s_callback (%d callable(s))", request.kind, len(fns))
            await call_callbacks(
                fns, (context,), timeout_s=self._timeout_s, what=f"on_{request.kind}_callback"
            )
        await self._logs.flush([key])

    def _run_context(self, request: ClaimedCallback, dag: Any) -> dict[str, Any]:
        no_task: Any = None
        context = build_context(
            _claimed_task(request), no_task, dag, default_deferrable=self._default_deferrable
        )
        for name in _TASK_KEYS:
            context.pop(name, None)
        return context

    def _dag_context(self, request: ClaimedCallback, dag: Any) -> dict[str, Any]:
        """A DAG callback's context: its run's, with the task instance the run's end named
        (``ti``, ``task_instance``, ``task``: for a failure, the failed task instance that
        ended last; for a success, the last by task id, as Airflow picks it), when it has one
        the DAG still declares."""
        op = None
        if request.ti_id is not None and request.task_id is not None:
            with contextlib.suppress(KeyError):
                op = dag.get_task(request.task_id).fresh_copy()
        if op is None:
            return self._run_context(request, dag)
        ti = _claimed_task(request)
        context = build_context(ti, op, dag, default_deferrable=self._default_deferrable)
        loop = asyncio.get_running_loop()
        rti = xcom.bind(ti, self._store, max_bytes=self._xcom_max_bytes, loop=loop)
        context["ti"] = context["task_instance"] = rti
        return context

    async def _dag_callbacks(self, request: ClaimedCallback, dag: Any) -> None:
        kind = "success" if request.kind == "dag_success" else "failure"
        fns = callbacks_of(getattr(dag, f"on_{kind}_callback", None))
        if not fns:
            return
        context = self._dag_context(request, dag)
        context["reason"] = "success" if kind == "success" else "task_failure"
        with logs.binding(dag=request.dag_id, run=request.run_id):
            log.info("run %s ended (%s): running the DAG's on_%s_callback", request.run_id,
                     request.run_state, kind)  # fmt: skip
            await call_callbacks(
                fns, (context,), timeout_s=self._timeout_s, what=f"DAG on_{kind}_callback"
            )

    async def _deadline_callback(self, request: ClaimedCallback, dag: Any) -> None:
        index = request.deadline_index or 0
        alerts = getattr(dag, "deadlines", [])
        if index >= len(alerts):
            log.error("callback request %s: DAG %s no longer has deadline alert %d",
                      request.id, request.dag_id, index)  # fmt: skip
            return
        alert = alerts[index]
        with logs.binding(dag=request.dag_id, run=request.run_id):
            try:
                fn = alert.resolve()
            except Exception as exc:
                log.error("deadline alert %r of DAG %s cannot be called: %s", alert,
                          request.dag_id, exc)  # fmt: skip
                return
            context = self._run_context(request, dag)
            context["reason"] = "deadline"
            context["deadline"] = {
                "deadline_time": request.deadline_at,
                "reference": alert.reference.name,
                "interval": alert.interval,
                "index": index,
            }
            kwargs = dict(alert.kwargs)
            if _accepts(fn, "context"):
                kwargs["context"] = context
            log.warning(
                "run %s of DAG %s had not ended by its deadline %s: running %r",
                request.run_id,
                request.dag_id,
                request.deadline_at.isoformat() if request.deadline_at else "?",
                alert,
            )
            await call_callbacks(
                [fn], (), kwargs=kwargs, timeout_s=self._timeout_s, what="deadline alert"
            )


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _target(request: ClaimedCallback) -> str:
    if request.task_id is not None:
        return (
            f"{request.dag_id}.{request.task_id} (run {request.run_id}, try {request.try_number})"
        )
    return f"run {request.run_id} of {request.dag_id}"


def _claimed_task(request: ClaimedCallback) -> ClaimedTask:
    """The try a request follows (or, for a run's request, its run) as a context is built from."""
    return ClaimedTask(
        id=request.ti_id or 0,
        dag_id=request.dag_id,
        run_id=request.run_id,
        task_id=request.task_id or "",
        map_index=request.map_index if request.map_index is not None else -1,
        try_number=request.try_number or 0,
        logical_date=request.logical_date,
        conf=request.conf,
        # (not the claim's time: a try's lines bound here are not a fresh try's)
        first_try_at=request.first_try_at or request.created_at,
        try_started_at=request.try_started_at or request.created_at,
        execution_timeout_s=request.execution_timeout_s,
        db_now=request.db_now,
        data_interval_start=request.data_interval_start,
        data_interval_end=request.data_interval_end,
        run_type=request.run_type,
    )
