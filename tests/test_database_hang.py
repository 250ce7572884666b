"""A database that hangs (every process of the server stopped with SIGSTOP), and a worker whose
connections hang while the database answers others: healthy tasks are not reaped, and a worker
that really died during the hang still is, afterwards. Real processes: an embedded server of
the test's own, a scheduler and a worker of their own (engine/scheduler/contact.py)."""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import textwrap
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from engine.runtime.retry import with_db_retry
from engine.security.keys import Keyring
from engine.store import Store, TaskInstance
from tests.conftest import TEST_FERNET_KEY
from tests.helpers import wait_until
from tests.pg_proxy import PgProxy
from tests.processes import Children, explained, process_env

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


#: The scheduler's zombie threshold in these tests, and how long the faults last: longer than
#: the threshold (a fault length, not a wait for anything).
THRESHOLD_S = 3.0
HANG_S = 2.5 * THRESHOLD_S
TASKS = 4

_DAG = """
    import os
    import threading
    from engine import DAG
    from operators.python import PythonOperator

    def hold(task_id, try_number):
        with open({log!r}, "a") as f:
            f.write(f"{{task_id}}:try-{{try_number}}\\n")
        while not os.path.exists({release!r}):  # runs until the test releases it
            threading.Event().wait(0.02)
        return "survived"

    with DAG("hang"):
        for i in range({tasks}):
            PythonOperator(
                task_id=f"t{{i}}",
                python_callable=hold,
                op_kwargs={{"task_id": f"t{{i}}"}},
                retries={retries},
            )
"""


class _Setup:
    def __init__(self, tmp_path: Path, retries: int) -> None:
        self.ran = tmp_path / "ran.log"
        self.release = tmp_path / "release"
        self.dags = tmp_path / "dags"
        self.dags.mkdir()
        (self.dags / "hang_dag.py").write_text(
            textwrap.dedent(_DAG).format(
                log=str(self.ran), release=str(self.release), tasks=TASKS, retries=retries
            )
        )

    def tries(self) -> list[str]:
        return sorted(self.ran.read_text().split()) if self.ran.exists() else []


async def _tis(store: Store) -> dict[str, TaskInstance]:
    rows = await with_db_retry("read tasks", lambda: store.list_task_instances(dag_id="hang"))
    return {ti.task_id: ti for ti in rows}


def _server_processes(server: Any) -> list[psutil.Process]:
    """The postmaster and every backend and helper process it started."""
    pid = int((Path(server.pgdata) / "postmaster.pid").read_text().split()[0])
    postmaster = psutil.Process(pid)
    return [postmaster, *postmaster.children(recursive=True)]


def _freeze(server: Any) -> list[psutil.Process]:
    """SIGSTOP the whole server: the postmaster first (it forks nothing more), then the rest."""
    postmaster, *_ = _server_processes(server)
    postmaster.send_signal(signal.SIGSTOP)
    frozen = [postmaster, *postmaster.children(recursive=True)]
    for proc in frozen[1:]:
        proc.send_signal(signal.SIGSTOP)
    return frozen


def _thaw(frozen: list[psutil.Process]) -> None:
    for proc in reversed(frozen):
        proc.send_signal(signal.SIGCONT)


@asynccontextmanager
async def _engine(
    own_server: Any,
    tmp_path: Path,
    setup: _Setup,
    *,
    worker_url: str | None = None,
    worker_env: dict[str, str] | None = None,
) -> AsyncIterator[tuple[Store, Children, Callable[[], subprocess.Popen[bytes]]]]:
    """A scheduler (zombie threshold THRESHOLD_S) on the server, a worker (through
    ``worker_url`` if given, with ``worker_env`` added to its environment), a run of the DAG
    whose tasks all run; the test's own store."""
    url = own_server.get_uri(database="postgres")
    logs = tmp_path / "logs"
    logs.mkdir()
    kids = Children(process_env(url, tmp_path, setup.dags), logs)
    kids.env.update(
        DEFERRAL_ZOMBIE_THRESHOLD_S=str(THRESHOLD_S),
        DEFERRAL_SCHEDULER_INTERVAL_S="0.2",
        DEFERRAL_WORKER_HEARTBEAT_S="0.2",
    )
    store = await Store.connect(url, pool_size=2, keyring=Keyring([TEST_FERNET_KEY]))
    try:
        async with explained(kids):
            kids.start("scheduler", name="scheduler")
            common = dict(kids.env)
            kids.env.update(worker_env or {})
            if worker_url is not None:
                kids.env["DEFERRAL_DATABASE_URL"] = worker_url
            worker = kids.start("worker", name="worker")
            kids.env = common

            async def dag_known() -> bool:
                return await store.get_dag("hang") is not None

            await wait_until(dag_known, what="the scheduler to record the DAG")
            await store.create_dag_run("hang", "run1", logical_date=await store.now())

            async def all_running() -> bool:
                tis = await _tis(store)
                return len(setup.tries()) == TASKS and all(
                    ti.state == "running" for ti in tis.values()
                )

            await wait_until(all_running, what="the worker to run every task")
            yield store, kids, lambda: worker
    finally:
        # (In a thread: a worker behind the test's proxy needs this loop to stop.)
        await anyio.to_thread.run_sync(kids.stop_all)
        await store.close()


