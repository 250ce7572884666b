"""A triggerer reaped while its claim is in flight: what the claim took is freed, not lost.

The claim reads its triggerer's row FOR KEY SHARE, so the reaper's DELETE waits for the
claim to commit, and the release that follows (a statement of its own) sees what it took.
"""

from __future__ import annotations

import anyio
import asyncpg
import pytest

from engine.store import Store
from engine.store.queries import load_queries
from tests.helpers import claimed_tasks, never_deferral, wait_until, waiting_on_locks

pytestmark = pytest.mark.anyio


async def _deferred_tasks(store: Store, n: int) -> None:
    dag_id, worker, claimed = await claimed_tasks(store, n, "reap_race")
    for i, ti in enumerate(claimed):
        assert await store.defer_task(ti.id, worker, never_deferral(f"{dag_id}-{i}"))


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
                lambda: waiting_on_locks(watch), what="the reaper to wait for the claim"
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
    assert (await store.claim_triggers(victim, 10)).claimed == []


async def test_the_scheduler_backstop_frees_triggers_of_a_triggerer_row_that_is_gone(
    store: Store,
) -> None:
    await _deferred_tasks(store, 2)
    gone = await store.register_triggerer("test", 1, 10, 60.0)
    assert len((await store.claim_triggers(gone, 10)).claimed) == 2
    async with store._pool.acquire() as conn:  # a reaper that died between its statements
        await conn.execute("DELETE FROM deferral_triggerers WHERE id = $1", gone)
    assert await store.release_ownerless_triggers() == 2
    assert [t.triggerer_id for t in await store.list_triggers()] == [None, None]
    assert await store.release_ownerless_triggers() == 0
