"""Deadlines in one place: a deferral ends at the earliest of the trigger's timeout, the task's
execution_timeout (counted from the start of the try, not from the claim) and a sensor's
timeout; defer_task picks it on the database clock and the timeout error names it. And defer()
encodes the resume kwargs once: the worker stores those bytes."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import asyncpg
import pytest

from engine import DAG
from engine.store import Deferral, Store
from engine.testing import run_engine
from operators.base import BaseOperator, Context, TaskDeferred
from operators.python import PythonOperator
from operators.sensors import BaseSensorOperator
from tests.helpers import wait_until
from tests.triggers_for_tests import NeverTrigger, WaitTrigger
from triggers.base import decode_value, encode_value, validate_trigger

pytestmark = pytest.mark.anyio

#: How long the task works before it defers (the part of the try the old cap forgot).
WORK_S = 2.0


class _WorksThenDefers(BaseOperator):
    """Works for WORK_S, then waits on a trigger that never fires, with a 60 s timeout."""

    def execute(self, context: Context) -> None:
        time.sleep(WORK_S)  # the task's own work, not the test waiting for something
        self.defer(
            trigger=NeverTrigger(f"works-{context['run_id']}"),
            method_name="resume",
            timeout=dt.timedelta(seconds=60),
        )

    def resume(self, context: Context, event: Any = None) -> str:
        return "resumed"  # pragma: no cover - the trigger never fires


async def _row(db_url: str, ti_id: int) -> asyncpg.Record:
    conn = await asyncpg.connect(db_url)
    try:
        row = await conn.fetchrow(
            "SELECT state, error, try_started_at, started_at, ended_at, trigger_timeout_at, "
            "deadline_kind, try_number FROM deferral_task_instances WHERE id = $1",
            ti_id,
        )
    finally:
        await conn.close()
    assert row is not None
    return row


async def test_execution_timeout_ends_a_deferral_counted_from_the_start_of_the_try(
    store: Store, db_url: str
) -> None:
    with DAG(dag_id="deadline") as dag:
        _WorksThenDefers(task_id="t", execution_timeout=3)
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        (ti,) = await store.list_task_instances(dag_id="deadline")

        async def deferred() -> bool:
            return (await _row(db_url, ti.id))["state"] == "deferred"

        # (It waits about a second deferred, between its 2 s of work and the 3 s cap.)
        await wait_until(deferred, what="the task to defer")
        parked = await _row(db_url, ti.id)
        # The stored deadline is the try's start plus execution_timeout, exactly (one database
        # clock): not the claim plus it, nor now plus the 60 s trigger timeout.
        assert parked["deadline_kind"] == "execution_timeout"
        assert parked["trigger_timeout_at"] == parked["try_started_at"] + dt.timedelta(seconds=3)
        tis = await engine.finish("deadline", "run1")
    row = await _row(db_url, ti.id)
    assert row["state"] == "failed"
    assert row["error"].startswith("execution_timeout of 3s passed while deferred"), row["error"]
    assert row["try_number"] == 1
    lasted = row["ended_at"] - row["try_started_at"]
    # Ended by the 3 s cap (never before it), far from the 60 s trigger timeout.
    assert dt.timedelta(seconds=3) <= lasted < dt.timedelta(seconds=30), lasted
    assert tis["__run__"]["state"] == "failed"


# -- defer_task's choice, one case at a time (store level, database clock) --------------------


class _Sensor(BaseSensorOperator):
    def poke(self, context: Context) -> bool:
        return False  # pragma: no cover - driven through the store, never run


async def _claimed(store: Store, dag: DAG) -> tuple[int, dict[str, Any]]:
    await store.upsert_dag(dag.dag_id, f"{dag.dag_id}.py", dag.serialize_tasks(), None)
    await store.create_dag_run(dag.dag_id, "r1", logical_date=await store.now())
    worker = await store.register_worker("test", 1, 10)
    claimed = (await store.claim_tasks(worker, 10)).claimed
    return worker, {ti.task_id: ti for ti in claimed}


def _deferral(tag: str, timeout_s: float | None) -> Deferral:
    trigger = validate_trigger(NeverTrigger(tag))
    return Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name="resume",
        method_kwargs=encode_value({}),
        timeout_s=timeout_s,
    )


def _noop() -> None:
    return None


async def test_defer_task_stores_the_earliest_deadline_and_which_one_it_is(
    store: Store, db_url: str
) -> None:
    with DAG(dag_id="kinds") as dag:
        PythonOperator(task_id="cap_first", python_callable=_noop, execution_timeout=3)
        PythonOperator(task_id="trigger_first", python_callable=_noop, execution_timeout=3600)
        PythonOperator(task_id="no_cap", python_callable=_noop)
        PythonOperator(task_id="no_deadline", python_callable=_noop)
        _Sensor(task_id="sensor", timeout=600)
        _Sensor(task_id="sensor_capped", timeout=600, execution_timeout=5)
    worker, tis = await _claimed(store, dag)
    timeouts = {"cap_first": 60.0, "trigger_first": 10.0, "no_cap": 10.0, "no_deadline": None,
                "sensor": 600.0, "sensor_capped": 600.0}  # fmt: skip
    for name, timeout_s in timeouts.items():
        assert await store.defer_task(tis[name].id, worker, _deferral(name, timeout_s))
    rows = {name: await _row(db_url, tis[name].id) for name in timeouts}
    assert {name: row["deadline_kind"] for name, row in rows.items()} == {
        "cap_first": "execution_timeout",
        "trigger_first": "trigger_timeout",
        "no_cap": "trigger_timeout",
        "no_deadline": None,
        "sensor": "sensor_timeout",
        "sensor_capped": "execution_timeout",
    }
    for name, cap in (("cap_first", 3), ("sensor_capped", 5)):
        row = rows[name]
        assert row["trigger_timeout_at"] == row["try_started_at"] + dt.timedelta(seconds=cap)
    assert rows["no_deadline"]["trigger_timeout_at"] is None
    for name in ("trigger_first", "no_cap", "sensor"):
        # now() of the deferring statement plus the trigger's timeout: after the claim.
        row = rows[name]
        assert row["trigger_timeout_at"] >= row["started_at"] + dt.timedelta(
            seconds=timeouts[name] or 0
        )


async def test_each_deadline_is_named_in_the_timeout_error(store: Store, db_url: str) -> None:
    with DAG(dag_id="named") as dag:
        PythonOperator(task_id="cap", python_callable=_noop, execution_timeout=0)
        PythonOperator(task_id="trig", python_callable=_noop, retries=1, retry_delay=0)
        _Sensor(task_id="sensor", timeout=0)
    worker, tis = await _claimed(store, dag)
    for name, timeout_s in (("cap", 60.0), ("trig", 0.0), ("sensor", 0.0)):
        assert await store.defer_task(tis[name].id, worker, _deferral(name, timeout_s))

    # Every deadline is at or before the deferring statement's now(): the backstop ends them.
    async def all_ended() -> bool:
        await store.timeout_deferrals(None)
        return not await store.list_task_instances(dag_id="named", state="deferred")

    await wait_until(all_ended, what="the deadlines to pass")
    rows = {name: await _row(db_url, tis[name].id) for name in ("cap", "trig", "sensor")}
    assert rows["cap"]["error"].startswith("execution_timeout of 0s passed while deferred")
    assert rows["cap"]["state"] == "failed"
    assert rows["trig"]["error"].startswith("deferral timed out: the trigger did not fire")
    assert rows["trig"]["state"] == "up_for_retry"  # a trigger timeout uses retries
    assert rows["sensor"]["error"].startswith("sensor timed out after "), rows["sensor"]["error"]
    assert "its timeout" in rows["sensor"]["error"]
    assert rows["sensor"]["state"] == "failed"
    assert all(row["deadline_kind"] is None for row in rows.values())


# -- the resume kwargs are encoded once, by defer() ---------------------------------------------


class _ChangesItsMind(BaseOperator):
    """Defers, then changes the resume kwargs after defer() has checked them."""

    def execute(self, context: Context) -> None:
        kwargs = {"seen": "at defer"}
        try:
            self.defer(trigger=WaitTrigger(0.0), method_name="resume", kwargs=kwargs)
        except TaskDeferred as deferred:
            deferred.kwargs["seen"] = "after defer"
            raise

    def resume(self, context: Context, event: Any = None, seen: str = "") -> str:
        return seen


def test_defer_encodes_the_resume_kwargs_it_checked() -> None:
    op = _ChangesItsMind(task_id="t")
    with pytest.raises(TaskDeferred) as caught:
        op.defer(trigger=WaitTrigger(0.0), method_name="resume", kwargs={"a": [1, 2]})
    assert caught.value.encoded_kwargs is not None
    assert decode_value(caught.value.encoded_kwargs) == {"a": [1, 2]}


async def test_the_worker_stores_the_kwargs_defer_encoded(store: Store) -> None:
    with DAG(dag_id="mind") as dag:
        _ChangesItsMind(task_id="t")
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["t"]["state"] == "success", tis["t"]["error"]
    assert decode_value(tis["t"]["result"]) == "at defer"
