"""Faults a worker and a scheduler must survive, with real processes and a real database:
a deferral or reschedule the database cannot store, connections killed under them, a claim
whose reply is lost, and a database restart longer than the zombie threshold.
"""

from __future__ import annotations

import datetime as dt
import math
import random
import signal
import subprocess
import textwrap
import urllib.parse
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine.dags.dagbag import DagBag
from engine.runtime.retry import with_db_retry
from engine.store import Store, TaskInstance
from engine.testing import run_engine
from operators.base import (
    MAX_WAIT_S,
    BaseOperator,
    Context,
    TaskDeferred,
    TriggerSerializationError,
)
from tests.helpers import wait_until
from tests.pg_proxy import PgProxy
from tests.pg_server import start_server, stop_server
from tests.processes import Children, explained, process_env
from triggers.temporal import TimeDeltaTrigger

# -- defer(timeout=...) is checked where it is called ------------------------------------------


class _Defers(BaseOperator):
    def execute(self, context: Context) -> Any:
        return None

    def resume(self, context: Context, event: Any = None) -> Any:
        return event


@pytest.mark.parametrize(
    "timeout",
    [math.nan, math.inf, -math.inf, -1.0, 1e13, MAX_WAIT_S * 2, dt.timedelta(days=10**8)],
    ids=["nan", "inf", "-inf", "negative", "1e13", "over-max", "huge-timedelta"],
)
def test_defer_refuses_a_timeout_no_deadline_can_be_made_of(timeout: Any) -> None:
    op = _Defers(task_id="t")
    trigger = TimeDeltaTrigger(dt.timedelta(seconds=1))
    with pytest.raises(TriggerSerializationError, match="timeout"):
        op.defer(trigger=trigger, method_name="resume", timeout=timeout)


def test_defer_accepts_timeouts_up_to_the_maximum() -> None:
    op = _Defers(task_id="t")
    trigger = TimeDeltaTrigger(dt.timedelta(seconds=1))
    for timeout, seconds in ((0, 0.0), (0.5, 0.5), (MAX_WAIT_S, MAX_WAIT_S),
                             (dt.timedelta(hours=1), 3600.0)):  # fmt: skip
        with pytest.raises(TaskDeferred) as caught:
            op.defer(trigger=trigger, method_name="resume", timeout=timeout)
        assert caught.value.timeout_s == seconds


# -- real processes --------------------------------------------------------------------------


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


def _dags(tmp_path: Path, name: str, source: str, **values: str) -> Path:
    dags = tmp_path / "dags"
    dags.mkdir(exist_ok=True)
    (dags / f"{name}.py").write_text(textwrap.dedent(source).format(**values))
    return dags


def _alive(*procs: subprocess.Popen[bytes]) -> bool:
    return all(p.poll() is None for p in procs)


async def _run_ended(store: Store, dag_id: str) -> bool:
    run = await with_db_retry("read the run", lambda: store.get_dag_run(dag_id, "run1"))
    return run is not None and run.state != "running"


async def _tis(store: Store, dag_id: str) -> dict[str, TaskInstance]:
    rows = await with_db_retry("read tasks", lambda: store.list_task_instances(dag_id=dag_id))
    return {ti.task_id: ti for ti in rows}


