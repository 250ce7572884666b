"""Mark and clear a task whose try is running in a real worker process, in a pool of 1 slot.

A mark stops the running try (its worker cancels it, as at an execution_timeout; a child
process is stopped; a ``def`` task's thread, which cannot be stopped, keeps its slot and its
pool's until it ends) and a clear runs the task again on try 2 only once the old try has
stopped: the pool never has two tries executing at once, and nothing the old try does late
undoes the clear. A deferred task marked leaves its trigger; a shared trigger keeps running
for its other waiter, and its event changes nothing for the marked task.

The tasks write what they do to a file (``start``, ``cancelled``, ``exit``, with their try):
the order of its lines is what ran when, across processes.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine.dags.dag import DAG
from engine.dags.dagbag import DagBag
from engine.store import Store
from engine.testing import LocalEngine, run_engine
from engine.web.app import make_app
from tests.helpers import wait_until
from tests.processes import Children, explained

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


TOKEN = "mark-clear-t0ken"

_DAGS = """
    import asyncio
    import os
    import time

    from engine import DAG
    from operators.base import BaseOperator
    from operators.python import PythonOperator
    from triggers.file import FileTrigger

    MARKS = {marks!r}
    RELEASE = {release!r}
    FLAG = {flag!r}


    def mark(line):
        fd = os.open(MARKS, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, (line + "\\n").encode())  # one append: lines never interleave
        finally:
            os.close(fd)


    class LongAsync(BaseOperator):
        # Runs until the release file exists; says when it was cancelled.
        async def execute(self, context):
            n = context["try_number"]
            mark(f"start {{n}}")
            try:
                while not os.path.exists(RELEASE):
                    await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                mark(f"cancelled {{n}}")
                raise
            finally:
                mark(f"exit {{n}}")


    def long_def(try_number):
        # A thread nobody can stop: it checks the release file.
        mark(f"start {{try_number}} {{os.getpid()}}")
        try:
            while not os.path.exists(RELEASE):
                time.sleep(0.02)
        finally:
            mark(f"exit {{try_number}}")


    class WaitFile(BaseOperator):
        def execute(self, context):
            flag = FLAG + "." + context["run_id"]
            self.defer(trigger=FileTrigger(flag, poll_interval=0.05), method_name="done")

        def done(self, context, event):
            mark(f"resumed {{self.task_id}} {{context['run_id']}}")


    with DAG(dag_id="long_async"):
        LongAsync(task_id="work", pool="one")

    with DAG(dag_id="chain"):
        LongAsync(task_id="work", pool="one") >> PythonOperator(
            task_id="after", python_callable=lambda: mark("after")
        )

    with DAG(dag_id="long_def"):
        PythonOperator(task_id="work", python_callable=long_def, pool="one")

    with DAG(dag_id="isolated"):
        PythonOperator(task_id="work", python_callable=long_def, pool="one",
                       isolation="process")

    with DAG(dag_id="shared"):
        WaitFile(task_id="wait_a") >> PythonOperator(
            task_id="after_a", python_callable=lambda: mark("after_a")
        )
        WaitFile(task_id="wait_b")
