"""SIGKILL a real engine process at each named crash point: nothing is lost, nothing resumes
twice, every task ends.

Each case arms one process (``DEFERRAL_CRASH_AT``), runs a DAG of deferring tasks until that
process dies at the point, starts an unarmed replacement, and checks the run: every task
succeeds, and no try of any task ran its resumed method more than once (the resumed methods
append ``task try`` lines to a file shared by all processes).
"""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import anyio
import pytest

from engine.runtime.crashpoints import CRASH_POINTS
from engine.security.keys import Keyring, generate_key
from engine.store import Store
from tests.helpers import wait_until
from tests.processes import Children, explained

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

TASKS = 4

_DAG = """
    import os
    from typing import Any

    from engine import DAG
    from operators.base import BaseOperator
    from triggers.temporal import TimeDeltaTrigger

    LOG = os.environ["CRASH_TEST_LOG"]

    class WaitThenResume(BaseOperator):
        def execute(self, context: Any) -> None:
            # (With resume kwargs: they are stored encrypted, and key rotation rewrites them.)
            self.defer(
                trigger=TimeDeltaTrigger(0.3), method_name="resume", kwargs={"task": self.task_id}
            )

        def resume(self, context: Any, event: Any = None, task: str = "") -> int:
            assert task == context["task_id"]
            with open(LOG, "a") as f:
                f.write(f"{context['task_id']} {context['try_number']}\\n")
            return int(context["try_number"])

    with DAG(dag_id="crash"):
        for i in range({tasks}):
            WaitThenResume(task_id=f"t{i}", retries=3, retry_delay=0)
"""

#: Which process each crash point is in.
_KIND = {"worker": "worker", "triggerer": "triggerer", "dagbag": "scheduler"}


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


def test_every_crash_point_has_a_case() -> None:
    assert set(CRASH_POINTS) == {*POINTS, ROTATION, *CALLBACK_POINTS}


ROTATION = "keys.rotate.after_batch"
#: The callback requests' points: tests/test_callbacks_processes.py kills a worker at each.
CALLBACK_POINTS = {"worker.callback.before_run", "worker.callback.after_run"}
POINTS = sorted(set(CRASH_POINTS) - {ROTATION} - CALLBACK_POINTS)


@pytest.mark.parametrize("point", POINTS)
async def test_sigkill_at_crash_point_loses_nothing(
    point: str, store: Store, children: Children, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "crash_dag.py").write_text(textwrap.dedent(_DAG.replace("{tasks}", str(TASKS))))
    resumes = tmp_path / "resumes.log"
    resumes.touch()
    children.env.update(
        DEFERRAL_DAGS_FOLDER=str(dags),
        CRASH_TEST_LOG=str(resumes),
        DEFERRAL_WORKER_HEARTBEAT_S="0.2",
        DEFERRAL_ZOMBIE_THRESHOLD_S="2",
        DEFERRAL_SCHEDULER_INTERVAL_S="0.2",
        DEFERRAL_TRIGGERER_LEASE_S="3",
        DEFERRAL_WORKER_POLL_INTERVAL_S="0.2",
        DEFERRAL_TRIGGERER_POLL_INTERVAL_S="0.2",
    )
    kind = _KIND[point.split(".", 1)[0]]
    armed = {**children.env, "DEFERRAL_CRASH_AT": point}

    def start(which: str, *, crash: bool = False) -> subprocess.Popen[bytes]:
        env, children.env = children.env, (armed if crash else children.env)
        try:
            return children.start(which, name=f"{which}-{'armed' if crash else 'spare'}")
        finally:
            children.env = env

    async with explained(children):
        victim = start(kind, crash=True)
        for other in ("scheduler", "worker", "triggerer"):
            if other != kind:
                start(other)

        async def dag_known() -> bool:
            return any(d.dag_id == "crash" for d in await store.list_dags())

        if kind != "scheduler":
            await wait_until(dag_known, what="the scheduler to record the DAG")
            await store.create_dag_run(
                "crash", "run1", logical_date=dt.datetime.now(dt.UTC), conf=None
            )
        code = await anyio.to_thread.run_sync(victim.wait, 60.0)
        assert code == -signal.SIGKILL, f"{kind} did not die at {point} (exit {code})"
        start(kind)
        if kind == "scheduler":
            await wait_until(dag_known, what="the new scheduler to record the DAG")
            await store.create_dag_run(
                "crash", "run1", logical_date=dt.datetime.now(dt.UTC), conf=None
            )

        async def run_ended() -> bool:
            run = await store.get_dag_run("crash", "run1")
            return run is not None and run.state != "running"

        await wait_until(run_ended, timeout_s=90, what="the run to end after the crash")

    tis = await store.list_task_instances(dag_id="crash")
    assert {ti.task_id: ti.state for ti in tis} == {f"t{i}": "success" for i in range(TASKS)}
    run = await store.get_dag_run("crash", "run1")
    assert run is not None
    assert run.state == "success"
    lines = Counter(resumes.read_text().split("\n")[:-1])
    twice = {line: n for line, n in lines.items() if n > 1}
    assert not twice, f"resumed more than once in one try: {twice}"
    for ti in tis:
        # The try that succeeded resumed exactly once.
        assert lines[f"{ti.task_id} {ti.try_number}"] == 1
    assert await store.list_triggers() == []


