"""Ctrl-C and SIGTERM with real processes: one request drains, a second one cancels.

``deferral standalone`` runs as a real process group (as a terminal runs it in the
foreground) and gets SIGINT on the whole group, as the terminal sends it on Ctrl-C; a lone
worker gets SIGTERM, as from systemd or Kubernetes. The tests wait on database state, log
lines and process exits.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from engine.config import load_settings
from engine.dags.dagbag import DagBag
from engine.store import Store, TaskInstance
from engine.testing import run_engine
from tests.helpers import WAIT_S, child_env, free_port, wait_until
from tests.triggers_for_tests import release_file
from triggers.base import decode_value

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

KINDS = ("standalone", "scheduler", "worker", "triggerer", "webserver")
#: A log line's process: ``kind[pid]``.
LABEL = re.compile(r"\b(standalone|scheduler|worker|triggerer|webserver)\[(\d+)\]")

# The task ``slow`` runs until the test creates its file: a task that takes as long as the
# test needs. ``wait`` defers on a trigger that never fires, so the triggerer holds it.
_DAGS = """
    import os
    import time
    from engine import DAG
    from operators.python import PythonOperator
    from tests.triggers_for_tests import FileTrigger
    from operators.base import BaseOperator

    GO = {go!r}
    NEVER = {never!r}

    def slow() -> str:
        while not os.path.exists(GO):
            time.sleep(0.02)
        return "finished"

    class WaitForever(BaseOperator):
        def execute(self, context):
            self.defer(trigger=FileTrigger(NEVER), method_name="resume")

        def resume(self, context, event=None):
            return event

    with DAG(dag_id="drain"):
        PythonOperator(task_id="slow", python_callable=slow, retries=1, retry_delay=300)
        WaitForever(task_id="wait")

    with DAG(dag_id="lone"):
        PythonOperator(task_id="slow", python_callable=slow, retries=1, retry_delay=300)
