"""Callbacks across real engine processes: a worker SIGKILLed while it holds a claimed callback
request loses nothing (another worker runs the callback once the dead one's row is reaped:
exactly once), and one killed after the callback ran but before the request was deleted has
it run again (at least once: the documented bound of a crash mid-callback).

The callbacks append a line to a file every process shares; each case arms one worker
(``DEFERRAL_CRASH_AT``) and starts an unarmed one after it died.
"""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import textwrap
from pathlib import Path

import anyio
import pytest

from engine.store import Store
from tests.helpers import wait_until
from tests.processes import Children, explained

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

_DAG = """
    import os

    from engine import DAG
    from operators.python import PythonOperator

    LOG = os.environ["CALLBACK_TEST_LOG"]

    def note(context):
        with open(LOG, "a") as f:
            f.write(f"{context['task_id']} {context['try_number']} {os.getpid()}\\n")

    def fail():
        raise ValueError("boom")

    with DAG(dag_id="cb_kill", default_args={"on_failure_callback": note}):
        PythonOperator(task_id="bad", python_callable=fail)
"""


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


@pytest.mark.parametrize(
    ("point", "runs"),
    [("worker.callback.before_run", {1}), ("worker.callback.after_run", {2})],
)
async def test_a_killed_worker_does_not_lose_its_pending_callback(
    point: str, runs: set[int], store: Store, children: Children, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "cb_kill.py").write_text(textwrap.dedent(_DAG))
    log = tmp_path / "callbacks.log"
    log.touch()
    children.env.update(
        DEFERRAL_DAGS_FOLDER=str(dags),
        CALLBACK_TEST_LOG=str(log),
        DEFERRAL_WORKER_HEARTBEAT_S="0.2",
        DEFERRAL_ZOMBIE_THRESHOLD_S="2",
        DEFERRAL_SCHEDULER_INTERVAL_S="0.2",
        DEFERRAL_WORKER_POLL_INTERVAL_S="0.2",
    )
    armed = {**children.env, "DEFERRAL_CRASH_AT": point}

    def start(name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        saved, children.env = children.env, env
        try:
            return children.start("worker", name=name)
        finally:
            children.env = saved

    async with explained(children):
        children.start("scheduler", name="scheduler")
        victim = start("worker-armed", armed)

        async def dag_known() -> bool:
            return any(d.dag_id == "cb_kill" for d in await store.list_dags())

        await wait_until(dag_known, what="the scheduler to record the DAG")
        await store.create_dag_run(
            "cb_kill", "run1", logical_date=dt.datetime.now(dt.UTC), conf=None
        )
        code = await anyio.to_thread.run_sync(victim.wait, 60.0)
        assert code == -signal.SIGKILL, f"the worker did not die at {point} (exit {code})"
        start("worker-spare", dict(children.env))

        async def callbacks_done() -> bool:
            return await store.list_callback_requests() == []

        await wait_until(callbacks_done, timeout_s=60, what="the callback request to be run")

    tis = await store.list_task_instances(dag_id="cb_kill")
    assert [(ti.task_id, ti.state) for ti in tis] == [("bad", "failed")]
    lines = log.read_text().split("\n")[:-1]
    assert {line.rsplit(" ", 1)[0] for line in lines} == {"bad 1"}
    assert len(lines) in runs, lines
    # The spare ran it (after the victim's row was reaped, or its lease passed).
    assert lines[-1].rsplit(" ", 1)[1] != str(victim.pid)