async def test_sigkill_during_key_rotation_loses_nothing(
    store: Store, children: Children, tmp_path: Path
) -> None:
    """``deferral keys rotate`` killed after its first batch and run again: every value ends
    under the new key, and engine processes holding only the new key finish every task."""
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "crash_dag.py").write_text(textwrap.dedent(_DAG.replace("{tasks}", str(TASKS))))
    resumes = tmp_path / "resumes.log"
    resumes.touch()
    old_key, new_key = children.env["DEFERRAL_FERNET_KEY"], generate_key()
    children.env.update(DEFERRAL_DAGS_FOLDER=str(dags), CRASH_TEST_LOG=str(resumes))

    async def rotate(*, crash: bool) -> int:
        env = {**children.env, "DEFERRAL_FERNET_KEY": f"{new_key},{old_key}"}
        if crash:
            env["DEFERRAL_CRASH_AT"] = ROTATION
        done = await anyio.run_process(
            [sys.executable, "-m", "engine", "keys", "rotate", "--batch-size", "1"],
            env=env,
            check=False,
        )
        return done.returncode

    async with explained(children):
        children.start("scheduler", name="scheduler")
        worker = children.start("worker", name="worker-old-key")

        async def dag_known() -> bool:
            return any(d.dag_id == "crash" for d in await store.list_dags())

        await wait_until(dag_known, what="the scheduler to record the DAG")
        await store.create_dag_run("crash", "run1", logical_date=dt.datetime.now(dt.UTC))

        async def all_deferred() -> bool:
            tis = await store.list_task_instances(dag_id="crash", state="deferred")
            return len(tis) == TASKS

        # No triggerer yet: every task waits, with its trigger and resume kwargs stored.
        await wait_until(all_deferred, what="every task to defer")
        worker.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(worker.wait, 30.0) == 0
        assert await rotate(crash=True) == -signal.SIGKILL
        assert await rotate(crash=False) == 0

        # Nothing is left that only the old key opens.
        only_new = Keyring([new_key])
        async with store._pool.acquire() as conn:
            stored = [r["kwargs"] for r in await conn.fetch("SELECT kwargs FROM deferral_triggers")]
            stored += [
                r["next_kwargs"]
                for r in await conn.fetch(
                    "SELECT next_kwargs FROM deferral_task_instances WHERE next_kwargs IS NOT NULL"
                )
            ]
        assert len(stored) == 2 * TASKS
        for value in stored:
            only_new.decrypt(value)

        children.env["DEFERRAL_FERNET_KEY"] = new_key
        children.start("worker", name="worker-new-key")
        children.start("triggerer", name="triggerer-new-key")

        async def run_ended() -> bool:
            run = await store.get_dag_run("crash", "run1")
            return run is not None and run.state != "running"

        await wait_until(run_ended, timeout_s=60, what="the run to end under the new key")
    tis = await store.list_task_instances(dag_id="crash")
    assert {ti.task_id: ti.state for ti in tis} == {f"t{i}": "success" for i in range(TASKS)}
    assert Counter(resumes.read_text().split("\n")[:-1]) == Counter(f"t{i} 1" for i in range(TASKS))