"""


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # The loops under test run in the children; this one only watches the database.
    return ("asyncio", {"use_uvloop": True})


class Setup:
    def __init__(self, tmp_path: Path, db_url: str) -> None:
        self.dags = tmp_path / "dags"
        self.dags.mkdir()
        self.go = tmp_path / "go"
        self.never = tmp_path / "never"
        self.log = tmp_path / "process.log"
        (self.dags / "stop_dags.py").write_text(
            textwrap.dedent(_DAGS.format(go=str(self.go), never=str(self.never)))
        )
        self.env = child_env(
            DATABASE_URL=db_url,
            HOME=str(tmp_path / "home"),
            LOG_LEVEL="INFO",
            DAGS_FOLDER=str(self.dags),
            # standalone's status page, on a port of its own (tests run side by side)
            WEBSERVER_PORT=str(free_port()),
        )
        self.cwd = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        """``python -m engine ARGS`` in a process group (and session) of its own."""
        with self.log.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine", *args],
                env=self.env,
                cwd=self.cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def lines(self, phrase: str) -> list[str]:
        return [line for line in self.text().splitlines() if phrase in line]

    def pids(self) -> dict[str, int]:
        """The processes that have logged, by kind."""
        return {m[1]: int(m[2]) for m in LABEL.finditer(self.text())}

    def cleanup(self) -> None:
        """Let the task end, then stop whatever is left (children too: own sessions)."""
        release_file(self.go, "go")
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in self.pids().values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def setup(tmp_path: Path, db_url: str) -> Iterator[Setup]:
    s = Setup(tmp_path, db_url)
    try:
        yield s
    finally:
        s.cleanup()


@contextlib.asynccontextmanager
async def explained(setup: Setup) -> AsyncIterator[None]:
    try:
        yield
    except BaseException:
        print(setup.text()[-8000:])
        raise


async def _exit_code(proc: subprocess.Popen[bytes]) -> int:
    return await anyio.to_thread.run_sync(proc.wait, WAIT_S)


async def _ti(store: Store, dag_id: str, task_id: str) -> TaskInstance:
    (ti,) = [ti for ti in await store.list_task_instances(dag_id=dag_id) if ti.task_id == task_id]
    return ti


async def _start_drain_run(store: Store, setup: Setup) -> subprocess.Popen[bytes]:
    """Standalone on the DAGs folder, a run of ``drain`` with ``slow`` running and ``wait``'s
    trigger held by the triggerer."""
    proc = setup.start("standalone", "--dags", str(setup.dags))

    async def synced() -> bool:
        return "drain" in {d.dag_id for d in await store.list_dags()}

    await wait_until(synced, what="the scheduler to sync the DAGs")
    await store.create_dag_run("drain", "r1", logical_date=await store.now())

    async def busy() -> bool:
        triggers = await store.list_triggers()
        return (await _ti(store, "drain", "slow")).state == "running" and bool(
            triggers and triggers[0].triggerer_id is not None
        )

    await wait_until(busy, what="slow to run and wait's trigger to be held")
    return proc


def _label(kind: str, pids: dict[str, int]) -> str:
    return f"{kind}[{pids[kind]}]"


#: What the first stop request logs: a scheduler, which holds no work, stops at once; the
#: other processes let their work finish (or release it), and a second request cancels.
AT_ONCE = "stopping at once (no work to let finish)"
GRACEFULLY = "stopping gracefully"


def _stopping_lines(setup: Setup, phrase: str = GRACEFULLY) -> dict[str, int]:
    """The processes that logged ``phrase``; every such line names its process."""
    named: dict[str, int] = {}
    for line in setup.lines(phrase):
        match = LABEL.search(line)
        assert match, f"a stopping line names no process: {line!r}"
        named[match[1]] = int(match[2])
    return named


def _stopping_pids(setup: Setup) -> dict[str, int]:
    """Every process that logged that it is stopping (at once or gracefully)."""
    return {**_stopping_lines(setup), **_stopping_lines(setup, AT_ONCE)}


async def _all_stopping(setup: Setup) -> None:
    async def logged() -> bool:
        return set(_stopping_pids(setup)) == set(KINDS)

    await wait_until(logged, what="every process to log that it is stopping")
    # Each says how it stops: the scheduler at once, the others gracefully.
    assert set(_stopping_lines(setup, AT_ONCE)) == {"scheduler"}
    assert set(_stopping_lines(setup)) == set(KINDS) - {"scheduler"}


async def test_one_sigint_to_the_standalone_group_drains_running_work(
    store: Store, setup: Setup
) -> None:
    async with explained(setup):
        proc = await _start_drain_run(store, setup)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
        await _all_stopping(setup)

        async def released() -> bool:
            triggers = await store.list_triggers()
            return not await store.list_triggerers() and all(
                t.triggerer_id is None for t in triggers
            )

        await wait_until(released, what="the triggerer to release its trigger")
        pids = _stopping_pids(setup)

        async def others_gone() -> bool:
            # Logged by standalone once it has seen them exit: by then it has done all it
            # does for one Ctrl-C (the old design sent each child a SIGTERM at this point).
            gone = setup.lines(f"{_label('standalone', pids)} engine.launch.standalone")
            return all(
                any(f"{_label(kind, pids)} stopped" in line for line in gone)
                for kind in ("scheduler", "triggerer", "webserver")
            )

        await wait_until(
            others_gone, what="standalone to see the scheduler, triggerer and webserver exit"
        )
        # The running task was not cancelled: it runs on, its worker waits for it.
        assert (await _ti(store, "drain", "slow")).state == "running"
        assert proc.poll() is None
        os.kill(pids["worker"], 0)  # alive
        release_file(setup.go, "go")
        assert await _exit_code(proc) == 0

    slow = await _ti(store, "drain", "slow")
    assert slow.state == "success"
    assert slow.try_number == 1
    assert slow.result is not None
    assert decode_value(slow.result) == "finished"
    assert (await _ti(store, "drain", "wait")).state == "deferred"
    assert [t.triggerer_id for t in await store.list_triggers()] == [None]
    named = _stopping_pids(setup)
    assert named["standalone"] == proc.pid
    assert len(set(named.values())) == len(KINDS)  # one pid each
    assert not setup.lines("cancelling")
    # The banner is one line (it was wrapped at 80 columns in a pipe), with the whole folder.
    (banner,) = setup.lines("deferral standalone: scheduler")
    assert banner.endswith(f"DAGs from {setup.dags}. Ctrl-C: stop gracefully; twice: cancel.")


async def test_a_second_sigint_cancels_the_drain(store: Store, setup: Setup) -> None:
    async with explained(setup):
        proc = await _start_drain_run(store, setup)
        os.killpg(proc.pid, signal.SIGINT)
        await _all_stopping(setup)
        assert (await _ti(store, "drain", "slow")).state == "running"
        os.killpg(proc.pid, signal.SIGINT)
        # The task is still blocked (its file is never created here): exiting proves the
        # processes did not wait for it.
        assert await _exit_code(proc) == 0

    named = _stopping_pids(setup)
    for kind in ("scheduler", "worker", "triggerer", "webserver"):
        with pytest.raises(ProcessLookupError):
            os.kill(named[kind], 0)
    # (The scheduler and the triggerer may have stopped already; the worker was draining.)
    cancelling = {m[1] for line in setup.lines("cancel") if (m := LABEL.search(line))}
    assert {"standalone", "worker"} <= cancelling
    # Cancelled, the try keeps its running row (reaped and retried later); the triggerer
    # still let go of its trigger on the way out.
    assert (await _ti(store, "drain", "slow")).state == "running"
    assert not await store.list_triggerers()
    assert [t.triggerer_id for t in await store.list_triggers()] == [None]


def _lone_dag(setup: Setup) -> Any:
    dag = DagBag(setup.dags).get_dag("lone")
    assert dag is not None
    return dag


async def test_sigterm_to_a_lone_worker_lets_its_running_task_finish(
    store: Store, setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the DagBag puts the folder on it
    dag = _lone_dag(setup)
    async with explained(setup), run_engine(store, worker=False, triggerer=False) as engine:
        proc = setup.start("worker", "--dags", str(setup.dags))
        await engine.start_run(dag)

        async def running() -> bool:
            return (await _ti(store, "lone", "slow")).state == "running"

        await wait_until(running, what="the worker to run slow")
        proc.send_signal(signal.SIGTERM)

        async def stopping() -> bool:
            return any(f"worker[{proc.pid}]" in line for line in setup.lines("SIGTERM: stopping"))

        await wait_until(stopping, what="the worker to log that it is stopping")
        assert (await _ti(store, "lone", "slow")).state == "running"
        release_file(setup.go, "go")
        assert await _exit_code(proc) == 0
    slow = await _ti(store, "lone", "slow")
    assert (slow.state, slow.try_number) == ("success", 1)


def _spawn_worker(setup: Setup) -> Any:
    """A worker started as ``deferral standalone`` starts its children."""
    from engine.launch.app import spawn

    with setup.log.open("ab") as out:
        child = spawn("worker", load_settings(setup.env), env=setup.env, stderr=out)
    setup.procs.append(child)
    return child


async def test_a_stop_that_arrives_by_signal_and_by_pipe_is_one_stop(
    store: Store, setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """systemd signals every process of a unit, and the supervisor forwards its own signal
    too: the child must drain, not cancel, whichever comes first."""
    from engine.runtime.runner import STOP

    monkeypatch.setattr(sys, "path", list(sys.path))
    dag = _lone_dag(setup)
    child = _spawn_worker(setup)
    async with explained(setup), run_engine(store, worker=False, triggerer=False) as engine:
        await engine.start_run(dag)

        async def running() -> bool:
            return (await _ti(store, "lone", "slow")).state == "running"

        await wait_until(running, what="the worker to run slow")
        child.send_signal(signal.SIGTERM)  # from systemd
        assert child.ask(STOP)  # from the supervisor

        async def stopping() -> bool:
            return bool(setup.lines("stopping gracefully"))

        await wait_until(stopping, what="the worker to log that it is stopping")
        assert (await _ti(store, "lone", "slow")).state == "running"
        release_file(setup.go, "go")
        assert await _exit_code(child) == 0
        assert (await _ti(store, "lone", "slow")).state == "success"
        assert not setup.lines("cancelling")
        assert len(setup.lines("stopping gracefully")) == 1


async def test_a_child_whose_supervisor_is_gone_drains(
    store: Store, setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    dag = _lone_dag(setup)
    child = _spawn_worker(setup)
    async with explained(setup), run_engine(store, worker=False, triggerer=False) as engine:
        await engine.start_run(dag)

        async def running() -> bool:
            return (await _ti(store, "lone", "slow")).state == "running"

        await wait_until(running, what="the worker to run slow")
        child.close_control()  # what the supervisor's death does to its end of the pipe

        async def stopping() -> bool:
            return bool(setup.lines("its supervisor is gone: stopping gracefully"))

        await wait_until(stopping, what="the worker to log that it is stopping")
        assert (await _ti(store, "lone", "slow")).state == "running"
        release_file(setup.go, "go")
        assert await _exit_code(child) == 0
        assert (await _ti(store, "lone", "slow")).state == "success"


#: Longest a scheduler may take to stop after SIGTERM here: well under the statement timeout
#: (60 s) that its pass, waiting on a lock, would otherwise run into.
SCHEDULER_STOP_S = 20.0


async def test_sigterm_stops_a_scheduler_whose_pass_waits_on_the_database(
    setup: Setup, db_url: str
) -> None:
    """A scheduler holds no work: SIGTERM ends its pass in flight instead of waiting for it.
    Here the pass waits on a lock the test holds (as on an overloaded or hung database); the
    scheduler stops, rolls its transaction back without an error, and unregisters, while the
    lock is still held."""
    proc = setup.start("scheduler")
    conn = await asyncpg.connect(db_url)
    try:
        async with explained(setup):

            async def registered() -> bool:
                sql = "SELECT count(*) FROM deferral_schedulers WHERE pid = $1"
                return bool(await conn.fetchval(sql, proc.pid))

            await wait_until(registered, what="the scheduler to register")

            async def scanned() -> bool:  # (its DAG file imported: no import cut short)
                return bool(setup.lines("recorded 2 DAG(s)"))

            await wait_until(scanned, what="the scheduler's first scan of its DAGs")
            async with conn.transaction():
                await conn.execute("LOCK TABLE deferral_dag_runs IN ACCESS EXCLUSIVE MODE")

                async def blocked() -> bool:
                    sql = (
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = "
                        "current_database() AND wait_event_type = 'Lock'"
                    )
                    return bool(await conn.fetchval(sql))

                await wait_until(blocked, what="the scheduler's pass to wait on the lock")
                proc.send_signal(signal.SIGTERM)
                code = await anyio.to_thread.run_sync(proc.wait, SCHEDULER_STOP_S)
                assert code == 0
                left = "SELECT count(*) FROM deferral_schedulers WHERE pid = $1"
                assert await conn.fetchval(left, proc.pid) == 0
        # It says it stops at once: a second SIGTERM would have nothing to cancel.
        assert setup.lines(f"SIGTERM: {AT_ONCE}")
        assert not setup.lines("again to cancel")
        assert not setup.lines(" ERROR ")
    finally:
        await conn.close()
