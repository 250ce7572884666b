"""Real processes with real signals: ``python -m engine <kind>`` children on the test database.

The event loops under test run in the children (uvloop, as in production); the test's own loop
only watches the database, so these tests run on one backend.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine import DAG
from engine.dags.dagbag import DagBag
from engine.store import Store, TaskInstance
from engine.testing import run_engine
from operators.base import BaseOperator, Context
from tests.helpers import TEST_TRIGGER_ALLOW, wait_until
from tests.processes import STOP_GRACE_S, Children, explained
from tests.triggers_for_tests import FileTrigger, release_file
from triggers.base import decode_value

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

RESUMES: Counter[str] = Counter()


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


async def _wait_exit(proc: subprocess.Popen[bytes]) -> int:
    return await anyio.to_thread.run_sync(proc.wait, STOP_GRACE_S)


# -- SIGTERM to a triggerer -----------------------------------------------------------------------


class WaitForFile(BaseOperator):
    def __init__(self, *, path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path

    def execute(self, context: Context) -> Any:
        self.defer(trigger=FileTrigger(self.path), method_name="resume")

    def resume(self, context: Context, event: Any = None) -> Any:
        RESUMES[self.path] += 1
        return event["text"]


async def test_sigterm_releases_a_triggerers_triggers_to_another(
    store: Store, children: Children, tmp_path: Path
) -> None:
    files = [str(tmp_path / f"release-{i}-{uuid.uuid4().hex}") for i in range(3)]
    with DAG(dag_id="handover") as dag:
        for i, path in enumerate(files):
            WaitForFile(task_id=f"w{i}", path=path)

    async def triggerer_ids() -> list[int]:
        return [t.id for t in await store.list_triggerers()]

    async def owners() -> list[int | None]:
        return [t.triggerer_id for t in await store.list_triggers()]

    children.env["DEFERRAL_TRIGGER_ALLOW"] = TEST_TRIGGER_ALLOW
    async with explained(children):
        first = children.start("triggerer", name="triggerer-1")

        async def first_registered() -> bool:
            return len(await triggerer_ids()) == 1

        await wait_until(first_registered, what="the first triggerer to register")
        (first_id,) = await triggerer_ids()

        async with run_engine(store, triggerer=False) as engine:
            await engine.start_run(dag)

            async def held_by_first() -> bool:
                return await owners() == [first_id] * 3

            await wait_until(held_by_first, what="the first triggerer to hold the 3 triggers")

            first.send_signal(signal.SIGTERM)
            assert await _wait_exit(first) == 0
            # Released at once on the way out: unowned, and the triggerer's row gone.
            assert await owners() == [None, None, None]
            assert await triggerer_ids() == []
            deferred = await store.list_task_instances(dag_id="handover", state="deferred")
            assert len(deferred) == 3

            children.start("triggerer", name="triggerer-2")

            async def held_by_second() -> bool:
                ids = await triggerer_ids()
                return len(ids) == 1 and await owners() == ids * 3

            await wait_until(held_by_second, what="the second triggerer to adopt the 3 triggers")
            for path in files:
                release_file(path, f"done {Path(path).name}")

            async def run_ended() -> bool:
                run = await store.get_dag_run("handover", "run1")
                return run is not None and run.state != "running"

            await wait_until(run_ended, what="the run to end")

    tis = {ti.task_id: ti for ti in await store.list_task_instances(dag_id="handover")}
    run = await store.get_dag_run("handover", "run1")
    assert run is not None
    assert run.state == "success"
    for i, path in enumerate(files):
        assert tis[f"w{i}"].state == "success"
        assert tis[f"w{i}"].try_number == 1
        assert decode_value(tis[f"w{i}"].result) == f"done {Path(path).name}"
        assert RESUMES[path] == 1
    assert await store.list_triggers() == []


# -- the CLI ---------------------------------------------------------------------------------------

_CLI_TRIGGERS = """
    import asyncio
    from typing import Any
    from triggers.base import BaseTrigger, TriggerEvent

    class JobDoneTrigger(BaseTrigger):
        def __init__(self, job_id: str, delay_s: float = 0.05) -> None:
            self.job_id = job_id
            self.delay_s = delay_s

        def serialize(self) -> tuple[str, dict[str, Any]]:
            return ("cli_triggers.JobDoneTrigger", {"job_id": self.job_id, "delay_s": self.delay_s})

        async def run(self):
            await asyncio.sleep(self.delay_s)
            yield TriggerEvent({"job_id": self.job_id, "rows": 3})