"""


class Scene:
    def __init__(self, tmp_path: Path) -> None:
        self.marks = tmp_path / "marks.txt"
        self.release = tmp_path / "release"
        self.flag = tmp_path / "flag"
        self.dags = tmp_path / "dags"
        self.dags.mkdir()
        (self.dags / "marked.py").write_text(
            textwrap.dedent(_DAGS).format(
                marks=str(self.marks), release=str(self.release), flag=str(self.flag)
            )
        )
        self.bag = DagBag(self.dags)

    def dag(self, dag_id: str) -> DAG:
        return self.bag.get_dag(dag_id)

    def lines(self) -> list[str]:
        return self.marks.read_text().splitlines() if self.marks.exists() else []

    async def wait_for(self, *lines: str) -> None:
        async def written() -> bool:
            return all(line in self.lines() for line in lines)

        await wait_until(written, what=f"the task to write {lines}")


@pytest.fixture
def scene(
    tmp_path: Path, children: Children, monkeypatch: pytest.MonkeyPatch, store: Store
) -> Scene:
    monkeypatch.setattr("sys.path", list(sys.path))  # (DagBag adds the DAGs folder)
    s = Scene(tmp_path)
    children.env["DEFERRAL_DAGS_FOLDER"] = str(s.dags)
    children.env["DEFERRAL_WORKER_POLL_INTERVAL_S"] = "0.2"
    return s


async def _start_worker(children: Children, store: Store, *, heartbeat_s: float) -> None:
    """One worker of 2 slots: the pool of 1 slot, not the worker, is what holds a second try
    back."""
    children.env["DEFERRAL_WORKER_HEARTBEAT_S"] = str(heartbeat_s)
    proc = children.start("worker", "--slots", "2", name="worker")

    async def registered() -> bool:
        return bool((await store.fleet()).workers) or proc.poll() is not None

    await wait_until(registered, what="the worker to register")
    assert proc.poll() is None, children.output()


async def _running(store: Store, dag_id: str, run_id: str = "r1") -> int:
    async def running() -> bool:
        ti = await store.task_try(dag_id, run_id, "work")
        return ti is not None and ti.state == "running"

    await wait_until(running, what=f"{dag_id}.work to run")
    ti = await store.task_try(dag_id, run_id, "work")
    assert ti is not None
    return ti.id


async def _pool_in_use(store: Store) -> int:
    (pool,) = await store.list_pools("one")
    return pool.running


async def _stopped(store: Store) -> None:
    """Until the worker has reported the stopped try gone (its pool slot is free)."""

    async def free() -> bool:
        return await _pool_in_use(store) == 0

    await wait_until(free, what="the stopped try's pool slot to free")


def _ordered(lines: list[str], *expected: str) -> None:
    """``expected`` appear in ``lines`` in this order (other lines between them allowed)."""
    seen = [line for line in lines if line in expected]
    assert seen == list(expected), lines


async def _log(store: Store, dag_id: str, try_number: int) -> str:
    logs = await store.task_logs(dag_id, "r1", "work", try_number=try_number)
    return "\n".join(line.message for line in logs.lines)


async def test_a_running_task_marked_failed_stops_and_its_clear_runs_once_on_try_2(
    scene: Scene, children: Children, store: Store
) -> None:
    """Through the store's operations (the ones the page and the command line use). The
    worker's heartbeat is an hour: the stop and the report that the try has stopped travel
    by notification alone."""
    await store.set_pool("one", 1)
    async with explained(children), run_engine(store, worker=False, triggerer=False) as engine:
        await _start_worker(children, store, heartbeat_s=3600)
        await engine.start_run(scene.dag("long_async"), "r1")
        ti_id = await _running(store, "long_async")
        await scene.wait_for("start 1")

        marked = await store.mark_task(ti_id, "failed", who="tester", via="a test")
        assert marked is not None
        assert (marked.was, marked.state, marked.try_number) == ("running", "failed", 1)
        assert marked.stopping_worker_id is not None
        # The task's code was cancelled, and the stopping try held its pool slot until then.
        await scene.wait_for("cancelled 1", "exit 1")
        await _stopped(store)
        ti = await store.task_try("long_async", "r1", "work")
        assert ti is not None
        assert (ti.state, ti.error) == ("failed", "marked failed by tester from a test")

        cleared = await store.clear_task(ti_id, who="tester", via="a test")
        assert cleared is not None
        assert (cleared.was, cleared.state) == ("failed", "scheduled")
        await scene.wait_for("start 2")
        scene.release.touch()
        tis = await engine.finish("long_async", "r1")
        assert tis["__run__"]["state"] == "success", children.output()

    assert (tis["work"]["state"], tis["work"]["try_number"]) == ("success", 2)
    _ordered(scene.lines(), "start 1", "cancelled 1", "exit 1", "start 2", "exit 2")
    first = await _log(store, "long_async", 1)
    assert "marked failed by tester from a test (was running on worker" in first
    assert "try 1 stopped: marked failed by tester from a test" in first
    assert "cleared by tester from a test (was failed)" in first
    audit = [(a.action, a.target, a.detail.get("was")) for a in await store.list_audit()]
    assert audit == [
        ("clear", "long_async/r1/work", "failed"),
        ("mark_failed", "long_async/r1/work", "running"),
    ]


async def test_mark_success_and_clear_of_a_running_task_from_the_page(
    scene: Scene, children: Children, store: Store
) -> None:
    """The same through the status page's HTTP actions: mark success stops the try and runs
    the downstream task; a clear of the running try 2 stops it and runs try 3."""
    await store.set_pool("one", 1)
    async with (
        explained(children),
        run_engine(store, worker=False, triggerer=False) as engine,
        TestClient(TestServer(make_app(store, token=TOKEN))) as page,
    ):
        await _start_worker(children, store, heartbeat_s=1)
        await engine.start_run(scene.dag("chain"), "r1")
        await _running(store, "chain")
        await scene.wait_for("start 1")

        await _act(page, "/actions/mark", state="success")
        await scene.wait_for("cancelled 1", "exit 1", "after")
        await _stopped(store)
        tis = await engine.finish("chain", "r1")
        assert tis["__run__"]["state"] == "success", children.output()
        assert (tis["work"]["state"], tis["work"]["try_number"]) == ("success", 1)

        await _act(page, "/actions/clear")  # the run runs again
        await scene.wait_for("start 2")
        await _act(page, "/actions/clear")  # while try 2 runs: stopped, then try 3
        await scene.wait_for("cancelled 2", "exit 2", "start 3")
        scene.release.touch()
        tis = await engine.finish("chain", "r1")
        assert tis["__run__"]["state"] == "success", children.output()

    assert (tis["work"]["state"], tis["work"]["try_number"]) == ("success", 3)
    _ordered(
        scene.lines(),
        "start 1",
        "cancelled 1",
        "exit 1",
        "start 2",
        "cancelled 2",
        "exit 2",
        "start 3",
        "exit 3",
    )
    actions = [a.action for a in await store.list_audit()]
    assert actions == ["clear", "clear", "mark_success"]


async def _act(page: TestClient[Any, Any], path: str, **more: str) -> None:
    form = {"dag_id": "chain", "run_id": "r1", "task_id": "work", "token": TOKEN, **more}
    response = await page.post(path, data=form, allow_redirects=False)
    assert response.status == 303, await response.text()


async def test_a_def_task_marked_keeps_its_pool_slot_until_its_thread_ends(
    scene: Scene, children: Children, store: Store
) -> None:
    """A thread cannot be stopped: the worker leaves it running, as at an execution_timeout,
    and the try keeps its worker slot and its pool slot until the code returns; the cleared
    task's try 2 is not admitted before."""
    await store.set_pool("one", 1)
    async with explained(children), run_engine(store, worker=False, triggerer=False) as engine:
        await _start_worker(children, store, heartbeat_s=1)
        await engine.start_run(scene.dag("long_def"), "r1")
        ti_id = await _running(store, "long_def")
        await scene.wait_for(f"start 1 {children.procs[0].pid}")

        await store.mark_task(ti_id, "failed", who="tester")
        await store.clear_task(ti_id, who="tester")

        async def told() -> bool:
            return "its thread cannot be stopped and still runs" in await _log(store, "long_def", 1)

        await wait_until(told, what="the worker to say the thread still runs")
        # The try still holds the pool: the cleared task waits, and says why.
        assert await _pool_in_use(store) == 1
        ti = await store.task_try("long_def", "r1", "work")
        assert ti is not None
        assert (ti.state, ti.try_number) == ("scheduled", 1)
        why = await store.why_task("long_def", "r1", "work", worker_stale_s=30)
        assert why is not None
        assert why.task is not None
        assert why.task.stopping_try == 1
        assert not [line for line in scene.lines() if line.startswith("start 2")]

        scene.release.touch()  # the thread returns; try 2 starts after it
        tis = await engine.finish("long_def", "r1")
        assert tis["__run__"]["state"] == "success", children.output()

    assert (tis["work"]["state"], tis["work"]["try_number"]) == ("success", 2)
    lines = [line.rsplit(" ", 1)[0] if line.startswith("start") else line for line in scene.lines()]
    _ordered(lines, "start 1", "exit 1", "start 2", "exit 2")


