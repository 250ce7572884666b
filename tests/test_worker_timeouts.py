"""A task past its execution_timeout, with a real worker and a real database: a thread that
cannot be stopped keeps its slot until it ends, and ``isolation="process"`` runs the task in a
child process that the timeout really ends (and that otherwise behaves like a thread)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine.dags.dagbag import DagBag
from engine.scheduler.scheduler import Scheduler
from engine.store import Store, TaskInstance
from engine.testing import run_engine
from engine.triggerer import Triggerer
from engine.worker.worker import Worker
from operators.base import BaseOperator
from tests.helpers import wait_until
from tests.processes import Children, explained
from triggers.base import decode_value


@contextlib.asynccontextmanager
async def _engine(
    store: Store, dags: Path, *, slots: int, **worker_kwargs: Any
) -> AsyncIterator[Worker]:
    """Scheduler, triggerer and a worker over a DAGs folder; every DAG in it gets a run."""
    dagbag = DagBag(dags)
    for dag in dagbag.collect().values():
        await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
        await store.create_dag_run(dag.dag_id, "run1", logical_date=await store.now())
    assert not dagbag.import_errors, dagbag.import_errors
    worker = Worker(
        store, dagbag, slots=slots, poll_interval_s=0.5, heartbeat_s=1.0, **worker_kwargs
    )
    triggerer = Triggerer(store, capacity=100, poll_interval_s=0.5)
    scheduler = Scheduler(store, None, interval_s=0.5)
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        await tg.start(triggerer.run)
        await tg.start(worker.run)
        try:
            yield worker
        finally:
            for part in (worker, triggerer, scheduler):
                part.stop()


def _write_dag(tmp_path: Path, source: str, **values: Any) -> Path:
    dags = tmp_path / "dags"
    dags.mkdir(exist_ok=True)
    (dags / "timeouts_dag.py").write_text(
        textwrap.dedent(source).format(**{k: repr(v) for k, v in values.items()})
    )
    return dags


async def _tis(store: Store, dag_id: str) -> dict[str, TaskInstance]:
    return {ti.task_id: ti for ti in await store.list_task_instances(dag_id=dag_id)}


async def _ended(store: Store, dag_id: str) -> bool:
    run = await store.get_dag_run(dag_id, "run1")
    return run is not None and run.state != "running"


# -- a thread past its timeout keeps its slot ------------------------------------------------

_LINGERING_DAG = """
    import pathlib
    import time

    from engine import DAG
    from operators.base import BaseOperator

    JOURNAL = pathlib.Path({journal})
    NEXT_STARTED = pathlib.Path({next_started})


    def note(line):
        with JOURNAL.open("a") as f:
            f.write(line + "\\n")


    class Stuck(BaseOperator):
        def execute(self, context):
            note("stuck-start")
            # Runs on past its timeout: until the next task starts (which must not happen
            # while this thread runs), or for a few seconds at most.
            deadline = time.monotonic() + {hold_s}
            while time.monotonic() < deadline and not NEXT_STARTED.exists():
                time.sleep(0.01)
            note("stuck-end")


    class Next(BaseOperator):
        def execute(self, context):
            NEXT_STARTED.touch()
            note("next-start")
            return "ran"


    with DAG("lingering"):
        stuck = Stuck(task_id="stuck", execution_timeout=0.3)
        stuck >> Next(task_id="next", trigger_rule="all_done")
"""


@pytest.mark.anyio
async def test_a_thread_past_its_timeout_keeps_its_slot_until_it_ends(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="engine.worker")
    journal = tmp_path / "journal"
    dags = _write_dag(
        tmp_path,
        _LINGERING_DAG,
        journal=str(journal),
        next_started=str(tmp_path / "next-started"),
        hold_s=5.0,
    )
    async with _engine(store, dags, slots=1) as worker:
        await wait_until(lambda: _ended(store, "lingering"), what="the run to end")
        tis = await _tis(store, "lingering")
        assert worker.peak_running == 1
    # The second task started only once the first one's thread had ended.
    assert journal.read_text().split() == ["stuck-start", "stuck-end", "next-start"]
    stuck, nxt = tis["stuck"], tis["next"]
    assert stuck.state == "failed"
    assert "execution_timeout of 0.3s passed" in stuck.error
    assert "thread could not be stopped" in stuck.error
    assert nxt.state == "success"
    # Failed at the timeout, not when the thread ended: before the next task's start.
    assert stuck.ended_at < nxt.started_at
    warnings = [r.getMessage() for r in caplog.records if r.name == "engine.worker"]
    assert any(
        "lingering.stuck" in m and "its thread cannot be stopped and still runs" in m
        for m in warnings
    ), warnings
    assert any("the thread of task lingering.stuck" in m and "ended" in m for m in warnings)


# -- isolation="process": the timeout stops the child ----------------------------------------

_STOPPED_DAG = """
    import os
    import pathlib
    import signal
    import time

    from engine import DAG
    from operators.base import BaseOperator


    class Sleeps(BaseOperator):
        def __init__(self, *, pid_file, ignore_term, **kwargs):
            super().__init__(**kwargs)
            self.pid_file = pid_file
            self.ignore_term = ignore_term

        def execute(self, context):
            if self.ignore_term:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            pathlib.Path(self.pid_file).write_text(str(os.getpid()))
            while True:
                time.sleep(1)


    with DAG("stopped"):
        Sleeps(
            task_id="sleeps",
            pid_file={pid_file},
            ignore_term={ignore_term},
            # (The timeout counts from the try's start: the child's start-up, imports included,
            # is part of it, and takes seconds on a loaded machine.)
            execution_timeout=4.0,
            isolation="process",
        )
