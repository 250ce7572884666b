"""XCom across a worker killed with SIGKILL between a task's return and the write of its
outcome: the try is reaped and retried, and its return value and pushes appear once, those of
the try that succeeded, written with its outcome."""

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
from triggers.base import decode_value

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

_DAG = """
    from typing import Any

    from engine import DAG
    from operators.python import PythonOperator

    def produce(ti: Any, try_number: int) -> dict[str, int]:
        ti.xcom_push("pushed", try_number)
        return {"try": try_number}

    def consume(ti: Any) -> list[Any]:
        return [ti.xcom_pull(task_ids="produce"), ti.xcom_pull("produce", "pushed")]

    with DAG(dag_id="xkill"):
        (
            PythonOperator(task_id="produce", python_callable=produce, retries=2, retry_delay=0)
            >> PythonOperator(task_id="consume", python_callable=consume)
        )
"""


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


async def test_a_worker_killed_between_return_and_write_leaves_one_xcom(
    store: Store, children: Children, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "xkill_dag.py").write_text(textwrap.dedent(_DAG))
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
        spare_env, children.env = children.env, armed
        try:
            victim = children.start("worker", name="worker-armed")
        finally:
            children.env = spare_env

        async def dag_known() -> bool:
            return any(d.dag_id == "xkill" for d in await store.list_dags())

        await wait_until(dag_known, what="the scheduler to record the DAG")
        await store.create_dag_run("xkill", "run1", logical_date=dt.datetime.now(dt.UTC))
        code = await anyio.to_thread.run_sync(victim.wait, 60.0)
        assert code == -signal.SIGKILL, f"the worker did not die at its crash point ({code})"
        # (Nothing of the killed try's return value was written with an outcome.)
        tis = {ti.task_id: ti for ti in await store.list_task_instances(dag_id="xkill")}
        assert tis["produce"].result is None
        children.start("worker", name="worker-spare")

        async def run_ended() -> bool:
            run = await store.get_dag_run("xkill", "run1")
            return run is not None and run.state != "running"

        await wait_until(run_ended, timeout_s=90, what="the run to end after the crash")

    tis = {ti.task_id: ti for ti in await store.list_task_instances(dag_id="xkill")}
    produce = tis["produce"]
    assert produce.state == "success"
    assert produce.try_number == 2
    stored = await store.xcom_of_task("xkill", "run1", "produce")
    assert stored is not None
    assert {k: decode_value(v) for k, v in stored.items()} == {
        "return_value": {"try": 2},
        "pushed": 2,
    }
    consume = tis["consume"]
    assert consume.result is not None
    assert decode_value(consume.result) == [{"try": 2}, 2]
    async with store._pool.acquire() as conn:
        rows = await conn.fetchval(
            "SELECT count(*) FROM deferral_xcom WHERE ti_id = $1", produce.id
        )
    assert rows == 1