async def test_an_isolated_task_marked_has_its_child_process_stopped(
    scene: Scene, children: Children, store: Store
) -> None:
    await store.set_pool("one", 1)
    async with explained(children), run_engine(store, worker=False, triggerer=False) as engine:
        await _start_worker(children, store, heartbeat_s=1)
        await engine.start_run(scene.dag("isolated"), "r1")
        ti_id = await _running(store, "isolated")

        async def started() -> bool:
            return any(line.startswith("start 1 ") for line in scene.lines())

        await wait_until(started, what="the child process to start the task")
        (line,) = [line for line in scene.lines() if line.startswith("start 1 ")]
        child = int(line.split()[-1])
        assert child != children.procs[0].pid

        await store.mark_task(ti_id, "failed", who="tester")
        await _stopped(store)  # reported only once the child is gone
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
        tis = await engine.finish("isolated", "r1")
        assert tis["__run__"]["state"] == "failed"
        assert tis["work"]["error"] == "marked failed by tester from the status page"


async def test_a_deferred_task_marked_leaves_its_shared_trigger_to_its_other_waiter(
    scene: Scene, children: Children, store: Store
) -> None:
    async with explained(children), run_engine(store, worker=False, triggerer=False) as engine:
        await _start_worker(children, store, heartbeat_s=1)
        triggerer = children.start("triggerer", name="triggerer")
        for run_id in ("r1", "r2"):
            await engine.start_run(scene.dag("shared"), run_id)
        for run_id in ("r1", "r2"):
            for task_id in ("wait_a", "wait_b"):
                await engine.wait_for_state("shared", task_id, "deferred", run_id=run_id)

        async def held() -> bool:
            return len([t for t in await store.list_triggers() if t.triggerer_id]) == 2

        await wait_until(held, what="the triggerer to run both runs' triggers")
        assert triggerer.poll() is None, children.output()
        r1 = await _tis(engine, "r1")
        (shared,) = {r1["wait_a"]["trigger_id"], r1["wait_b"]["trigger_id"]}

        # r1: wait_a is marked success; its downstream runs, the trigger keeps running for
        # wait_b, and its event resumes wait_b alone.
        await store.mark_task(r1["wait_a"]["id"], "success", who="tester")
        await engine.wait_for_state("shared", "after_a", "success", run_id="r1")
        trigger = await store.get_trigger(shared)
        assert trigger is not None
        assert trigger.waiting == 1
        (scene.flag.parent / f"{scene.flag.name}.r1").touch()
        tis = await engine.finish("shared", "r1")
        assert tis["__run__"]["state"] == "success", children.output()
        assert (tis["wait_a"]["state"], tis["wait_a"]["try_number"]) == ("success", 1)
        assert "resumed wait_b r1" in scene.lines()
        assert "resumed wait_a r1" not in scene.lines()

        # r2: both waiters marked: the trigger is dropped at once (its triggerer stops it).
        r2 = await _tis(engine, "r2")
        await store.mark_task(r2["wait_a"]["id"], "failed", who="tester")
        assert await store.get_trigger(r2["wait_a"]["trigger_id"]) is not None
        await store.mark_task(r2["wait_b"]["id"], "skipped", who="tester")
        assert await store.get_trigger(r2["wait_a"]["trigger_id"]) is None
        (scene.flag.parent / f"{scene.flag.name}.r2").touch()
        tis = await engine.finish("shared", "r2")
        assert tis["__run__"]["state"] == "failed"
        assert (tis["wait_a"]["state"], tis["wait_b"]["state"]) == ("failed", "skipped")
        assert tis["after_a"]["state"] == "upstream_failed"
        assert not [line for line in scene.lines() if line.endswith(" r2")]


