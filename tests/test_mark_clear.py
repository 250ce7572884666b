"""Mark and clear in the store (engine/store/overrides.py), driven by hand as a worker would: a
try told to stop keeps its slot until its worker reports it gone, nothing the old try writes
late changes the task instance, a cleared task is resolved by its trigger rule, and a clear
racing the end of its run is not ended over. (Real worker processes:
tests/test_mark_clear_processes.py; random orders: tests/test_state_machine.py.)"""

from __future__ import annotations

import datetime as dt

import anyio
import asyncpg
import pytest

from engine import DAG
from engine.client.why import explain_task
from engine.store import Deferral, Store, TaskOutcome
from engine.store.downstream import settle
from operators.python import PythonOperator
from tests.helpers import wait_until
from tests.triggers_for_tests import NeverTrigger
from triggers.base import encode_value, validate_trigger

pytestmark = pytest.mark.anyio


def _noop() -> None:
    return None


async def _run(store: Store, *, pool: str = "default_pool") -> dict[str, int]:
    """A run of ``first >> second`` (``second`` in ``pool``); task ids -> task instance ids."""
    with DAG(dag_id="mc") as dag:
        PythonOperator(task_id="first", python_callable=_noop) >> PythonOperator(
            task_id="second", python_callable=_noop, pool=pool
        )
    await store.upsert_dag("mc", "mc.py", dag.serialize_tasks(), None)
    await store.create_dag_run("mc", "r1", logical_date=await store.now())
    return {ti.task_id: ti.id for ti in await store.list_task_instances(dag_id="mc")}


def _deferral(try_number: int) -> Deferral:
    trigger = validate_trigger(NeverTrigger("mc"))
    return Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name="resume",
        method_kwargs=encode_value({}),
        timeout_s=None,
        try_number=try_number,
    )


async def test_a_stopped_try_holds_its_slot_until_reported_gone_and_its_late_writes_do_nothing(
    store: Store,
) -> None:
    await store.set_pool("one", 1)
    ids = await _run(store, pool="one")
    worker = await store.register_worker("w", 1, 4)
    first = TaskOutcome(ti_id=ids["first"], worker_id=worker, try_number=1, kind="success")
    (claimed,) = (await store.claim_tasks(worker, 4)).claimed
    await settle(store, await store.finish_tasks([first]))
    (old,) = (await store.claim_tasks(worker, 4)).claimed
    assert (old.task_id, old.try_number) == ("second", 1)

    marked = await store.mark_task(old.id, "failed", who="me", via="a test")
    assert marked is not None
    assert (marked.was, marked.stopping_worker_id) == ("running", worker)
    cleared = await store.clear_task(old.id, who="me", via="a test")
    assert cleared is not None
    assert (cleared.was, cleared.state, cleared.stopping_worker_id) == ("failed", "scheduled", None)
    # The stopping try holds its pool slot: no try 2, here or elsewhere, until it is gone.
    (pool,) = await store.list_pools("one")
    assert (pool.running, pool.open) == (1, 0)
    other = await store.register_worker("other", 2, 4)
    assert (await store.claim_tasks(other, 4)).claimed == []
    assert (await store.work_left()).runnable == 2  # the stopping try, and the cleared task
    why = await store.why_task("mc", "r1", "second", worker_stale_s=30)
    assert why is not None
    assert why.task is not None
    assert explain_task(why.task, parallelism=0).startswith(
        "stopping: try 1 was told to stop (marked failed by me from a test)"
    )
    beat = await store.heartbeat_worker(worker, [(old.id, 1)])
    assert [(r.ti_id, r.try_number, r.reason) for r in beat.stop] == [
        (old.id, 1, "marked failed by me from a test")
    ]
    assert (await store.claim_tasks(worker, 4)).claimed == []
    # Its worker no longer runs it: the heartbeat says so, the slot frees, try 2 starts.
    beat = await store.heartbeat_worker(worker, [])
    assert (beat.stopped, beat.stop) == (1, [])
    (new,) = (await store.claim_tasks(worker, 4)).claimed
    assert (new.id, new.try_number) == (old.id, 2)
    held = await store.task_try("mc", "r1", "second")
    assert held is not None

    # Every write the old try could still make is refused, by the same worker too.
    late = TaskOutcome(ti_id=old.id, worker_id=worker, try_number=1, kind="failed", error="x")
    assert await store.finish_tasks([late]) == []
    assert not await store.reschedule_task(
        old.id, worker, held.db_now + dt.timedelta(hours=1), try_number=1
    )
    assert not await store.defer_task(old.id, worker, _deferral(1))
    await store.heartbeat_worker(worker, [(old.id, 1)])
    now = await store.task_try("mc", "r1", "second")
    assert now is not None
    assert (now.state, now.try_number, now.worker_id) == ("running", 2, worker)
    assert now.heartbeat_at == held.heartbeat_at  # not kept alive by the old try
    # The new try's own outcome counts.
    done = TaskOutcome(ti_id=old.id, worker_id=worker, try_number=2, kind="success")
    assert [f.state for f in await store.finish_tasks([done])] == ["success"]
    assert claimed.id == ids["first"]


