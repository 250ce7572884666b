"""Lock order between a trigger firing and a run ending: triggers, then task instances, then
runs (a firing trigger's callback request only shares its run's key lock). Each test holds a
firing triggerer's first lock on one connection, lets the other side run until it waits for a
lock, then lets the firing go on: both must commit (before, each waited for the other:
PostgreSQL's deadlock detector killed one)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable
from typing import Any

import pytest

from engine import DAG, DeadlineAlert, DeadlineReference
from engine.store import Deferral, Store, TaskOutcome
from engine.store.models import TriggerOutcome
from engine.store.triggers import write_trigger_outcomes
from engine.testing import run_engine
from operators.python import PythonOperator
from tests.helpers import wait_until, waiting_on_locks
from tests.triggers_for_tests import NeverTrigger
from triggers.base import encode_value, validate_trigger

pytestmark = pytest.mark.anyio


def _alerted_dag(dag_id: str) -> DAG:
    with DAG(
        dag_id=dag_id,
        deadline=DeadlineAlert(
            reference=DeadlineReference.DAGRUN_LOGICAL_DATE,
            interval=dt.timedelta(hours=1),
            callback="tests.test_callbacks._fail",
        ),
    ) as dag:
        PythonOperator(task_id="a", python_callable=lambda: 1)
    return dag


async def _started(store: Store, dag: DAG) -> tuple[int, Any]:
    """A run of ``dag`` (its deadline's timer trigger made) and its claimed task ``a``."""
    async with run_engine(store, worker=False, scheduler=False, triggerer=False) as engine:
        await engine.start_run(dag)
    run = await store.get_dag_run(dag.dag_id, "run1")
    assert run is not None
    worker = await store.register_worker("test", 1, 10)
    (ti,) = [t for t in (await store.claim_tasks(worker, 10)).claimed if t.dag_id == dag.dag_id]
    return run.id, (worker, ti)


async def _fire_while(store: Store, trigger_ids: list[int], other: Awaitable[Any]) -> Any:
    """Fire ``trigger_ids`` (claimed by a triggerer) as a triggerer does, but with the first
    of them locked before ``other`` starts, and the rest of the firing only once ``other``
    waits for a lock. Returns what ``other`` returned; both must commit."""
    triggerer = await store.register_triggerer("test", 1, 100, 60.0)
    claimed = {t.id: t for t in (await store.claim_triggers(triggerer, 100)).claimed}
    outcomes = [
        TriggerOutcome(trigger_id=i, fence=claimed[i].fence, kind="event", payload=None)
        for i in trigger_ids
    ]
    async with store._pool.acquire() as watch, store._pool.acquire() as conn:
        async with conn.transaction():
            await conn.execute(store._q["lock_owned_triggers"], triggerer, trigger_ids[:1])
            task = asyncio.ensure_future(other)
            try:
                await wait_until(
                    lambda: waiting_on_locks(watch), what="the other side to wait for a lock"
                )
                fired = await write_trigger_outcomes(
                    conn, store._q, store.keyring, triggerer, outcomes
                )
            except BaseException:
                task.cancel()
                raise
        assert fired.accepted == frozenset(trigger_ids)
        return await task


async def test_a_deadline_firing_as_the_scheduler_ends_the_run(store: Store) -> None:
    dag = _alerted_dag("lo_finish")
    run_pk, (worker, ti) = await _started(store, dag)
    done = TaskOutcome(ti_id=ti.id, worker_id=worker, try_number=1, kind="success")
    assert await store.finish_tasks([done])
    (timer,) = await store.list_triggers(100)
    ended = await _fire_while(store, [timer.id], store.finish_dag_runs([run_pk]))
    assert [(r.run_id, r.state) for r in ended] == [("run1", "success")]
    # The deadline fired first: its alert is requested; the run's end found it gone.
    kinds = [r["kind"] for r in await store._pool.fetch(store._q["list_callback_requests"])]
    assert kinds == ["deadline"]


async def test_a_deadline_and_a_task_firing_as_the_run_is_marked(store: Store) -> None:
    dag = _alerted_dag("lo_mark")
    run_pk, (worker, ti) = await _started(store, dag)
    trigger = validate_trigger(NeverTrigger("lock-order"))
    deferral = Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name="resume",
        method_kwargs=encode_value({}),
        timeout_s=None,
    )
    assert await store.defer_task(ti.id, worker, deferral)
    timer, waited = sorted(t.id for t in await store.list_triggers(100))  # timer: the older
    marked = await _fire_while(
        store, [timer, waited], store.mark_run(dag.dag_id, "run1", "failed", who="tester")
    )
    assert marked.state == "failed"
    assert await store.list_triggers(100) == []
    del run_pk