async def _scheduler_passes_after(store: Store, moment: dt.datetime, passes: int) -> None:
    """Wait until the scheduler has ended ``passes`` housekeeping passes (its heartbeat comes
    last in one) after ``moment`` (database time): the reap of the last one was sent after
    the first ended."""
    seen: list[dt.datetime] = []

    async def passed() -> bool:
        fleet = await with_db_retry("read the fleet", store.fleet)
        beats = [s.heartbeat_at for s in fleet.schedulers]
        if beats and beats[0] > max([moment, *seen]):
            seen.append(beats[0])
        return len(seen) >= passes

    await wait_until(passed, what=f"{passes} scheduler passes after {moment}")


async def test_a_database_hang_longer_than_the_zombie_threshold_reaps_nothing(
    own_server: Any, tmp_path: Path
) -> None:
    setup = _Setup(tmp_path, retries=0)
    proxy = PgProxy(own_server.get_uri(database="postgres"))
    # The worker reaches the database through a proxy the test pauses across the hang and
    # until the scheduler has looked at the heartbeats twice after it: before the fix, that
    # look reaped every task (failed, try 1), not only when the scheduler was first.
    async with (
        proxy.running(),
        _engine(own_server, tmp_path, setup, worker_url=proxy.url) as (store, kids, worker),
    ):
        proxy.pause()
        frozen = _freeze(own_server)
        await anyio.sleep(HANG_S)  # the hang itself (a fault length, not a wait)
        _thaw(frozen)
        thawed = await with_db_retry("read the clock", store.now)
        await _scheduler_passes_after(store, thawed, passes=2)
        proxy.resume()
        tis = await _tis(store)
        assert {ti.state for ti in tis.values()} == {"running"}, {
            t: (ti.state, ti.error) for t, ti in tis.items()
        }
        assert worker().poll() is None, kids.output()
        setup.release.write_text("go")

        async def run_ended() -> bool:
            run = await with_db_retry("read the run", lambda: store.get_dag_run("hang", "run1"))
            return run is not None and run.state not in ("running", "queued")

        await wait_until(run_ended, what="the run to end")
        tis = await _tis(store)
        assert {(ti.state, ti.try_number) for ti in tis.values()} == {("success", 1)}, {
            t: (ti.state, ti.error) for t, ti in tis.items()
        }
        assert setup.tries() == sorted(f"t{i}:try-1" for i in range(TASKS))
        scheduler_log = (tmp_path / "logs" / "scheduler.log").read_text()
        assert "no contact with the database" in scheduler_log


async def test_a_worker_killed_during_a_database_hang_is_reaped_after_it(
    own_server: Any, tmp_path: Path
) -> None:
    setup = _Setup(tmp_path, retries=0)
    async with _engine(own_server, tmp_path, setup) as (store, _kids, worker):
        frozen = _freeze(own_server)
        worker().send_signal(signal.SIGKILL)
        await anyio.sleep(HANG_S)  # the hang itself (a fault length, not a wait)
        _thaw(frozen)

        async def reaped() -> bool:
            return all(ti.state == "failed" for ti in (await _tis(store)).values())

        # Within zombie_threshold_s (plus a pass) of the scheduler's contact coming back.
        await wait_until(reaped, what="the dead worker's tasks to be reaped")
        for ti in (await _tis(store)).values():
            assert ti.try_number == 1
            assert "stopped heartbeating" in (ti.error or ""), ti.error
        assert setup.tries() == sorted(f"t{i}:try-1" for i in range(TASKS))


async def test_a_hung_connection_of_a_live_worker_does_not_get_its_tasks_reaped(
    own_server: Any, tmp_path: Path
) -> None:
    # Every connection the worker has stops answering (a half-open socket, a stuck backend)
    # while the database answers everyone else, new connections of the worker's included:
    # the heartbeat is given up after its timeout and sent again on a fresh connection of its
    # own. Before the fix it waited on a hung pooled one (60 s) while the scheduler reaped the
    # tasks.
    setup = _Setup(tmp_path, retries=0)
    proxy = PgProxy(own_server.get_uri(database="postgres"))
    # (One pooled connection: before the fix the heartbeat always waited on a hung one.)
    single = {"DEFERRAL_POOL_SIZE": "1"}
    async with (
        proxy.running(),
        _engine(own_server, tmp_path, setup, worker_url=proxy.url, worker_env=single) as (
            store,
            kids,
            worker,
        ),
    ):
        stalled = proxy.stall_connections()
        start = await store.now()
        await anyio.sleep(HANG_S)  # the fault itself (a fault length, not a wait)
        await _scheduler_passes_after(store, start + dt.timedelta(seconds=HANG_S), passes=2)
        tis = await _tis(store)
        assert {ti.state for ti in tis.values()} == {"running"}, {
            t: (ti.state, ti.error) for t, ti in tis.items()
        }
        assert proxy.connections > stalled  # it reconnected
        proxy.resume()
        setup.release.write_text("go")

        async def run_ended() -> bool:
            run = await store.get_dag_run("hang", "run1")
            return run is not None and run.state not in ("running", "queued")

        await wait_until(run_ended, what="the run to end")
        tis = await _tis(store)
        assert {(ti.state, ti.try_number) for ti in tis.values()} == {("success", 1)}
        assert worker().poll() is None, kids.output()
