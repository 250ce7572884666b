"""The fire of a batch of trigger outcomes is one round trip (issue 21): one call of
deferral_fire_triggers, in no transaction of the triggerer's, that locks the triggers and then
fires them in a statement of its own (test_fire_race.py holds what that lock is for), with a
generic plan; and the name of each moved try's log line is computed inline, not by a call of
deferral_ti_name per row."""

from __future__ import annotations

import asyncpg
import pytest

from engine.store import Store, TriggerOutcome
from engine.store.triggers import write_trigger_outcomes
from tests.helpers import claimed_tasks, never_deferral
from triggers.base import encode_value

pytestmark = pytest.mark.anyio


async def test_a_batch_of_outcomes_is_one_statement_outside_any_transaction(
    store: Store, db_url: str
) -> None:
    dag_id, worker, (first, second) = await claimed_tasks(store, 2, "one_trip")
    assert await store.defer_task(first.id, worker, never_deferral(f"{dag_id}-a"))
    assert await store.defer_task(second.id, worker, never_deferral(f"{dag_id}-b"))
    me = await store.register_triggerer("test", 1, 10, 60.0)
    claimed = (await store.claim_triggers(me, 10)).claimed
    assert len(claimed) == 2
    outcomes = [
        TriggerOutcome(trigger_id=t.id, fence=t.fence, kind="event", payload=encode_value(i))
        for i, t in enumerate(claimed)
    ]
    conn = await asyncpg.connect(db_url)
    sent: list[str] = []
    conn.add_query_logger(lambda record: sent.append(record.query))
    try:
        # (A first batch of none, as the triggerer primes its connections.)
        await write_trigger_outcomes(conn, store._q, store.keyring, me, [])
        fired = await write_trigger_outcomes(conn, store._q, store.keyring, me, outcomes)
        assert not conn.is_in_transaction()
    finally:
        await conn.close()
    # (Not the fire's: asyncpg's introspection of the types, once per connection, and the jit
    # setting it turns off around that.)
    statements = [q for q in sent if "typeinfo_tree" not in q and "jit" not in q]
    assert statements == [store._q["fire_triggers"]] * 2, sent
    assert fired.accepted == {t.id for t in claimed}
    assert sorted(m.id for m in fired.moved) == [first.id, second.id]
    assert fired.woke
    # Each moved try got its line, under its name.
    for ti in (first, second):
        page = await store.task_logs(dag_id, "r1", ti.task_id, ti.try_number)
        assert any("fired with event" in line.message for line in page.lines), page.lines
    # Fenced as before: the same outcomes again change nothing.
    again = await store.fire_triggers(me, outcomes)
    assert (again.accepted, again.moved) == (frozenset(), [])


async def test_the_fire_runs_with_a_generic_plan_of_hash_joins(store: Store, db_url: str) -> None:
    # (enable_nestloop off: migration 0031; test_query_plans.py pins the plan it makes)
    conn = await asyncpg.connect(db_url)
    try:
        config = await conn.fetchval(
            "SELECT proconfig FROM pg_proc WHERE proname = 'deferral_fire_triggers'"
        )
    finally:
        await conn.close()
    assert config == ["plan_cache_mode=force_generic_plan", "enable_nestloop=off"]


async def test_the_name_of_a_task_instance_is_inlined_and_unchanged(
    store: Store, db_url: str
) -> None:
    conn = await asyncpg.connect(db_url)
    try:
        plan = await conn.fetchval(
            "EXPLAIN (VERBOSE, FORMAT JSON) SELECT deferral_ti_name(task_id, map_index) "
            "FROM deferral_task_instances"
        )
        names = await conn.fetch(
            "SELECT deferral_ti_name(t, i) AS name FROM (VALUES ('a', -1), ('b', 0), "
            "('c', 12)) AS v(t, i) ORDER BY t"
        )
    finally:
        await conn.close()
    assert "deferral_ti_name" not in plan
    assert "CASE WHEN" in plan
    assert [r["name"] for r in names] == ["a", "b[0]", "c[12]"]