"""

_CLI_DAGS = """
    from typing import Any
    from cli_triggers import JobDoneTrigger
    from engine import DAG
    from operators.base import BaseOperator
    from operators.python import PythonOperator

    class SubmitAndWait(BaseOperator):
        def execute(self, context: Any) -> None:
            self.defer(trigger=JobDoneTrigger("job-1"), method_name="complete")

        def complete(self, context: Any, event: Any = None) -> Any:
            return event

    def load() -> dict[str, int]:
        return {"loaded": 3}

    def explode() -> None:
        raise RuntimeError("the load failed")

    with DAG(dag_id="cli_ok"):
        SubmitAndWait(task_id="wait") >> PythonOperator(task_id="load", python_callable=load)

    with DAG(dag_id="cli_fail"):
        PythonOperator(task_id="explode", python_callable=explode)
"""


async def _cli(children: Children, *args: str) -> subprocess.CompletedProcess[bytes]:
    return await anyio.run_process(
        [sys.executable, "-m", "engine", *args],
        env=children.env,
        cwd=children.logs,
        check=False,
    )


async def _cli_all(
    children: Children, *commands: tuple[str, ...]
) -> list[subprocess.CompletedProcess[bytes]]:
    results: list[subprocess.CompletedProcess[bytes] | None] = [None] * len(commands)

    async def one(i: int) -> None:
        results[i] = await _cli(children, *commands[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(commands)):
            tg.start_soon(one, i)
    return [r for r in results if r is not None]


def _json_rows(result: subprocess.CompletedProcess[bytes]) -> list[dict[str, Any]]:
    assert result.returncode == 0, result.stderr.decode()
    rows = json.loads(result.stdout)
    assert isinstance(rows, list)
    assert all(isinstance(row, dict) for row in rows)
    return rows


async def test_the_cli_triggers_runs_waits_for_them_and_lists_as_json(
    store: Store, children: Children, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "cli_triggers.py").write_text(textwrap.dedent(_CLI_TRIGGERS))
    (dags / "cli_dags.py").write_text(textwrap.dedent(_CLI_DAGS))
    children.env["DEFERRAL_DAGS_FOLDER"] = str(dags)

    async with explained(children):
        children.start("scheduler", name="scheduler")
        children.start("worker", "--slots", "2", name="worker")
        children.start("triggerer", name="triggerer")

        async def ready() -> bool:
            dag_ids = {d.dag_id for d in await store.list_dags()}
            return bool(await store.list_triggerers()) and {"cli_ok", "cli_fail"} <= dag_ids

        await wait_until(ready, what="the triggerer and the scheduler's DAG sync")

        # Independent commands run side by side: each is a new Python process.
        ok, failed, unknown = await _cli_all(
            children,
            ("dags", "trigger", "cli_ok", "--dags", str(dags), "--wait"),
            ("dags", "trigger", "cli_fail", "--dags", str(dags), "--run-id", "r2", "--wait"),
            ("dags", "trigger", "no_such_dag", "--wait"),
        )
        assert ok.returncode == 0, ok.stdout.decode() + ok.stderr.decode()
        assert b"success" in ok.stdout
        assert failed.returncode == 1, failed.stdout.decode() + failed.stderr.decode()
        assert b"failed" in failed.stdout
        assert unknown.returncode != 0
        assert b"no_such_dag" in unknown.stderr

        listed = await _cli_all(
            children,
            ("tasks", "list", "--json"),
            ("dags", "list", "--json"),
            ("triggers", "list", "--json"),
        )
        tasks, trigger_rows = _json_rows(listed[0]), _json_rows(listed[2])
        assert listed[1].returncode == 0, listed[1].stderr.decode()
        dag_listing = json.loads(listed[1].stdout)
        assert dag_listing["import_errors"] == []
        dag_rows = dag_listing["dags"]
        for row in tasks:
            assert {"dag_id", "run_id", "task_id", "state", "try_number", "result"} <= set(row)
        by_task = {(row["dag_id"], row["task_id"]): row for row in tasks}
        assert set(by_task) == {("cli_ok", "wait"), ("cli_ok", "load"), ("cli_fail", "explode")}
        assert by_task["cli_ok", "wait"]["state"] == "success"
        assert by_task["cli_ok", "wait"]["result"] == {"job_id": "job-1", "rows": 3}
        assert by_task["cli_ok", "wait"]["try_number"] == 1
        assert by_task["cli_ok", "load"]["result"] == {"loaded": 3}
        assert by_task["cli_fail", "explode"]["state"] == "failed"
        assert by_task["cli_fail", "explode"]["run_id"] == "r2"
        assert by_task["cli_fail", "explode"]["result"] is None

        runs = {row["dag_id"]: row for row in dag_rows}
        assert set(runs) == {"cli_ok", "cli_fail"}
        assert runs["cli_ok"]["last_run_state"] == "success"
        assert runs["cli_fail"]["last_run_state"] == "failed"

        assert trigger_rows == []


# -- SIGKILL to a worker ---------------------------------------------------------------------------

_STUCK_DAG = """
    import threading
    from engine import DAG
    from operators.python import PythonOperator

    def work(try_number: int) -> str:
        if try_number == 1:
            threading.Event().wait()  # stuck until the process is killed
        return f"done on try {try_number}"

    with DAG(dag_id="stuck"):
        PythonOperator(task_id="work", python_callable=work, retries=1, retry_delay=0)