async def _tis(engine: LocalEngine, run_id: str) -> dict[str, dict[str, Any]]:
    return await engine.task_instances("shared", run_id)


async def test_the_command_line_marks_clears_and_ends_runs_of_a_real_worker(
    scene: Scene, children: Children, store: Store, db_url: str
) -> None:
    """``deferral tasks mark-failed`` stops a running try in a worker process (its downstream
    cannot run); ``runs clear --yes`` runs the ended run again on try 2; ``runs mark-success``
    stops try 2 and ends the run a success without running what was left."""
    from tests.test_clear_mark_cli import cli_json

    await store.set_pool("one", 1)
    async with explained(children), run_engine(store, worker=False, triggerer=False) as engine:
        await _start_worker(children, store, heartbeat_s=1)
        await engine.start_run(scene.dag("chain"), "r1")
        await _running(store, "chain")
        await scene.wait_for("start 1")

        (marked,) = await cli_json(db_url, "tasks", "mark-failed", "chain", "r1", "work")
        assert (marked["was"], marked["state"]) == ("running", "failed")
        await scene.wait_for("cancelled 1", "exit 1")
        tis = await engine.finish("chain", "r1")
        assert tis["__run__"]["state"] == "failed", children.output()
        assert tis["after"]["state"] == "upstream_failed"

        cleared = await cli_json(db_url, "runs", "clear", "chain", "r1", "--yes")
        assert sorted((o["task_id"], o["state"]) for o in cleared) == [
            ("after", "pending"),
            ("work", "scheduled"),
        ]
        # (Try 2 starts only once try 1 is gone: the pool of 1 slot holds it back until then.)
        await scene.wait_for("start 2")
        ended = await cli_json(db_url, "runs", "mark-success", "chain", "r1")
        assert (ended["was"], ended["state"]) == ("running", "success")
        await scene.wait_for("cancelled 2", "exit 2")
        await _stopped(store)
        tis = await engine.finish("chain", "r1")

    assert tis["__run__"]["state"] == "success"
    assert (tis["work"]["state"], tis["work"]["try_number"]) == ("success", 2)
    assert tis["after"]["state"] == "success"
    assert "after" not in scene.lines()  # marked, never run
    _ordered(scene.lines(), "start 1", "cancelled 1", "exit 1", "start 2", "cancelled 2")


