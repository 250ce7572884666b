"""Run a whole engine inside a test: scheduler, worker and triggerer in the test's event loop,
on the test's database. Public through :mod:`engine.testing`.

.. code-block:: python

    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)             # start a run, wait for its end
        await engine.start_run(other)
        await engine.drain()                         # until nothing is runnable now
        ti = await engine.wait_for_state("other", "wait", "deferred")

:meth:`LocalEngine.drain` is arq's burst mode for a whole engine: it returns once nothing is
runnable now, nothing runs, no event is waiting to be written and no deferral deadline is due,
judged from the store's counts and the worker's and triggerer's in-memory state, re-checked
whenever a notification says something changed. It does not wait for triggers to fire (a wait
on the world could last forever): use :meth:`LocalEngine.wait_for_state` for that.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any

import anyio
import msgspec

from engine.dags.dag import DAG
from engine.dags.dagbag import DagBag
from engine.runtime.wakeup import Wakeup
from engine.scheduler.dagrecord import record_dags
from engine.scheduler.scheduler import Scheduler
from engine.store import (
    CHANNEL_DEADLINES,
    CHANNEL_FINISHED,
    CHANNEL_RUNS,
    CHANNEL_TASKS,
    CHANNEL_TRIGGERS,
    Store,
    ti_name,
)
from engine.triggerer import Triggerer
from engine.usercode.variables import bind_store
from engine.worker.worker import Worker
from triggers.connections import DEFAULT_DEFERRAL_CONN_ID, connection_defaults

__all__ = ["DEFAULT_WAIT_S", "EngineTimeout", "LocalEngine", "run_engine"]

#: How long the harness waits for anything unless told otherwise.
DEFAULT_WAIT_S = 30.0
#: Notifications wake the checks; this is only the backstop between two looks at the store.
_BACKSTOP_S = 0.05
_ENDED = frozenset({"success", "failed", "skipped", "upstream_failed"})


class EngineTimeout(AssertionError):
    """What the harness waited for did not happen in time (the message says what)."""


class LocalEngine:
    """An engine running in this process; see :func:`run_engine`."""

    def __init__(
        self,
        store: Store,
        dagbag: DagBag,
        worker: Worker,
        triggerer: Triggerer,
        scheduler: Scheduler,
        *,
        running: Collection[str],
    ) -> None:
        self.store = store
        self.dagbag = dagbag
        self.worker = worker
        self.triggerer = triggerer
        self.scheduler = scheduler
        #: Which of "worker", "triggerer", "scheduler" run.
        self.running = frozenset(running)

    # -- runs ------------------------------------------------------------------------------

    async def add_dag(self, dag: DAG) -> None:
        """Make a DAG built in code known to the worker and recorded in the store (with its
        schedule: the scheduler creates its runs)."""
        self.dagbag.add_dag(dag)
        await record_dags(self.store, [dag])

    async def start_run(
        self,
        dag: DAG,
        run_id: str = "run1",
        conf: dict[str, Any] | None = None,
        *,
        logical_date: dt.datetime | None = None,
    ) -> str:
        """Add the DAG and create a run of it (at the database's now by default)."""
        await self.add_dag(dag)
        when = logical_date or await self.store.now()
        await self.store.create_dag_run(dag.dag_id, run_id, logical_date=when, conf=conf)
        return run_id

    async def run_dag(
        self,
        dag: DAG,
        run_id: str = "run1",
        conf: dict[str, Any] | None = None,
        *,
        timeout_s: float = DEFAULT_WAIT_S,
    ) -> dict[str, dict[str, Any]]:
        """Run the DAG to its end; returns the run's task instances by task_id, plus
        ``"__run__"``: ``{"state": <the run's state>}``."""
        await self.start_run(dag, run_id, conf)
        return await self.finish(dag.dag_id, run_id, timeout_s=timeout_s)

    async def finish(
        self, dag_id: str, run_id: str = "run1", *, timeout_s: float = DEFAULT_WAIT_S
    ) -> dict[str, dict[str, Any]]:
        """Wait for a started run to end; same return value as :meth:`run_dag`."""
        state = ""

        async def ended() -> bool:
            nonlocal state
            run = await self.store.get_dag_run(dag_id, run_id)
            if run is None:
                raise LookupError(f"no run {run_id!r} of DAG {dag_id!r}")
            state = run.state
            return state not in ("running", "queued")

        async def where() -> str:
            return f" (it is {state}; {await self._describe_tasks(dag_id, run_id)})"

        await self._wait(ended, f"run {dag_id}/{run_id} to end", timeout_s, where)
        out = await self.task_instances(dag_id, run_id)
        out["__run__"] = {"state": state}
        return out

    async def task_instances(
        self, dag_id: str, run_id: str | None = None
    ) -> dict[str, dict[str, Any]]:
        """The task instances of a DAG (of one run), by task_id, ``TASK[i]`` for a mapped
        instance (each the fields of :class:`engine.store.TaskInstance` as a dict)."""
        tis = await self.store.list_task_instances(dag_id=dag_id, run_id=run_id)
        return {ti_name(ti.task_id, ti.map_index): msgspec.structs.asdict(ti) for ti in tis}

    async def _describe_tasks(self, dag_id: str, run_id: str) -> str:
        """Where a run's task instances are, for an :class:`EngineTimeout`: each one's state
        and try, and which of them this engine's worker is running."""
        tis = await self.task_instances(dag_id, run_id)
        mine = set(self.worker.running) if "worker" in self.running else set()
        shown = [
            f"{name} {ti['state']} (try {ti['try_number']}"
            + (", running here" if ti["id"] in mine else "")
            + ")"
            for name, ti in sorted(tis.items())
        ]
        return "its task instances: " + (", ".join(shown) or "none")

    async def wait_for_state(
        self,
        dag_id: str,
        task_id: str,
        states: str | Iterable[str],
        *,
        run_id: str = "run1",
        timeout_s: float = DEFAULT_WAIT_S,
    ) -> dict[str, Any]:
        """Wait until the task instance is in one of ``states``; returns it. Fails with
        :class:`EngineTimeout` (naming the state it was in) after ``timeout_s``, or at once
        when it ended in another state (it would never get there)."""
        wanted = {states} if isinstance(states, str) else set(states)
        last: dict[str, Any] | None = None

        async def there() -> bool:
            nonlocal last
            last = (await self.task_instances(dag_id, run_id)).get(task_id)
            if last is None:
                return False
            if last["state"] in wanted:
                return True
            if last["state"] in _ENDED:
                raise EngineTimeout(
                    f"{dag_id}/{run_id}/{task_id} ended {last['state']}, never "
                    f"{' or '.join(sorted(wanted))}: {last.get('error') or ''}"
                )
            return False

        what = f"{dag_id}/{run_id}/{task_id} to be {' or '.join(sorted(wanted))}"
        await self._wait(there, what, timeout_s, lambda: f"; it is {last and last['state']}")
        assert last is not None
        return last

    # -- drain -----------------------------------------------------------------------------

    async def drain(self, *, timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Run until nothing is left to do now (see the module docstring); fails with
        :class:`EngineTimeout` if work is still left after ``timeout_s``."""
        left: dict[str, int] = {}

        async def idle() -> bool:
            nonlocal left
            left = await self._work_left()
            return not any(left.values())

        await self._wait(idle, "the engine to drain", timeout_s, lambda: f"; left: {left}")

    async def _work_left(self) -> dict[str, int]:
        counts = msgspec.structs.asdict(await self.store.work_left())
        if "worker" not in self.running:
            counts.pop("runnable")  # nobody would run them: not this engine's work
        if "triggerer" not in self.running:
            counts.pop("deferred_due")
        if "scheduler" not in self.running:
            counts.pop("runs_to_end")
        counts["worker_busy"] = len(self.worker.running) if "worker" in self.running else 0
        # (callbacks not run yet: requests waiting, and those the worker runs now)
        counts["callbacks"] = (
            len(await self.store.list_callback_requests()) if "worker" in self.running else 0
        )
        counts["events_unwritten"] = (
            _unwritten_events(self.triggerer) if "triggerer" in self.running else 0
        )
        return counts

    async def _wait(
        self,
        condition: Callable[[], Any],
        what: str,
        timeout_s: float,
        detail: Callable[[], str | Awaitable[str]] = str,
    ) -> None:
        """Re-check ``condition`` whenever the engine announces a change (NOTIFY), with a
        short backstop between looks. ``detail``: what the timeout's message adds (it may be
        a coroutine function: a look at the store when the time is up)."""
        wake = Wakeup()
        listener = self.store.listener(
            CHANNEL_TASKS, CHANNEL_TRIGGERS, CHANNEL_FINISHED, CHANNEL_RUNS, CHANNEL_DEADLINES
        )
        listener.on_notify(lambda _channel, _payload: wake.set())
        await listener.ensure_connected()
        try:
            with anyio.move_on_after(timeout_s):
                while not await condition():
                    await wake.wait(_BACKSTOP_S)
                return
        finally:
            with anyio.move_on_after(5, shield=True):
                await listener.close()
        said = detail()
        if inspect.isawaitable(said):
            with anyio.move_on_after(5, shield=True) as looking:
                said = await said
            if looking.cancelled_caught:
                said = " (the store did not answer what the run's tasks are doing)"
        raise EngineTimeout(f"timed out after {timeout_s}s waiting for {what}{said}")


def _unwritten_events(triggerer: Triggerer) -> int:
    """Events the triggerer produced and has not written yet."""
    return triggerer.unwritten_events


@contextlib.asynccontextmanager
async def run_engine(
    store: Store,
    *,
    dags: Iterable[DAG] = (),
    dagbag: DagBag | None = None,
    worker: bool = True,
    triggerer: bool = True,
    scheduler: bool = True,
    slots: int = 4,
    capacity: int = 1000,
    lease_s: float = 10.0,
    poll_interval_s: float = 0.5,
    default_deferrable: bool = False,
    trigger_allow: Callable[[str], bool] | None = None,
    triggerer_options: Mapping[str, Any] | None = None,
    worker_options: Mapping[str, Any] | None = None,
) -> AsyncIterator[LocalEngine]:
    """Start a scheduler, a worker and a triggerer (each can be left out) on ``store`` in the
    current event loop, ready when the block starts; stopped gracefully when it ends.

    ``dags`` (or a ready ``dagbag``) are what the worker runs. Tasks and triggers see the
    store's database as the connection ``deferral``, as in an engine process.
    ``trigger_allow`` is the trigger allow-list (a callable on classpaths; None admits all).
    ``triggerer_options``: more keyword arguments of :class:`engine.triggerer.Triggerer`,
    over the ones above: fields of its config,
    :class:`engine.triggerer.config.TriggererConfig` (``claim_batch``, ``blocked_loop_s``,
    ``queues``, ...), or ``metrics``; ``worker_options`` likewise for
    :class:`engine.worker.worker.Worker` and
    :class:`engine.worker.config.WorkerConfig` (``queues``, ``parallelism``, ...).
    """
    bag = dagbag if dagbag is not None else DagBag(None)
    worker_kwargs: dict[str, Any] = {
        "slots": slots,
        "poll_interval_s": poll_interval_s,
        "heartbeat_s": 1.0,
        "allow": trigger_allow,
        "default_deferrable": default_deferrable,
    }
    w = Worker(store, bag, **{**worker_kwargs, **(worker_options or {})})
    options: dict[str, Any] = {
        "capacity": capacity,
        "poll_interval_s": poll_interval_s,
        "lease_s": lease_s,
        "allow": trigger_allow,
    }
    t = Triggerer(store, **{**options, **(triggerer_options or {})})
    s = Scheduler(store, None, interval_s=poll_interval_s)
    chosen = [
        (name, component)
        for name, component, wanted in (
            ("scheduler", s, scheduler),
            ("triggerer", t, triggerer),
            ("worker", w, worker),
        )
        if wanted
    ]
    engine = LocalEngine(store, bag, w, t, s, running=[name for name, _ in chosen])
    for dag in dags:
        await engine.add_dag(dag)
    with connection_defaults({DEFAULT_DEFERRAL_CONN_ID: store.url}), bind_store(store):
        async with anyio.create_task_group() as tg:
            for _, component in chosen:
                await tg.start(component.run)
            try:
                yield engine
            finally:
                for _, component in reversed(chosen):
                    component.stop()
