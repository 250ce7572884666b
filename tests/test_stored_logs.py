"""Per-trigger and per-try logs, stored in the database: a trigger's lines while it waits and
after it fires, no file descriptor per trigger, a task's lines and prints per try, following
them until the try ends, bounded buffers, retention."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import psutil
import pytest

from engine import DAG
from engine.dags.dagbag import DagBag
from engine.scheduler.duties import delete_old_logs
from engine.scheduler.scheduler import Scheduler
from engine.store import Store, TaskInstance
from engine.store.models import TaskLogRow, TriggerLogRow
from engine.testing import run_engine
from engine.usercode import capture as logcapture
from engine.usercode import logsink
from engine.usercode.logsink import LogSink
from tests import triggerer_faults as faults
from tests.conftest import REPO
from tests.helpers import child_env, wait_until
from tests.log_triggers import FailsOnceThenSucceeds, LogOnceThenWait, WaitForFlag
from tests.triggerer_faults import Spawn, spawn
from triggers.base import validate_trigger

__all__ = ["spawn"]  # the fixture

pytestmark = pytest.mark.anyio


async def _cli(db_url: str, *args: str) -> str:
    """``deferral ARGS`` as a process of its own; its stdout (it must exit 0)."""
    done = await anyio.run_process(
        [sys.executable, "-m", "engine", *args],
        env=child_env(DATABASE_URL=db_url),
        cwd=REPO,
        check=False,
    )
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, f"exit {done.returncode}\n{out}\n{err}"
    assert "Traceback" not in err, err
    return out


class _Following:
    """``deferral ARGS`` running in the background; what it printed so far."""

    def __init__(self, proc: anyio.abc.Process) -> None:
        self.proc = proc
        self.out = b""

    async def collect(self) -> None:
        assert self.proc.stdout is not None
        async for chunk in self.proc.stdout:
            self.out += chunk

    async def exited(self) -> bool:
        return self.proc.returncode is not None


@contextlib.asynccontextmanager
async def _following(db_url: str, *args: str) -> AsyncIterator[_Following]:
    proc = await anyio.open_process(
        [sys.executable, "-m", "engine", *args],
        env=child_env(DATABASE_URL=db_url),
        cwd=REPO,
        stderr=subprocess.DEVNULL,
    )
    following = _Following(proc)
    async with proc, anyio.create_task_group() as tg:
        tg.start_soon(following.collect)
        try:
            yield following
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def _ti(store: Store, dag_id: str, task_id: str) -> TaskInstance:
    (ti,) = [t for t in await store.list_task_instances(dag_id=dag_id) if t.task_id == task_id]
    return ti


# -- a trigger's lines, while it waits and after it fires (real triggerer process) -----------


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # The triggerers and the CLI run in processes of their own; one backend keeps these short.
    return ("asyncio", {"use_uvloop": True})


@pytest.mark.subprocess
async def test_trigger_logs_show_while_it_waits_and_after_it_fires(
    store: Store, db_url: str, spawn: Spawn, tmp_path: Path
) -> None:
    flag = tmp_path / "go"
    with DAG(dag_id="ticking") as dag:
        WaitForFlag(task_id="wait", flag=str(flag))
    spawn()
    async with faults.worker_running(store, dag):
        await faults.start_run(store, dag)

        async def deferred() -> bool:
            ti = await _ti(store, "ticking", "wait")
            return ti.state == "deferred" and ti.trigger_id is not None

        await wait_until(deferred, what="the task deferred")
        trigger_id = (await _ti(store, "ticking", "wait")).trigger_id
        assert trigger_id is not None

        # While it waits: `triggers logs ID` shows its ticks (written in batches meanwhile).
        out = ""

        async def ticks_shown() -> bool:
            nonlocal out
            out = await _cli(db_url, "triggers", "logs", str(trigger_id))
            return "tick 1: still waiting" in out

        await wait_until(ticks_shown, what="the trigger's first lines stored")
        assert "tests.log_triggers.TickingTrigger" in out
        page = await store.trigger_logs(trigger_id)
        assert page.waiting
        assert page.classpath == "tests.log_triggers.TickingTrigger"
        assert (await _ti(store, "ticking", "wait")).state == "deferred"
        seqs = [line.seq for line in page.lines]
        assert seqs == sorted(seqs)

        # --follow started while it waits ends by itself once it fired, with the last line.
        args = ("triggers", "logs", str(trigger_id), "--follow")
        async with _following(db_url, *args) as following:
            flag.touch()
            await wait_until(following.exited, what="triggers logs --follow to end")
        assert following.proc.returncode == 0
        assert "the flag is there after" in following.out.decode()

        async def succeeded() -> bool:
            return (await _ti(store, "ticking", "wait")).state == "success"

        await wait_until(succeeded, what="the task resumed")

    # After it fired: the trigger row is gone, its lines stay, with the try that waited.
    after = await store.trigger_logs(trigger_id)
    assert not after.waiting
    assert after.lines[-1].message.startswith("the flag is there after")
    assert after.lines[-1].level == "WARNING"
    assert [(t.dag_id, t.task_id, t.try_number) for t in after.tasks] == [("ticking", "wait", 1)]
    out = await _cli(db_url, "triggers", "logs", str(trigger_id))
    assert "tick 1: still waiting" in out
    assert "the flag is there after" in out
    task_page = await store.task_logs("ticking", "r1", "wait")
    assert task_page.trigger_ids == [trigger_id]


@pytest.mark.subprocess
async def test_ten_thousand_logging_triggers_open_no_file_each(
    store: Store, db_url: str, spawn: Spawn
) -> None:
    n = 10_000
    proc = spawn(capacity=n + 100, claim_batch=5000)

    async def registered() -> bool:
        return bool(await store.list_triggerers())

    await wait_until(registered, what="the triggerer registered")
    triggerer = psutil.Process(proc.pid)
    before = triggerer.num_fds()
    # n triggers of their own (no task waits on them: nobody drops them here, no scheduler runs).
    kwargs, keys = [], []
    for i in range(n):
        trigger = validate_trigger(LogOnceThenWait(i))
        kwargs.append(store.keyring.encrypt(trigger.kwargs))
        keys.append(store.keyring.dedup_key(trigger.classpath, trigger.kwargs, trigger.dedup_key))
    async with store._pool.acquire() as conn:  # test data, one statement
        await conn.execute(
            "INSERT INTO deferral_triggers (classpath, kwargs, dedup_key) "
            "SELECT 'tests.log_triggers.LogOnceThenWait', k, d "
            "FROM unnest($1::bytea[], $2::text[]) AS t(k, d)",
            kwargs,
            keys,
        )

        async def all_logged() -> bool:
            logged = await conn.fetchval(
                "SELECT count(DISTINCT trigger_id) FROM deferral_trigger_logs"
            )
            return bool(logged == n)

        await wait_until(all_logged, timeout_s=120, what=f"{n} triggers logged a line each")
    held = {r.pid: r.held for r in await store.list_triggerers()}
    assert held[proc.pid] == n
    after = triggerer.num_fds()
    # Its connections (pool of 8, listener, lease) may have grown meanwhile; nothing per trigger.
    assert after - before <= 12, (before, after)


# -- a task's lines per try (in-process engine; the CLI in a process) -------------------------


async def test_task_logs_are_kept_per_try(
    store: Store, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tests.log_triggers")  # as an engine process has it
    with DAG(dag_id="flaky") as dag:
        FailsOnceThenSucceeds(task_id="t", retries=1, retry_delay=0)
    async with run_engine(store, dags=[dag]) as engine:
        tis = await engine.run_dag(dag)
    assert tis["t"]["state"] == "success"
    assert tis["t"]["try_number"] == 2

    one = await _cli(db_url, "tasks", "logs", "flaky", "run1", "t", "--try", "1")
    two = await _cli(db_url, "tasks", "logs", "flaky", "run1", "t", "--try", "2")
    latest = await _cli(db_url, "tasks", "logs", "flaky", "run1", "t")
    assert one != two
    assert latest == two
    assert "[stdout] printed on try 1" in one
    assert "[stderr] to stderr on try 1" in one
    assert "logged on try 1" in one
    assert "RuntimeError: try 1 fails on purpose" in one  # the worker's error line of the try
    assert "try 2" not in one
    assert "[stdout] printed on try 2" in two
    assert "logged on try 2" in two
    assert "try 1" not in two

    page = await store.task_logs("flaky", "run1", "t", 1)
    assert page.ended
    assert page.state == "success"
    assert page.latest_try == 2
    assert [line.stream for line in page.lines[:3]] == ["stdout", "stderr", "log"]
    assert page.lines[2].logger == "tests.log_triggers.FailsOnceThenSucceeds"


async def test_follow_ends_when_the_try_ends(
    store: Store, db_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tests.log_triggers")
    flag = tmp_path / "go"
    with DAG(dag_id="slow") as dag:
        FailsOnceThenSucceeds(task_id="t", flag=str(flag))
    async with run_engine(store, dags=[dag]) as engine:
        await engine.start_run(dag)

        async def first_lines() -> bool:
            return bool((await store.task_logs("slow", "run1", "t")).lines)

        await wait_until(first_lines, what="the try's first lines stored")
        assert not (await store.task_logs("slow", "run1", "t")).ended
        async with _following(db_url, "tasks", "logs", "slow", "run1", "t", "--follow") as f:
            flag.touch()
            await wait_until(f.exited, what="tasks logs --follow to end")
        tis = await engine.finish("slow")
    assert tis["t"]["state"] == "failed"
    assert f.proc.returncode == 0
    text = f.out.decode()
    assert "logged on try 1" in text
    assert "the flag is there on try 1" in text  # logged just before the try's outcome
    assert "RuntimeError: try 1 fails on purpose" in text  # the error, stored with the outcome


async def test_unknown_task_or_try_is_a_usage_error(store: Store, db_url: str) -> None:
    with DAG(dag_id="once") as dag:
        FailsOnceThenSucceeds(task_id="t", retries=1, retry_delay=0)
    async with run_engine(store, dags=[dag]) as engine:
        await engine.run_dag(dag)
    env = child_env(DATABASE_URL=db_url)
    for args, names in (
        (["tasks", "logs", "once", "run1", "nope"], "'nope' (TASK)"),
        (["tasks", "logs", "once", "run1", "t", "--try", "3"], "--try 3"),
        (["tasks", "logs", "once", "run1", "t", "--try", "0"], "--try"),
    ):
        done = await anyio.run_process(
            [sys.executable, "-m", "engine", *args], env=env, cwd=REPO, check=False
        )
        err = done.stderr.decode()
        assert done.returncode == 2, (args, err)
        assert names in err, (args, err)
        assert "Traceback" not in err


_ISOLATED_DAG = """
import logging