def _runs(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


# -- a deferral the database cannot store fails its own task only -----------------------------

_REFUSED_DAG = """
    import datetime as dt
    import os
    import threading
    from engine import DAG
    from operators.base import BaseOperator, RescheduleRequested, TaskDeferred
    from operators.python import PythonOperator
    from triggers.base import SerializedTrigger, validate_trigger
    from triggers.temporal import TimeDeltaTrigger

    def _trigger(classpath=None):
        good = validate_trigger(TimeDeltaTrigger(dt.timedelta(seconds=1)))
        return SerializedTrigger(classpath or good.classpath, good.kwargs, good.dedup_key)

    class HandBuilt(BaseOperator):
        # Bypasses defer() and its checks, as a buggy operator or library might.
        def __init__(self, *, how, **kwargs):
            super().__init__(**kwargs)
            self.how = how

        def execute(self, context):
            if self.how == "huge_timeout":
                raise TaskDeferred(trigger=_trigger(), method_name="resume", kwargs={{}},
                                   timeout_s=1e13)
            if self.how == "nan_timeout":
                raise TaskDeferred(trigger=_trigger(), method_name="resume", kwargs={{}},
                                   timeout_s=float("nan"))
            if self.how == "unstorable_method":
                # (PostgreSQL text holds no NUL: the database refuses the write.)
                raise TaskDeferred(trigger=_trigger(), method_name="res\\x00ume", kwargs={{}},
                                   timeout_s=10.0)
            if self.how == "far_reschedule":
                raise RescheduleRequested(dt.datetime.max.replace(tzinfo=dt.UTC))
            raise RescheduleRequested(dt.datetime(2030, 1, 1))  # naive

        def resume(self, context, event=None):
            return event

    def beside():
        # Runs while the others fail on the same worker; ends when the test says so.
        while not os.path.exists({release!r}):
            threading.Event().wait(0.02)
        return "fine"

    with DAG(dag_id="refused"):
        for how in ("huge_timeout", "nan_timeout", "unstorable_method", "far_reschedule",
                    "naive_reschedule"):
            HandBuilt(task_id=how, how=how, retries=3, retry_delay=0)
        PythonOperator(task_id="beside", python_callable=beside)
"""


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_deferral_the_database_refuses_fails_its_task_not_the_worker(
    store: Store, children: Children, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = tmp_path / "release-beside"
    dags = _dags(tmp_path, "refused_dag", _REFUSED_DAG, release=str(release))
    children.env["DEFERRAL_DAGS_FOLDER"] = str(dags)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    dag = DagBag(dags).get_dag("refused")
    bad = [
        "huge_timeout",
        "nan_timeout",
        "unstorable_method",
        "far_reschedule",
        "naive_reschedule",
    ]

    async with explained(children), run_engine(store, worker=False, triggerer=False) as engine:
        worker = children.start("worker", "--slots", "8", name="worker")
        await engine.start_run(dag)

        async def bad_ones_failed() -> bool:
            tis = await _tis(store, "refused")
            return all(tis[t].state == "failed" for t in bad)

        await wait_until(bad_ones_failed, what="the bad deferrals to fail their tasks")
        assert _alive(worker), children.output()
        assert (await _tis(store, "refused"))["beside"].state == "running"
        release.write_text("go")
        await wait_until(lambda: _run_ended(store, "refused"), what="the run to end")
        assert _alive(worker), children.output()

    tis = await _tis(store, "refused")
    assert tis["beside"].state == "success"
    for task_id in bad:
        assert tis[task_id].state == "failed", task_id
        assert tis[task_id].try_number == 1, task_id  # no retry: it would fail the same way
    assert "deferral timeout must be a finite number" in tis["huge_timeout"].error
    assert "deferral timeout must be a finite number" in tis["nan_timeout"].error
    assert "could not be stored" in tis["unstorable_method"].error
    assert "ten years" in tis["far_reschedule"].error
    assert "timezone-aware" in tis["naive_reschedule"].error
    assert await store.list_triggers() == []


_CHILD_EXIT_DAG = """
    import asyncio
    from engine import DAG
    from operators.base import BaseOperator
    from operators.python import PythonOperator

    class ChildExits(BaseOperator):
        async def execute(self, context):
            async def child():
                raise SystemExit(6)  # asyncio re-raises this out of the loop

            await asyncio.gather(child())

    class OwnCancel(BaseOperator):
        async def execute(self, context):
            inner = asyncio.get_running_loop().create_task(asyncio.Event().wait())
            await asyncio.sleep(0)
            inner.cancel()
            await inner  # surfaces as this task's own CancelledError

    def interrupt():
        raise KeyboardInterrupt

    with DAG(dag_id="child_exit"):
        ChildExits(task_id="exits", retries=0)
        OwnCancel(task_id="own_cancel", retries=0)
        PythonOperator(task_id="interrupt", python_callable=interrupt)
        PythonOperator(task_id="after", python_callable=lambda: "fine")
"""


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_task_code_raising_systemexit_keyboardinterrupt_or_cancellederror_fails_only_itself(
    store: Store, children: Children, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dags = _dags(tmp_path, "child_exit_dag", _CHILD_EXIT_DAG)
    children.env["DEFERRAL_DAGS_FOLDER"] = str(dags)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    dag = DagBag(dags).get_dag("child_exit")
    async with explained(children), run_engine(store, worker=False, triggerer=False) as engine:
        worker = children.start("worker", "--slots", "1", name="worker")
        await engine.start_run(dag)
        await wait_until(lambda: _run_ended(store, "child_exit"), what="the run to end")
        assert _alive(worker), children.output()
    tis = await _tis(store, "child_exit")
    assert tis["exits"].state == "failed"
    assert "raised SystemExit: 6" in tis["exits"].error
    assert tis["own_cancel"].state == "failed"
    assert "CancelledError" in tis["own_cancel"].error
    assert tis["interrupt"].state == "failed"
    assert "KeyboardInterrupt" in tis["interrupt"].error
    assert tis["after"].state == "success"


# -- a claim whose reply is lost ---------------------------------------------------------------

_ONCE_DAG = """
    from engine import DAG
    from operators.python import PythonOperator

    def work(try_number):
        with open({log!r}, "a") as f:
            f.write(f"try-{{try_number}}\\n")
        return "done"

    with DAG(dag_id="lost_reply"):
        PythonOperator(task_id="claim_reply_marker", python_callable=work, retries=0)
"""


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_claim_whose_reply_is_lost_still_runs_once_in_its_try(
    store: Store, children: Children, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = tmp_path / "ran.log"
    dags = _dags(tmp_path, "lost_reply_dag", _ONCE_DAG, log=str(ran))
    children.env["DEFERRAL_DAGS_FOLDER"] = str(dags)
    children.env["DEFERRAL_WORKER_HEARTBEAT_S"] = "0.2"
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    dag = DagBag(dags).get_dag("lost_reply")

    proxy = PgProxy(children.env["DEFERRAL_DATABASE_URL"])
    async with (
        explained(children),
        proxy.running(),
        run_engine(store, worker=False, triggerer=False) as engine,
    ):
        # Without recovery the unacknowledged claim is reaped after this, failing the task.
        engine.scheduler.zombie_threshold_s = 1.0
        children.env["DEFERRAL_DATABASE_URL"] = proxy.url
        # The claim's reply is the first to carry the task's id: cut there, after the commit.
        proxy.cut_reply_containing(b"claim_reply_marker")
        worker = children.start("worker", name="worker")
        await engine.start_run(dag)
        await wait_until(lambda: _run_ended(store, "lost_reply"), what="the run to end")
        assert proxy.cuts == 1
        assert _alive(worker), children.output()

    (ti,) = (await _tis(store, "lost_reply")).values()
    assert ti.state == "success", ti.error
    assert ti.try_number == 1
    assert _runs(ran) == ["try-1"]


# -- connections killed again and again --------------------------------------------------------

_CHURN_DAG = """
    import time
    from engine import DAG
    from operators.python import PythonOperator

    def work(task_instance_id, try_number):
        with open({log!r}, "a") as f:
            f.write(f"{{task_instance_id}}:{{try_number}}\\n")
        time.sleep(0.02)  # a little work, so that kills land while tasks run
        return try_number

    with DAG(dag_id="churn"):
        for chain in range({chains}):
            previous = None
            for step in range({steps}):
                task = PythonOperator(
                    task_id=f"c{{chain}}_s{{step}}", python_callable=work, retries=0,
                    op_kwargs={{"task_instance_id": f"c{{chain}}_s{{step}}"}},
                )
                if previous is not None:
                    previous >> task
                previous = task
"""


#: The churn DAG: this many parallel chains of this many tasks.
CHAINS, STEPS = 4, 10


def _tagged(url: str, name: str) -> str:
    parts = urllib.parse.urlsplit(url)
    query = [*urllib.parse.parse_qsl(parts.query), ("application_name", name)]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


#: Backends killed at most during the storm (runs here killed 230-400 when unbounded).
MAX_KILLS = 300


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_worker_and_scheduler_survive_connections_killed_under_them(
    db_url: str, children: Children, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = tmp_path / "ran.log"
    dags = _dags(
        tmp_path, "churn_dag", _CHURN_DAG, log=str(ran), chains=str(CHAINS), steps=str(STEPS)
    )
    children.env["DEFERRAL_DAGS_FOLDER"] = str(dags)
    children.env["DEFERRAL_WORKER_HEARTBEAT_S"] = "0.2"
    children.env["DEFERRAL_SCHEDULER_INTERVAL_S"] = "0.2"
    children.env["DEFERRAL_ZOMBIE_THRESHOLD_S"] = "3"
    # The test's own connections carry a name, so that it kills only the children's.
    store = await Store.connect(_tagged(db_url, "deferral_test"), pool_size=2)
    kills = 0
    stop_killing = anyio.Event()

    async def killer() -> None:
        # From before the children start (registration, the first DAG sync, LISTEN) until the
        # run ends or MAX_KILLS backends were killed: the faults are real and many, and the run
        # must then end (a loaded machine must not turn the storm into a livelock of the test).
        nonlocal kills
        while not stop_killing.is_set() and kills < MAX_KILLS:
            kills += await with_db_retry("kill backends", lambda: _kill_children(store))
            # Paces the faults (it waits for nothing): a kill every 10-100 ms.
            await anyio.sleep(random.uniform(0.01, 0.1))

    try:
        async with explained(children), anyio.create_task_group() as tg:
            tg.start_soon(killer)
            children.env["DEFERRAL_DATABASE_URL"] = _tagged(db_url, "deferral_worker")
            worker = children.start("worker", "--slots", "4", name="worker")
            children.env["DEFERRAL_DATABASE_URL"] = _tagged(db_url, "deferral_scheduler")
            scheduler = children.start("scheduler", name="scheduler")

            async def ready() -> bool:
                assert _alive(worker, scheduler), children.output()
                return await with_db_retry("read", lambda: store.get_dag("churn")) is not None

            await wait_until(ready, what="the scheduler's DAG sync")
            now = await store.now()
            await store.create_dag_run("churn", "run1", logical_date=now)

            async def ended() -> bool:
                assert _alive(worker, scheduler), children.output()
                return await _run_ended(store, "churn")

            await wait_until(ended, timeout_s=120, what="the run to end")
            stop_killing.set()
            assert _alive(worker, scheduler), children.output()
            tis = await _tis(store, "churn")
            assert len(tis) == CHAINS * STEPS
            assert {t.state for t in tis.values()} == {"success"}, {
                k: (t.state, t.error) for k, t in tis.items() if t.state != "success"
            }
            assert {t.try_number for t in tis.values()} == {1}
            runs = _runs(ran)
            assert sorted(runs) == sorted(f"{k}:1" for k in tis)  # each ran once
            assert kills > 0
            print(f"{kills} backends of the children killed")
            worker.send_signal(signal.SIGTERM)
            scheduler.send_signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(worker.wait, 30) == 0
            assert await anyio.to_thread.run_sync(scheduler.wait, 30) == 0
    finally:
        await store.close()


async def _backends(store: Store, what: str) -> list[int]:
    async with store._pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name = $1",
            what,
        )
    return [r["pid"] for r in rows]


async def _kill_children(store: Store) -> int:
    """pg_terminate_backend every connection of the children (not the test's own)."""
    async with store._pool.acquire() as conn:
        killed: int = await conn.fetchval(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() "
            "AND application_name IN ('deferral_worker', 'deferral_scheduler')"
        )
    return killed


# -- a database outage longer than the zombie threshold ---------------------------------------

_LONG_DAG = """
    import os
    import threading
    from engine import DAG
    from operators.python import PythonOperator

    def long_task(try_number):
        with open({log!r}, "a") as f:
            f.write(f"try-{{try_number}}\\n")
        while not os.path.exists({release!r}):  # runs until the test releases it
            threading.Event().wait(0.02)
        return "survived"

    with DAG(dag_id="outage"):
        PythonOperator(task_id="long", python_callable=long_task, retries=0)
"""

#: The scheduler's zombie threshold in the outage test, and how long the outage lasts.
OUTAGE_THRESHOLD_S = 3.0
OUTAGE_S = 4.5


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_database_outage_longer_than_the_zombie_threshold_reaps_nothing(
    own_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = own_server.get_uri(database="postgres")
    ran, release = tmp_path / "ran.log", tmp_path / "release-long"
    dags = _dags(tmp_path, "outage_dag", _LONG_DAG, log=str(ran), release=str(release))
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    dag = DagBag(dags).get_dag("outage")
    logs = tmp_path / "logs"
    logs.mkdir()
    kids = Children(process_env(url, tmp_path, dags), logs)
    kids.env["DEFERRAL_WORKER_HEARTBEAT_S"] = "0.2"
    store = await Store.connect(url, pool_size=2)
    proxy = PgProxy(url)
    try:
        async with (
            explained(kids),
            proxy.running(),
            run_engine(store, worker=False, triggerer=False) as engine,
        ):
            engine.scheduler.zombie_threshold_s = OUTAGE_THRESHOLD_S
            # The worker reaches the database through a gate the test holds closed after the
            # restart until the scheduler has looked at the heartbeats: before the fix, that
            # look reaped the task every time, not only when the scheduler happened to be first.
            kids.env["DEFERRAL_DATABASE_URL"] = proxy.url
            worker = kids.start("worker", name="worker")
            await engine.start_run(dag)

            async def running() -> bool:
                return (await _tis(store, "outage"))["long"].state == "running"

            await wait_until(running, what="the worker to run the long task")
            await wait_until(lambda: _ran_once(ran), what="the task to start")
            proxy.hold()
            await anyio.to_thread.run_sync(stop_server, own_server)
            # The outage itself (it waits for nothing): longer than the zombie threshold.
            await anyio.sleep(OUTAGE_S)
            await anyio.to_thread.run_sync(start_server, own_server)
            passes = engine.scheduler.housekeeping_passes

            async def looked() -> bool:
                return engine.scheduler.housekeeping_passes > passes

            await wait_until(looked, what="a scheduler pass after the restart")
            ti = (await _tis(store, "outage"))["long"]
            assert ti.state == "running", ti.error
            proxy.release()
            assert _alive(worker), kids.output()
            release.write_text("go")
            await wait_until(lambda: _run_ended(store, "outage"), what="the run to end")
            assert _alive(worker), kids.output()
        ti = (await _tis(store, "outage"))["long"]
        assert ti.state == "success", ti.error
        assert ti.try_number == 1
        assert _runs(ran) == ["try-1"]
    finally:
        kids.stop_all()
        await store.close()


async def _ran_once(log: Path) -> bool:
    return _runs(log) == ["try-1"]
