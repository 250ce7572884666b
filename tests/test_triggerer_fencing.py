"""Fencing: a triggerer whose lease lapsed and whose triggers were adopted cannot write."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from engine import DAG
from engine.dags.dagbag import DagBag
from engine.store import Store, TriggerOutcome
from engine.worker.worker import Worker
from tests.helpers import fired_summary, wait_until
from tests.triggerer_support import WaitOn
from triggers.base import encode_value

pytestmark = pytest.mark.anyio


async def _one_deferred_task(store: Store, tmp_path: Path) -> int:
    with DAG(dag_id="fence") as dag:
        WaitOn(
            task_id="w",
            trigger="FlagTrigger",
            trigger_kwargs={"flag": str(tmp_path / "never"), "key": "k"},
        )
    dagbag = DagBag(None)
    dagbag.add_dag(dag)
    await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
    worker = Worker(store, dagbag, slots=1, poll_interval_s=0.5)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        await store.create_dag_run(dag.dag_id, "r1", logical_date=await store.now())

        async def deferred() -> bool:
            return [ti.state for ti in await store.list_task_instances()] == ["deferred"]

        await wait_until(deferred)
        worker.stop()
    ti_id: int = (await store.list_task_instances())[0].id
    return ti_id


async def test_a_stale_triggerer_cannot_write_an_event_for_a_trigger_it_lost(
    store: Store, tmp_path: Path
) -> None:
    ti_id = await _one_deferred_task(store, tmp_path)
    stale_owner = await store.register_triggerer("host-a", 1, 10, 60.0)
    [claimed] = (await store.claim_triggers(stale_owner, 10)).claimed

    # Its lease lapses (a stalled loop, a partition): moved into the past on the DB clock.
    assert await store.renew_triggerer_lease(stale_owner, -1.0) == 1
    # No claims on a lapsed lease.
    assert (await store.claim_triggers(stale_owner, 10)).claimed == []
    new_owner = await store.register_triggerer("host-b", 2, 10, 60.0)
    assert await store.reap_triggerers() == 1
    [adopted] = (await store.claim_triggers(new_owner, 10)).claimed
    assert adopted.id == claimed.id
    assert adopted.fence > claimed.fence

    stale = TriggerOutcome(
        trigger_id=claimed.id, fence=claimed.fence, kind="event", payload=encode_value("stale")
    )
    assert fired_summary(await store.fire_triggers(stale_owner, [stale])) == (set(), 0)
    # The old token is refused even under the new owner's id.
    assert fired_summary(await store.fire_triggers(new_owner, [stale])) == (set(), 0)
    [ti] = await store.list_task_instances()
    assert (ti.state, ti.trigger_id) == ("deferred", claimed.id)

    fresh = TriggerOutcome(
        trigger_id=adopted.id, fence=adopted.fence, kind="event", payload=encode_value("fresh")
    )
    assert fired_summary(await store.fire_triggers(new_owner, [fresh])) == ({adopted.id}, 1)
    # A duplicate of the accepted event changes nothing: the task resumes once.
    assert fired_summary(await store.fire_triggers(new_owner, [fresh])) == (set(), 0)
    [ti] = await store.list_task_instances()
    assert (ti.id, ti.state) == (ti_id, "scheduled")