from engine import DAG
from operators.base import BaseOperator


class Talks(BaseOperator):
    def execute(self, context):
        print("printed in the child")
        logging.getLogger("child.code").warning("logged in the child")
        return "ok"


with DAG("isolated"):
    Talks(task_id="talk", isolation="process")
"""


async def test_an_isolated_task_s_output_is_stored_with_its_try(
    store: Store, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "isolated_dag.py").write_text(_ISOLATED_DAG)
    bag = DagBag(dags)
    async with run_engine(store, dagbag=bag) as engine:
        tis = await engine.run_dag(bag.get_dag("isolated"))
    assert tis["talk"]["state"] == "success"
    lines = (await store.task_logs("isolated", "run1", "talk")).lines
    by_message = {line.message: line for line in lines}
    printed = by_message["printed in the child"]
    assert printed.stream == "stderr"  # (the child's stdout carries its reply)
    logged = by_message["logged in the child"]
    assert (logged.stream, logged.level, logged.logger) == ("log", "WARNING", "child.code")


# -- the sink: bounded buffers, threads, retention ------------------------------------------


async def test_a_full_buffer_keeps_the_newest_lines_and_says_how_many_went(store: Store) -> None:
    sink = LogSink(store, "task", buffer_lines=3)
    sink.open()
    try:
        token = sink.bind_task(1, "d", "r", "t", 1)
        try:
            for i in range(10):
                logging.getLogger("user.code").warning("line %d", i)
            await anyio.to_thread.run_sync(lambda: print("from a thread"))
        finally:
            sink.unbind(token)
        logging.getLogger("user.code").warning("not bound: not stored")
        await sink.flush()
    finally:
        await sink.close()
    page = await store.task_logs("d", "r", "t", 1)
    assert [line.message for line in page.lines] == [
        "8 lines dropped (more than 3 lines in a second: setting log_max_lines_per_s)",
        "line 8",
        "line 9",
        "from a thread",
    ]
    assert page.state is None  # no such task instance: the lines alone
    assert not isinstance(sys.stdout, logcapture._StreamProxy)


async def test_retention_deletes_old_lines_in_batches(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("engine.scheduler.duties.LOG_RETENTION_BATCH", 2)
    old, new = time.time() - 40 * 86400, time.time()
    # Old and recent lines interleaved (clocks of different hosts): the old ones go all the same.
    ages = [(at, f"{age} {i}") for i in range(5) for at, age in ((old, "old"), (new, "new"))]
    await store.insert_trigger_logs([TriggerLogRow(7, at, "INFO", "x", m) for at, m in ages])
    await store.insert_task_logs(
        [TaskLogRow("d", "r", "t", 1, at, "INFO", "stdout", "<stdout>", m) for at, m in ages]
    )
    scheduler = Scheduler(store, log_retention_days=30)
    assert await delete_old_logs(scheduler) == 10
    trigger_lines = (await store.trigger_logs(7)).lines
    task_lines = (await store.task_logs("d", "r", "t", 1)).lines
    assert [line.message for line in trigger_lines] == [f"new {i}" for i in range(5)]
    assert [line.message for line in task_lines] == [f"new {i}" for i in range(5)]
    assert await delete_old_logs(scheduler) == 0


async def test_engine_chatter_stays_out_long_lines_are_cut_odd_text_is_kept(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="engine.worker")  # as an engine process has it
    sink = LogSink(store, "trigger")
    sink.open()
    try:
        token = sink.bind_trigger(42)
        try:
            logging.getLogger("engine.worker").info("engine chatter: not stored")
            logging.getLogger("engine.triggerer").warning("engine warning: stored")
            logging.getLogger("user").warning("x" * (logsink.DEFAULT_MAX_LINE_BYTES + 10))
            logging.getLogger("user").warning("nul \x00 and a lone surrogate \udce9")
            logging.getLogger("user").warning("kept out", extra={logsink.NOT_STORED: True})
            print("no newline at the end", end="")
        finally:
            sink.unbind(token)
        sink.end(42)
        await sink.flush()
    finally:
        await sink.close()
    messages = [line.message for line in (await store.trigger_logs(42)).lines]
    assert messages == [
        "engine warning: stored",
        "x" * logsink.DEFAULT_MAX_LINE_BYTES + " [... 10 bytes cut]",
        "nul \\x00 and a lone surrogate \\udce9",
        "no newline at the end",
    ]


async def test_the_stream_proxy_is_a_text_stream_and_can_tee_or_step_aside(
    store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    sink = LogSink(store, "task")
    sink.open()
    try:
        token = sink.bind_task(1, "d", "r", "t", 1)
        try:
            # Bytes are refused even while bound, as by a text stream: click probes a stream
            # with write(b"") and, if it is taken, writes bytes to it from then on.
            with pytest.raises(TypeError, match="must be str, not bytes"):
                sys.stdout.write(b"")  # type: ignore[arg-type]
            print("stored only")
            with logsink.tee_streams():
                print("stored and shown")
            with logsink.unbound():
                print("shown only")
        finally:
            sink.unbind(token)
        sink.end((1, 1))
        await sink.flush()
    finally:
        await sink.close()
    shown = capsys.readouterr().out
    assert "stored only" not in shown
    assert "stored and shown" in shown
    assert "shown only" in shown
    messages = [line.message for line in (await store.task_logs("d", "r", "t", 1)).lines]
    assert messages == ["stored only", "stored and shown"]
