"""Deferrals written in batches (``defer_tasks``): every deferral of a batch is written as if
alone. Deferrals sharing a dedup key share one trigger row with the earliest deadline, a try
the worker no longer holds changes nothing while the others are written, the triggerers are
told of new triggers and of earlier deadlines, and a deferral the database refuses for good
fails its own try only (the worker's deferrals outbox, engine/worker/recorder.py)."""

from __future__ import annotations

import datetime as dt

import anyio
import asyncpg
import msgspec
import pytest

from engine.runtime import metrics as _metrics
from engine.store import ClaimedTask, Deferral, Store
from engine.worker.outcomes import Deferred
from engine.worker.recorder import Recorder
from engine.worker.trylogs import TryLogs
from tests.helpers import claimed_tasks, never_deferral, wait_until
from triggers.base import encode_value, validate_trigger

pytestmark = pytest.mark.anyio


def _deferral(tag: str, timeout_s: float | None, *, line: str | None = None) -> Deferral:
    d = never_deferral(tag)
    return Deferral(
        classpath=d.classpath,
        kwargs=d.kwargs,
        dedup_key=d.dedup_key,
        method_name="resume",
        method_kwargs=d.method_kwargs,
        timeout_s=timeout_s,
        try_number=1,
        line=line,
    )


def _near(at: dt.datetime | None, expected: dt.datetime, slack_s: float = 30.0) -> bool:
    """``at`` is ``expected`` give or take the time the test took (not a timing assertion:
    deadlines an hour apart are told apart)."""
    return at is not None and abs((at - expected).total_seconds()) < slack_s


async def test_a_batch_shares_one_trigger_per_dedup_key_with_the_earliest_deadline(
    store: Store,
) -> None:
    dag_id, worker, tis = await claimed_tasks(store, 5, "batch_keys")
    by_name = {ti.task_id: ti for ti in tis}
    batch = [
        ("t0", _deferral("shared", 3 * 3600.0)),
        ("t1", _deferral("shared", 3600.0)),  # the earliest of the key
        ("t2", _deferral("shared", None)),
        ("t3", _deferral("other", 2 * 3600.0)),
        ("t4", _deferral("third", None, line="t4 defers")),
    ]
    now = await store.now()
    parked = await store.defer_tasks(worker, [(by_name[n].id, d) for n, d in batch])
    assert parked == {ti.id for ti in tis}

    rows = {ti.task_id: ti for ti in await store.list_task_instances(dag_id=dag_id)}
    assert {r.state for r in rows.values()} == {"deferred"}
    # One trigger row per key: the three deferrals of "shared" wait on one.
    assert rows["t0"].trigger_id == rows["t1"].trigger_id == rows["t2"].trigger_id
    assert len({rows[n].trigger_id for n in ("t0", "t3", "t4")}) == 3
    triggers = {t.id: t for t in await store.list_triggers()}
    shared = triggers[rows["t0"].trigger_id]
    assert shared.waiting == 3
    assert _near(shared.timeout_at, now + dt.timedelta(hours=1))  # the earliest kept
    assert _near(triggers[rows["t3"].trigger_id].timeout_at, now + dt.timedelta(hours=2))
    assert triggers[rows["t4"].trigger_id].timeout_at is None
    # Each task keeps its own deadline.
    assert _near(rows["t0"].trigger_timeout_at, now + dt.timedelta(hours=3))
    assert _near(rows["t1"].trigger_timeout_at, now + dt.timedelta(hours=1))
    assert rows["t2"].trigger_timeout_at is None
    # The line of the deferral that had one is stored with it, and only that one.
    logs = await store.task_logs(dag_id, "r1", "t4", 1)
    assert [line.message for line in logs.lines] == ["t4 defers"]
    assert (await store.task_logs(dag_id, "r1", "t3", 1)).lines == []

    # A second batch joins "shared" (later: kept as it is) and "other" (earlier: taken).
    _, worker2, more = await claimed_tasks(store, 2, "batch_keys_more")
    parked = await store.defer_tasks(
        worker2,
        [(more[0].id, _deferral("shared", 5 * 3600.0)), (more[1].id, _deferral("other", 60.0))],
    )
    assert parked == {more[0].id, more[1].id}
    after = {t.id: t for t in await store.list_triggers()}
    assert after.keys() == triggers.keys()  # joined, no new row
    assert after[shared.id].timeout_at == shared.timeout_at
    assert after[shared.id].waiting == 4
    assert _near(after[rows["t3"].trigger_id].timeout_at, now + dt.timedelta(minutes=1))


