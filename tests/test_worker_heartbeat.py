"""A worker keeps alive only the task instances it really runs: one it lost track of stops
being heartbeated, and the scheduler reaps it."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from engine import DAG
from engine.dags.dagbag import DagBag
from engine.scheduler.scheduler import Scheduler
from engine.store import Store
from engine.worker.worker import Worker
from operators.base import BaseOperator, Context
from tests.helpers import wait_until

pytestmark = pytest.mark.anyio


class WaitsForever(BaseOperator):
    async def execute(self, context: Context) -> None:
        await asyncio.Event().wait()


async def test_a_running_task_the_worker_does_not_run_is_reaped(store: Store) -> None:
    with DAG(dag_id="lost") as dag:
        WaitsForever(task_id="w")
    bag = DagBag(None)
    bag.add_dag(dag)
    await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
    worker = Worker(store, bag, slots=1, heartbeat_s=0.1, shutdown_grace_s=0.1)
    scheduler = Scheduler(store, None, interval_s=0.1, zombie_threshold_s=0.5)
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        await tg.start(worker.run)
        await store.create_dag_run("lost", "r1", logical_date=await store.now())

        async def running() -> bool:
            return bool(worker.running)

        await wait_until(running, what="the worker to run the task")
        # The worker loses track of the task (as a bug would) while the database still says
        # it runs there.
        (ti_id,) = list(worker.running)
        worker.running.pop(ti_id)

        async def reaped() -> bool:
            tis = await store.list_task_instances(dag_id="lost")
            return tis[0].state != "running"

        await wait_until(reaped, what="the scheduler to reap the task")
        worker.stop()
        scheduler.stop()
    (ti,) = await store.list_task_instances(dag_id="lost")
    assert ti.state == "failed"
    assert "stopped heartbeating" in ti.error


async def test_a_heartbeat_does_not_wait_for_a_row_another_write_holds(store: Store) -> None:
    """A worker's heartbeat and its outcome batch touch the same rows; the heartbeat waited
    for a row the batch held, the batch for one the heartbeat held (another order), and both
    stood until PostgreSQL's deadlock_timeout broke one. The heartbeat now leaves a held row
    alone (its write is under way): it returns at once, and keeps the others alive."""
    from tests.helpers import claimed_tasks

    _, worker, (held, free) = await claimed_tasks(store, 2, "hb_locked")
    before = dict(
        await store._pool.fetch(
            "SELECT id, heartbeat_at FROM deferral_task_instances WHERE id = ANY ($1::bigint[])",
            [held.id, free.id],
        )
    )
    async with store._pool.acquire() as other, other.transaction():
        await other.execute(
            "SELECT 1 FROM deferral_task_instances WHERE id = $1 FOR UPDATE", held.id
        )
        with anyio.fail_after(30):  # (blocked on the row: this fails instead of hanging)
            beat = await store.heartbeat_worker(worker, [(held.id, 1), (free.id, 1)])
        assert beat.alive
    after = dict(
        await store._pool.fetch(
            "SELECT id, heartbeat_at FROM deferral_task_instances WHERE id = ANY ($1::bigint[])",
            [held.id, free.id],
        )
    )
    assert after[held.id] == before[held.id]
    assert after[free.id] > before[free.id]
    await store.unregister_worker(worker)
