"""A triggerer reaped while its claim is in flight: what the claim took is freed, not lost.

The claim reads its triggerer's row FOR KEY SHARE, so the reaper's DELETE waits for the
claim to commit, and the release that follows (a statement of its own) sees what it took.
"""

from __future__ import annotations

import itertools

import anyio
import asyncpg
import pytest

from engine import DAG
from engine.store import Deferral, Store
from engine.store.queries import load_queries
from operators.python import PythonOperator
from tests.helpers import wait_until
from tests.triggers_for_tests import NeverTrigger
from triggers.base import encode_value, validate_trigger

pytestmark = pytest.mark.anyio

_numbers = itertools.count()


def _noop() -> None:
    return None


async def _deferred_tasks(store: Store, n: int) -> None:
    dag_id = f"reap_race_{next(_numbers)}"
    with DAG(dag_id=dag_id) as dag:
        for i in range(n):
            PythonOperator(task_id=f"t{i}", python_callable=_noop)
    await store.upsert_dag(dag_id, f"{dag_id}.py", dag.serialize_tasks(), None)
    await store.create_dag_run(dag_id, "r1", logical_date=await store.now())
    worker = await store.register_worker("test", 1, n)
    claimed, _ = await store.claim_tasks(worker, n)
    for i, ti in enumerate(claimed):
        trigger = validate_trigger(NeverTrigger(f"{dag_id}-{i}"))
        deferral = Deferral(
            classpath=trigger.classpath,
            kwargs=trigger.kwargs,
            dedup_key=trigger.dedup_key,
            method_name="resume",
            method_kwargs=encode_value({}),
            timeout_s=None,
        )
        assert await store.defer_task(ti.id, worker, deferral)


async def _waiting_on_a_lock(watch: asyncpg.Connection) -> bool:
    waiting = await watch.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'"
    )
    return bool(waiting)


async def test_a_claim_in_flight_when_its_triggerer_is_reaped_leaves_no_trigger_ownerless(
    store: Store, db_url: str
) -> None:
    await _deferred_tasks(store, 3)
    victim = await store.register_triggerer("test", 1, 10, 60.0)
    claim = await asyncpg.connect(db_url)
    watch = await asyncpg.connect(db_url)
    reaped: list[int] = []
    try:
        tx = claim.transaction()
        await tx.start()
        took = await claim.fetch(load_queries()["claim_triggers"], victim, 10)
        assert len(took) == 3
        # The victim is declared dead while its claim has not committed yet.
        await watch.execute(
            "UPDATE deferral_triggerers SET lease_expires_at = now() - interval '1 second' "
            "WHERE id = $1",
            victim,
        )

        async def reap() -> None:
            reaped.append(await store.reap_triggerers())

        async with anyio.create_task_group() as tg:
            tg.start_soon(reap)
            await wait_until(
                lambda: _waiting_on_a_lock(watch), what="the reaper to wait for the claim"
            )
            await tx.commit()
    finally:
        await claim.close()
        await watch.close()

    assert reaped == [3]
    triggers = await store.list_triggers()
    assert len(triggers) == 3
    assert [t.triggerer_id for t in triggers] == [None, None, None]
    # A claim by the reaped triggerer now takes nothing.
    assert await store.claim_triggers(victim, 10) == []


async def test_the_scheduler_backstop_frees_triggers_of_a_triggerer_row_that_is_gone(
    store: Store,
) -> None:
    await _deferred_tasks(store, 2)
    gone = await store.register_triggerer("test", 1, 10, 60.0)
    assert len(await store.claim_triggers(gone, 10)) == 2
    async with store._pool.acquire() as conn:  # a reaper that died between its statements
        await conn.execute("DELETE FROM deferral_triggerers WHERE id = $1", gone)
    assert await store.release_ownerless_triggers() == 2
    assert [t.triggerer_id for t in await store.list_triggers()] == [None, None]
    assert await store.release_ownerless_triggers() == 0