async def test_a_worker_reaped_takes_its_stopping_tries_with_it(store: Store) -> None:
    ids = await _run(store)
    worker = await store.register_worker("w", 1, 4)
    await store.claim_tasks(worker, 4)
    await store.mark_task(ids["first"], "success", who="me")
    assert (await store.list_pools("default_pool"))[0].running == 1
    await store.unregister_worker(worker)
    assert (await store.list_pools("default_pool"))[0].running == 0


async def test_a_cleared_task_is_resolved_by_its_trigger_rule(store: Store) -> None:
    ids = await _run(store)
    worker = await store.register_worker("w", 1, 4)
    (claimed,) = (await store.claim_tasks(worker, 4)).claimed
    failed = TaskOutcome(ti_id=claimed.id, worker_id=worker, try_number=1, kind="failed")
    await settle(store, await store.finish_tasks([failed]))
    states = {ti.task_id: ti.state for ti in await store.list_task_instances(dag_id="mc")}
    assert states == {"first": "failed", "second": "upstream_failed"}
    cleared = await store.clear_task(ids["second"], who="me")
    assert cleared is not None
    # Its upstream still failed: it does not run.
    assert (cleared.was, cleared.state) == ("upstream_failed", "upstream_failed")
    ti = await store.task_try("mc", "r1", "second")
    assert ti is not None
    assert ti.state == "upstream_failed"
    # Once its upstream is cleared and succeeds, it runs.
    await store.clear_task(ids["first"], who="me")
    (again,) = (await store.claim_tasks(worker, 4)).claimed
    ok = TaskOutcome(ti_id=again.id, worker_id=worker, try_number=2, kind="success")
    await settle(store, await store.finish_tasks([ok]))
    ti = await store.task_try("mc", "r1", "second")
    assert ti is not None
    assert ti.state == "upstream_failed"  # (cleared before its upstream: resolved then)
    await store.clear_task(ids["second"], who="me")
    ti = await store.task_try("mc", "r1", "second")
    assert ti is not None
    assert ti.state == "scheduled"


async def test_a_clear_racing_the_end_of_its_run_is_not_ended_over(
    store: Store, db_url: str
) -> None:
    """The scheduler ends a run whose tasks all look finished while a clear of one of them is
    being committed: it waits for the clear and looks again."""
    ids = await _run(store)
    await store.mark_task(ids["first"], "failed", who="me")
    conn = await asyncpg.connect(db_url)
    try:
        tx = conn.transaction()
        await tx.start()
        # The clear, uncommitted (its statement, as Store.clear_tasks runs it).
        await conn.fetch(store._q["clear_tasks"], [ids["first"]], "me", "a test")
        ended: list[object] = []

        async def finish() -> None:
            ended.extend(await store.finish_dag_runs())

        async with anyio.create_task_group() as tg:
            tg.start_soon(finish)

            async def waiting() -> bool:
                return bool(
                    await conn.fetchval(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                ) or bool(ended)

            await wait_until(waiting, what="the scheduler to wait for the clear")
            await tx.commit()
    finally:
        await conn.close()
    assert ended == []
    run = await store.get_dag_run("mc", "r1")
    assert run is not None
    assert run.state == "running"
    ti = await store.task_try("mc", "r1", "first")
    assert ti is not None
    assert ti.state == "scheduled"


async def test_a_mark_names_the_states_it_takes(store: Store) -> None:
    ids = await _run(store)
    with pytest.raises(ValueError, match=r"marked failed, skipped, success, not 'running'"):
        await store.mark_task(ids["first"], "running", who="me")
    assert await store.list_audit() == []
    assert await store.clear_task(10**9, who="me") is None
    assert await store.mark_tasks([], "success", who="me") == []
