"""Branching with real engine processes: a worker SIGKILLed before a branch's outcome is
written leaves nothing skipped (the skips are written with the branch's success, in one
statement), and the retried branch skips them once it succeeds."""

from __future__ import annotations

import datetime as dt
import signal
import textwrap
from pathlib import Path

import anyio
import pytest

from engine.store import Store
from tests.helpers import wait_until
from tests.processes import Children, explained

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

_DAG = """
    from engine import DAG
    from operators.python import BranchPythonOperator, PythonOperator

    def noop():
        return None

    with DAG(dag_id="br_crash"):
        branch = BranchPythonOperator(
            task_id="branch", python_callable=lambda: "b", retries=1, retry_delay=0
        )
        branch >> [
            PythonOperator(task_id="a", python_callable=noop),
            PythonOperator(task_id="b", python_callable=noop),
        ]
"""


async def test_a_worker_killed_before_the_branch_outcome_skips_nothing(
    store: Store, children: Children, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "br_crash.py").write_text(textwrap.dedent(_DAG))
    children.env.update(
        DEFERRAL_DAGS_FOLDER=str(dags),
        DEFERRAL_WORKER_HEARTBEAT_S="0.2",
        DEFERRAL_ZOMBIE_THRESHOLD_S="2",
        DEFERRAL_SCHEDULER_INTERVAL_S="0.2",
        DEFERRAL_WORKER_POLL_INTERVAL_S="0.2",
    )
    armed = {**children.env, "DEFERRAL_CRASH_AT": "worker.outcome.before_write"}
    async with explained(children):
        children.start("scheduler", name="scheduler")

        async def dag_known() -> bool:
            return any(d.dag_id == "br_crash" for d in await store.list_dags())

        await wait_until(dag_known, what="the scheduler to record the DAG")
        await store.create_dag_run("br_crash", "r1", logical_date=dt.datetime.now(dt.UTC))
        env, children.env = children.env, armed
        try:
            victim = children.start("worker", name="worker-armed")
        finally:
            children.env = env
        code = await anyio.to_thread.run_sync(victim.wait, 60.0)
        assert code == -signal.SIGKILL, f"the worker did not die at the outcome (exit {code})"

        states = {t.task_id: t.state for t in await store.list_task_instances(dag_id="br_crash")}
        # Killed before the branch's outcome: nothing of it is written, no skip either.
        assert states == {"branch": "running", "a": "pending", "b": "pending"}

        children.start("worker", name="worker-spare")

        async def run_ended() -> bool:
            run = await store.get_dag_run("br_crash", "r1")
            return run is not None and run.state != "running"

        await wait_until(run_ended, timeout_s=90, what="the run to end after the crash")

    tis = {t.task_id: t for t in await store.list_task_instances(dag_id="br_crash")}
    assert {k: t.state for k, t in tis.items()} == {
        "branch": "success",
        "a": "skipped",
        "b": "success",
    }
    assert tis["branch"].try_number == 2
