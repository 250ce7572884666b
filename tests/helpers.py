"""Run the engine inside a test: scheduler, triggerer and worker in the test's event loop."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from engine.client import wait_for_run
from engine.dag import DAG
from engine.dagbag import DagBag
from engine.scheduler import Scheduler
from engine.store import Store
from engine.triggerer import Triggerer
from engine.worker import Worker

#: The test triggers live in tests/, outside the built-in ``triggers.*`` of the allow-list.
TEST_TRIGGER_ALLOW = "triggers.*,tests.*"

#: Upper bound for any wait in a test; pytest-timeout is the outer guard.
WAIT_S = 30.0
REPO_ROOT = Path(__file__).resolve().parent.parent


class Engine:
    def __init__(
        self,
        store: Store,
        dagbag: DagBag,
        worker: Worker,
        triggerer: Triggerer,
        scheduler: Scheduler,
    ) -> None:
        self.store = store
        self.dagbag = dagbag
        self.worker = worker
        self.triggerer = triggerer
        self.scheduler = scheduler

    async def add_dag(self, dag: DAG) -> None:
        self.dagbag.add_dag(dag)
        await self.store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)

    async def start_run(
        self, dag: DAG, run_id: str = "run1", conf: dict[str, Any] | None = None
    ) -> str:
        await self.add_dag(dag)
        now = await self.store.now()
        await self.store.create_dag_run(dag.dag_id, run_id, logical_date=now, conf=conf)
        return run_id

    async def run_dag(
        self, dag: DAG, run_id: str = "run1", conf: dict[str, Any] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Run the DAG to its end; returns the run's task instances by task_id (plus
        "__run__": the run's state)."""
        await self.start_run(dag, run_id, conf)
        return await self.finish(dag.dag_id, run_id)

    async def finish(self, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
        """Wait for a started run to end; same return value as :meth:`run_dag`."""
        state = await wait_for_run(self.store, dag_id, run_id, WAIT_S)
        assert state != "running", f"run {dag_id}/{run_id} did not end within {WAIT_S}s"
        tis = await self.store.list_task_instances(dag_id=dag_id, run_id=run_id)
        out: dict[str, dict[str, Any]] = {ti["task_id"]: ti for ti in tis}
        out["__run__"] = {"state": state}
        return out


@contextlib.asynccontextmanager
async def running_engine(
    store: Store,
    *,
    slots: int = 4,
    capacity: int = 1000,
    worker: bool = True,
    triggerer: bool = True,
    lease_s: float = 10.0,
) -> AsyncIterator[Engine]:
    dagbag = DagBag(None)
    w = Worker(store, dagbag, slots=slots, poll_interval_s=0.5, heartbeat_s=1.0)
    t = Triggerer(store, capacity=capacity, poll_interval_s=0.5, lease_s=lease_s)
    s = Scheduler(store, None, interval_s=0.5)
    async with anyio.create_task_group() as tg:
        await tg.start(s.run)
        if triggerer:
            await tg.start(t.run)
        if worker:
            await tg.start(w.run)
        try:
            yield Engine(store, dagbag, w, t, s)
        finally:
            for c in (w, t, s):
                c.stop()


async def wait_until(
    condition: Callable[[], Awaitable[bool]], *, timeout_s: float = WAIT_S, what: str = ""
) -> None:
    """Wait for a condition (re-checked every few ms); fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition}")
        await anyio.sleep(0.01)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def child_env(*, test_triggers: bool = True, **settings: str) -> dict[str, str]:
    """The environment of an engine child process in a test: this process's environment
    without its ``DEFERRAL_*`` variables, plus the test key, the repository on ``PYTHONPATH``,
    an allow-list that admits the test triggers (unless ``test_triggers=False``: the default
    list, built-ins and DAGs folder modules), and ``settings`` (``DEFERRAL_<NAME>`` values by
    upper-case name, e.g. ``DATABASE_URL=...``)."""
    from tests.conftest import TEST_FERNET_KEY

    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFERRAL_")}
    env.update(
        DEFERRAL_FERNET_KEY=TEST_FERNET_KEY,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    )
    if test_triggers:
        env["DEFERRAL_TRIGGER_ALLOW"] = TEST_TRIGGER_ALLOW
    env.update({f"DEFERRAL_{name}": value for name, value in settings.items()})
    return env