async def test_the_triggerers_are_told_of_new_triggers_and_earlier_deadlines(
    store: Store, db_url: str
) -> None:
    """New trigger rows: one notification on deferral_triggers; a joined trigger a triggerer
    runs whose deadline moved earlier: its id on deferral_deadlines."""
    _, worker, (first,) = await claimed_tasks(store, 1, "batch_notify")
    assert await store.defer_task(first.id, worker, _deferral("owned", 3600.0))
    me = await store.register_triggerer("test", 1, 10, 60.0)
    (owned,) = [t for t in (await store.claim_triggers(me, 10)).claimed]

    heard: list[tuple[str, str]] = []
    listen = await asyncpg.connect(db_url)
    try:
        for channel in ("deferral_triggers", "deferral_deadlines"):
            await listen.add_listener(
                channel, lambda _c, _p, ch, payload: heard.append((ch, payload))
            )
        _, worker2, tis = await claimed_tasks(store, 3, "batch_notify_more")
        parked = await store.defer_tasks(
            worker2,
            [
                (tis[0].id, _deferral("owned", 60.0)),  # earlier than the owner's timer
                (tis[1].id, _deferral("fresh-a", None)),
                (tis[2].id, _deferral("fresh-b", None)),
            ],
        )
        assert parked == {ti.id for ti in tis}

        async def both_heard() -> bool:
            return len(heard) >= 2

        await wait_until(both_heard, what="the notifications")
    finally:
        await listen.close()
    assert sorted(heard) == [("deferral_deadlines", str(owned.id)), ("deferral_triggers", "")]


async def test_a_try_no_longer_held_changes_nothing_while_the_rest_of_its_batch_is_written(
    store: Store,
) -> None:
    dag_id, worker, (held, stale, done) = await claimed_tasks(store, 3, "batch_stale")
    assert await store.defer_task(done.id, worker, _deferral("done-first", None))
    # (the worker holds try 1)
    stale_deferral = msgspec.structs.replace(_deferral("stale", 60.0, line="never"), try_number=2)
    parked = await store.defer_tasks(
        worker,
        [
            (stale.id, stale_deferral),
            (held.id, _deferral("held", None, line="held defers")),
            (done.id, _deferral("done-again", None, line="never")),  # not running any more
        ],
    )
    assert parked == {held.id}
    rows = {ti.task_id: ti for ti in await store.list_task_instances(dag_id=dag_id)}
    assert rows[stale.task_id].state == "running"
    assert rows[stale.task_id].trigger_id is None
    assert rows[held.task_id].state == "deferred"
    before = rows[done.task_id].trigger_id
    assert rows[done.task_id].state == "deferred"
    assert before is not None
    # No trigger was made for the deferrals not written, and no line.
    triggers = await store.list_triggers()
    assert {t.id for t in triggers} == {before, rows[held.task_id].trigger_id}
    for ti in (stale, done):
        lines = (await store.task_logs(dag_id, "r1", ti.task_id, 1)).lines
        assert [line.message for line in lines] == []


def _deferred(tag: str, timeout_s: float | None) -> Deferred:
    from tests.triggers_for_tests import NeverTrigger

    return Deferred(
        trigger=validate_trigger(NeverTrigger(tag)),
        method_name="resume",
        method_kwargs=encode_value({}),
        timeout_s=timeout_s,
    )


async def test_a_deferral_the_database_refuses_fails_its_try_alone(store: Store) -> None:
    """Three deferrals queued together, one with a deadline no timestamp can hold (the
    database refuses it for good): the batch is split, the two others are deferred and the
    refused one's try fails without retries, saying why."""
    dag_id, worker, tis = await claimed_tasks(store, 3, "batch_refused")
    abandoned: set[int] = set()
    recorder = Recorder(store, TryLogs(store), _metrics.Metrics(), allow=None, abandoned=abandoned)
    outcomes = {
        tis[0].task_id: _deferred("ok-a", 60.0),
        tis[1].task_id: _deferred("refused", 1e300),
        tis[2].task_id: _deferred("ok-b", None),
    }

    async def record(ti: ClaimedTask) -> None:
        await recorder.record(ti, worker, outcomes[ti.task_id], started=0.0)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tries:
            for ti in tis:
                tries.start_soon(record, ti)

            # (the writer starts once all three are queued: they are one batch)
            async def all_queued() -> bool:
                return len(recorder._deferrals) == 3

            async def all_written() -> bool:
                return not recorder._deferrals.pending()

            await wait_until(all_queued, what="the three deferrals to be queued")
            async with anyio.create_task_group() as writer:
                writer.start_soon(recorder.run)
                await wait_until(all_written, what="the write")
                writer.cancel_scope.cancel()

    rows = {ti.task_id: ti for ti in await store.list_task_instances(dag_id=dag_id)}
    assert rows[tis[0].task_id].state == "deferred"
    assert rows[tis[2].task_id].state == "deferred"
    refused = rows[tis[1].task_id]
    assert refused.state == "failed"  # no retry: the same deferral would be refused again
    assert refused.error is not None
    assert refused.error.startswith("the task's deferral could not be stored: "), refused.error
    assert abandoned == set()
    assert {t.waiting for t in await store.list_triggers()} == {1}
    assert len(await store.list_triggers()) == 2