async def test_a_deferred_sensor_marked_success_from_the_command_line_lets_its_downstream_run(
    scene: Scene, children: Children, store: Store, db_url: str
) -> None:
    """``tasks mark-success`` of both sensors deferred on one trigger in a real triggerer: the
    trigger is released, the downstream task runs, the run succeeds without the event. A
    ``tasks clear --downstream`` then reruns the sensor on try 2, deferred anew, and its event
    resumes that try."""
    from tests.test_clear_mark_cli import cli_json

    async with explained(children), run_engine(store, worker=False, triggerer=False) as engine:
        await _start_worker(children, store, heartbeat_s=1)
        children.start("triggerer", name="triggerer")
        await engine.start_run(scene.dag("shared"), "r1")
        for task_id in ("wait_a", "wait_b"):
            await engine.wait_for_state("shared", task_id, "deferred", run_id="r1")

        async def held() -> bool:
            return any(t.triggerer_id for t in await store.list_triggers())

        await wait_until(held, what="the triggerer to run the trigger")
        (trigger,) = await store.list_triggers()

        marked = await cli_json(db_url, "tasks", "mark-success", "shared", "r1", "wait_a", "wait_b")
        assert sorted((o["task_id"], o["was"], o["left_trigger_id"]) for o in marked) == [
            ("wait_a", "deferred", trigger.id),
            ("wait_b", "deferred", trigger.id),
        ]
        assert await store.list_triggers() == []  # released
        tis = await engine.finish("shared", "r1")
        assert tis["__run__"]["state"] == "success", children.output()
        assert tis["after_a"]["state"] == "success"
        assert scene.lines() == ["after_a"]

        cleared = await cli_json(
            db_url, "tasks", "clear", "shared", "--run", "r1", "--task", "wait_a",
            "--downstream", "--yes",
        )  # fmt: skip
        assert sorted(o["task_id"] for o in cleared) == ["after_a", "wait_a"]
        await engine.wait_for_state("shared", "wait_a", "deferred", run_id="r1")
        (scene.flag.parent / f"{scene.flag.name}.r1").touch()
        tis = await engine.finish("shared", "r1")

    assert tis["__run__"]["state"] == "success", children.output()
    assert (tis["wait_a"]["state"], tis["wait_a"]["try_number"]) == ("success", 2)
    assert (tis["wait_b"]["state"], tis["wait_b"]["try_number"]) == ("success", 1)
    assert scene.lines() == ["after_a", "resumed wait_a r1", "after_a"]