"""


def _alive(pid: int) -> bool:
    """Whether the process runs (a zombie nobody reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.mark.anyio
@pytest.mark.parametrize("ignore_term", [False, True], ids=["sigterm", "sigkill-after-grace"])
async def test_an_isolated_task_past_its_timeout_is_failed_and_its_process_is_gone(
    store: Store, tmp_path: Path, ignore_term: bool
) -> None:
    pid_file = tmp_path / "pid"
    dags = _write_dag(tmp_path, _STOPPED_DAG, pid_file=str(pid_file), ignore_term=ignore_term)
    async with _engine(store, dags, slots=1, isolation_kill_grace_s=0.5):
        await wait_until(lambda: _ended(store, "stopped"), what="the run to end")
        ti = (await _tis(store, "stopped"))["sleeps"]
    assert ti.state == "failed"
    assert "execution_timeout of 4.0s passed" in ti.error
    assert "its child process was stopped" in ti.error
    pid = int(pid_file.read_text())
    assert pid != os.getpid()
    assert not _alive(pid), f"the task's process {pid} still runs"


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_the_child_of_a_worker_killed_with_sigkill_ends_too(
    store: Store, children: Children, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = tmp_path / "pid"
    dags = _write_dag(tmp_path, _STOPPED_DAG, pid_file=str(pid_file), ignore_term=True)
    (dags / "timeouts_dag.py").write_text(
        (dags / "timeouts_dag.py").read_text().replace("execution_timeout=4.0", "retries=0")
    )
    children.env["DEFERRAL_DAGS_FOLDER"] = str(dags)
    monkeypatch.setattr("sys.path", list(sys.path))
    dag = DagBag(dags).get_dag("stopped")
    async with explained(children), run_engine(store, worker=False, triggerer=False) as engine:
        worker = children.start("worker", "--slots", "1", name="worker")
        await engine.start_run(dag)
        await wait_until(
            lambda: anyio.to_thread.run_sync(pid_file.exists), what="the task's child to start"
        )
        pid = int(pid_file.read_text())
        assert _alive(pid)
        worker.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(worker.wait)

        async def gone() -> bool:
            return not _alive(pid)

        await wait_until(gone, what=f"the task's process {pid} to end with its worker")


# -- isolation="process" behaves like a thread -----------------------------------------------

_BEHAVES_DAG = """
    import asyncio
    import datetime as dt
    import os

    from engine import DAG
    from operators.base import BaseOperator, FailTask, SkipTask
    from triggers.temporal import TimeDeltaTrigger


    def explode():
        raise ValueError("boom in the child")


    class Returns(BaseOperator):
        def execute(self, context):
            print("a print of the task goes to stderr, not into the reply")
            return {{"pid": os.getpid(), "task": context["task_id"], "values": [1, 2.5, "x"]}}


    class AsyncReturns(BaseOperator):
        async def execute(self, context):
            await asyncio.sleep(0)
            return {{"pid": os.getpid()}}


    class Raises(BaseOperator):
        def execute(self, context):
            explode()


    class Defers(BaseOperator):
        def execute(self, context):
            self.defer(
                trigger=TimeDeltaTrigger(dt.timedelta(0)),
                method_name="resume",
                kwargs={{"first_pid": os.getpid()}},
            )

        def resume(self, context, event, first_pid):
            return {{"first_pid": first_pid, "second_pid": os.getpid()}}


    class Skips(BaseOperator):
        def execute(self, context):
            raise SkipTask("nothing to do")


    class Fails(BaseOperator):
        def execute(self, context):
            raise FailTask("no point retrying")


    class Environment(BaseOperator):
        def execute(self, context):
            return sorted(k for k in os.environ if k.startswith("DEFERRAL_"))


    class Unstorable(BaseOperator):
        def execute(self, context):
            return object()


    with DAG("behaves"):
        kw = dict(isolation="process")
        Returns(task_id="returns", **kw)
        AsyncReturns(task_id="async_returns", **kw)
        Raises(task_id="raises", **kw)
        Defers(task_id="defers", **kw)
        Skips(task_id="skips", **kw)
        Fails(task_id="fails", retries=3, retry_delay=0, **kw)
        Environment(task_id="environment", **kw)
        Unstorable(task_id="unstorable", retries=3, retry_delay=0, **kw)
"""


def _result(ti: TaskInstance) -> Any:
    assert ti.state == "success", ti
    return decode_value(ti.result)


@pytest.mark.anyio
async def test_an_isolated_task_returns_raises_defers_and_resumes_like_a_thread(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A secret in the worker's environment does not reach the child.
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", "postgresql://user:secret@nowhere/db")
    dags = _write_dag(tmp_path, _BEHAVES_DAG)
    async with _engine(store, dags, slots=4):
        await wait_until(lambda: _ended(store, "behaves"), what="the run to end")
        tis = await _tis(store, "behaves")
    me = os.getpid()

    returned = _result(tis["returns"])
    assert returned["task"] == "returns"
    assert returned["values"] == [1, 2.5, "x"]
    assert returned["pid"] != me
    assert _result(tis["async_returns"])["pid"] not in (me, returned["pid"])

    raised = tis["raises"]
    assert raised.state == "failed"
    assert raised.error.startswith("Traceback (most recent call last):")
    assert "in explode" in raised.error
    assert raised.error.endswith("ValueError: boom in the child")

    resumed = _result(tis["defers"])
    assert me not in (resumed["first_pid"], resumed["second_pid"])
    assert resumed["first_pid"] != resumed["second_pid"]  # a new child for the resume

    assert tis["skips"].state == "skipped"
    assert tis["fails"].state == "failed"
    assert tis["fails"].try_number == 1  # FailTask: no retry
    assert tis["fails"].error == "FailTask: no point retrying"
    assert _result(tis["environment"]) == []
    assert tis["unstorable"].state == "failed"
    assert tis["unstorable"].try_number == 1
    assert "XCom 'return_value' cannot be stored as its value" in tis["unstorable"].error


def test_isolation_must_be_a_known_mode() -> None:
    with pytest.raises(ValueError, match="isolation must be one of none, process"):
        BaseOperator(task_id="t", isolation="thread-pool")


class _Returns(BaseOperator):
    def execute(self, context: Any) -> int:
        return 1


@pytest.mark.anyio
async def test_an_isolated_task_of_a_dag_built_in_code_fails_saying_why(store: Store) -> None:
    from engine.dags.dag import DAG

    with DAG("in_code") as dag:
        _Returns(task_id="isolated", isolation="process", retries=2, retry_delay=0)
    async with run_engine(store, triggerer=False) as engine:
        tis = await engine.run_dag(dag)
    ti = tis["isolated"]
    assert ti["state"] == "failed"
    assert ti["try_number"] == 1  # retrying cannot help
    assert "not loaded from a file of the DAGs folder" in ti["error"]


def _process_ended(pid: int) -> bool:
    """The process is gone or a zombie (killed, not reaped yet by its new parent)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.anyio
async def test_a_bash_command_past_execution_timeout_goes_with_what_it_started(
    store: Store, tmp_path: Path
) -> None:
    """A BashOperator stopped at its execution_timeout kills the command's process group,
    not bash alone: a process the command started goes too, and the try ends at once (it
    waited for that process before, holding the output pipe: up to its end on Python 3.11)."""
    from engine import DAG
    from operators.bash import BashOperator

    pid_file = tmp_path / "pid"
    with DAG(dag_id="bash_timeout") as dag:
        BashOperator(
            task_id="b",
            # The pid is written whole (mv) and the timeout leaves bash ample time to write it
            # on a loaded machine (at 0.5 s a CI run once killed bash before it wrote anything).
            bash_command=f"sleep 300 & echo $! > {pid_file}.w && mv {pid_file}.w {pid_file}; wait",
            execution_timeout=3,
        )
    try:
        async with run_engine(store) as engine:
            tis = await engine.run_dag(dag)
        assert tis["b"]["state"] == "failed"
        assert "execution_timeout of 3.0s passed" in tis["b"]["error"], tis["b"]["error"]
        started = int(pid_file.read_text())

        async def gone() -> bool:
            return _process_ended(started)

        await wait_until(gone, what="the command's background process to be killed")
    finally:
        if pid_file.exists():
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
