"""Lifecycle: a ``stop()`` that arrives before ``run()`` is not lost (the worker and the
scheduler start, see it and return; nothing is claimed)."""

from __future__ import annotations

import anyio
import pytest

from engine import DAG
from engine.dagbag import DagBag
from engine.scheduler import Scheduler
from engine.store import Store
from engine.worker import Worker
from operators.python import PythonOperator
from tests.helpers import WAIT_S

pytestmark = pytest.mark.anyio


def _noop() -> None:
    return None


async def test_a_worker_stopped_before_run_returns_and_claims_nothing(store: Store) -> None:
    with DAG(dag_id="early") as dag:
        PythonOperator(task_id="t", python_callable=_noop)
    bag = DagBag(None)
    bag.add_dag(dag)
    await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
    await store.create_dag_run("early", "r1", logical_date=await store.now())
    worker = Worker(store, bag, slots=1, poll_interval_s=0.05)
    worker.stop()
    # A lost stop() would leave run() claiming and running forever: the guard fails the test.
    with anyio.fail_after(WAIT_S):
        await worker.run()
    (ti,) = await store.list_task_instances(dag_id="early")
    assert ti["state"] == "scheduled"
    assert worker.finished == 0


async def test_a_scheduler_stopped_before_run_returns(store: Store) -> None:
    scheduler = Scheduler(store, None, interval_s=0.05)
    scheduler.stop()
    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tg:
            await tg.start(scheduler.run)
    assert scheduler.housekeeping_passes == 0