"""


async def test_a_killed_workers_task_is_reaped_and_retried(
    store: Store, children: Children, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "stuck_dag.py").write_text(textwrap.dedent(_STUCK_DAG))
    children.env["DEFERRAL_DAGS_FOLDER"] = str(dags)
    children.env["DEFERRAL_WORKER_HEARTBEAT_S"] = "0.2"
    monkeypatch.setattr(sys, "path", list(sys.path))  # the DagBag puts the folder on it
    dag = DagBag(dags).get_dag("stuck")

    async def work() -> TaskInstance:
        (ti,) = await store.list_task_instances(dag_id="stuck")
        return ti

    async with explained(children), run_engine(store, worker=False, triggerer=False) as engine:
        engine.scheduler.zombie_threshold_s = 2.0
        first = children.start("worker", name="worker-1")
        await engine.start_run(dag)

        async def running() -> bool:
            return bool((await work()).state == "running")

        await wait_until(running, what="the first worker to run the task")
        first.send_signal(signal.SIGKILL)
        assert await _wait_exit(first) == -signal.SIGKILL

        async def reaped() -> bool:
            return (await work()).state in ("up_for_retry", "scheduled")

        await wait_until(reaped, what="the scheduler to reap the dead worker's task")
        assert "stopped heartbeating" in (await work()).error

        children.start("worker", name="worker-2")

        async def run_ended() -> bool:
            run = await store.get_dag_run("stuck", "run1")
            return run is not None and run.state != "running"

        await wait_until(run_ended, what="the retry to finish the run")
    ti = await work()
    assert ti.state == "success"
    assert ti.try_number == 2
    assert decode_value(ti.result) == "done on try 2"
