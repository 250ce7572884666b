"""The outbox (engine/runtime/outbox.py) against the real database: a batch with an item the
database refuses (a CHECK constraint, text it cannot store) is split and the refused item replaced
by a substitute failure; a substitute refused too is given up alone; a query cancelled by the
server (a transient error) is tried again until it goes through; a write that follows the last
closely lingers for more items, and nothing waits for the linger to drain."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import asyncpg
import pytest

from engine import DAG
from engine.runtime.outbox import Outbox
from engine.store import ClaimedTask, Store, TaskInstance, TaskOutcome
from operators.python import PythonOperator
from tests.helpers import wait_until

pytestmark = pytest.mark.anyio

Key = tuple[int, int]


def _noop() -> None:
    return None


class _Claimed(dict[str, ClaimedTask]):
    worker_id = 0


async def _claimed(store: Store, dag_id: str, names: list[str]) -> _Claimed:
    with DAG(dag_id=dag_id) as dag:
        for name in names:
            PythonOperator(task_id=name, python_callable=_noop, retries=3)
    await store.upsert_dag(dag.dag_id, f"{dag.dag_id}.py", dag.serialize_tasks(), None)
    await store.create_dag_run(dag.dag_id, "r1", logical_date=await store.now())
    worker = await store.register_worker("test", 1, len(names))
    claimed = (await store.claim_tasks(worker, len(names))).claimed
    tis = _Claimed({ti.task_id: ti for ti in claimed})
    tis.worker_id = worker
    return tis


def _outcome(tis: _Claimed, name: str, kind: str, error: str | None = None) -> TaskOutcome:
    ti = tis[name]
    return TaskOutcome(
        ti_id=ti.id, worker_id=tis.worker_id, try_number=ti.try_number, kind=kind, error=error
    )


def _substitute(outcome: TaskOutcome, exc: Exception) -> TaskOutcome:
    return TaskOutcome(
        ti_id=outcome.ti_id,
        worker_id=outcome.worker_id,
        try_number=outcome.try_number,
        kind="failed",
        error=f"substituted: {type(exc).__name__}",
        no_retry=True,
    )


class _Recorder:
    """An outbox over ``store.finish_tasks`` that records what it was told."""

    def __init__(self, store: Store, **kwargs: Any) -> None:
        self.written: list[tuple[list[TaskOutcome], dict[Key, str]]] = []
        self.lost: list[tuple[TaskOutcome, Exception]] = []
        self.writes = 0

        async def write(batch: list[TaskOutcome]) -> dict[Key, str]:
            self.writes += 1
            return {(f.id, f.worker_id): f.state for f in await store.finish_tasks(batch)}

        options: dict[str, Any] = {"substitute": _substitute, **kwargs}
        self.outbox: Outbox[TaskOutcome, Key, str] = Outbox(
            "record outcomes",
            write=write,
            on_written=lambda batch, results: self.written.append((batch, results)),
            on_lost=lambda item, exc: self.lost.append((item, exc)),
            **options,
        )

    def states(self) -> dict[int, str]:
        return {key[0]: state for _batch, results in self.written for key, state in results.items()}


async def _rows(store: Store, dag_id: str) -> dict[str, TaskInstance]:
    return {r.task_id: r for r in await store.list_task_instances(dag_id=dag_id)}


async def test_a_refused_item_is_split_out_and_replaced_by_its_substitute(store: Store) -> None:
    """One batch: two good outcomes around one whose kind the CHECK constraint refuses. The
    good ones are written, the bad one becomes a failure without retries, in one on_written
    call for the whole batch."""
    tis = await _claimed(store, "split", ["a", "bad", "c"])
    rec = _Recorder(store)
    batch = [
        _outcome(tis, "a", "success"),
        _outcome(tis, "bad", "no-such"),
        _outcome(tis, "c", "skipped"),
    ]
    async with anyio.create_task_group() as tg:
        tg.start_soon(rec.outbox.run)
        for outcome in batch:
            rec.outbox.put(outcome)
        with anyio.fail_after(30):
            await rec.outbox.drain()
        tg.cancel_scope.cancel()
    assert [b for b, _ in rec.written] == [batch]  # one batch, told once
    assert rec.states() == {tis["a"].id: "success", tis["bad"].id: "failed", tis["c"].id: "skipped"}
    assert rec.writes == 1 + 3 + 1  # the batch, each alone, the substitute
    rows = await _rows(store, "split")
    assert rows["bad"].state == "failed"  # no retry, although retries=3
    assert rows["bad"].error == "substituted: CheckViolationError"
    assert (rows["a"].state, rows["c"].state) == ("success", "skipped")
    assert rec.lost == []


async def test_text_the_database_cannot_store_is_refused_data_not_a_crash(store: Store) -> None:
    """A worker's own outbox: an error text with a NUL character and a lone surrogate is
    stored escaped, next to an outcome whose kind is refused: both tries end, the writer goes
    on."""
    tis = await _claimed(store, "text", ["nul", "odd"])
    rec = _Recorder(store)
    written = await rec.outbox.write_batch(
        [_outcome(tis, "nul", "failed", "a\x00b\udc80c"), _outcome(tis, "odd", "nope")]
    )
    assert written == {
        (tis["nul"].id, tis.worker_id): "up_for_retry",
        (tis["odd"].id, tis.worker_id): "failed",
    }
    rows = await _rows(store, "text")
    assert "\x00" not in rows["nul"].error
    assert rows["odd"].error == "substituted: CheckViolationError"


async def test_a_substitute_refused_too_is_given_up_alone(store: Store) -> None:
    tis = await _claimed(store, "lost", ["ok", "bad"])

    def refused_again(outcome: TaskOutcome, exc: Exception) -> TaskOutcome:
        return TaskOutcome(
            ti_id=outcome.ti_id,
            worker_id=outcome.worker_id,
            try_number=outcome.try_number,
            kind="still-not-a-state",
        )

    rec = _Recorder(store, substitute=refused_again)
    written = await rec.outbox.write_batch(
        [_outcome(tis, "ok", "success"), _outcome(tis, "bad", "x")]
    )
    assert written == {(tis["ok"].id, tis.worker_id): "success"}
    assert [(o.ti_id, type(e)) for o, e in rec.lost] == [
        (tis["bad"].id, asyncpg.CheckViolationError)
    ]
    rows = await _rows(store, "lost")
    assert rows["bad"].state == "running"  # left to the reaper


async def test_a_cancelled_write_is_tried_again_until_it_goes_through(
    store: Store, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A real transient error: the write waits on a row lock held by another session, the
    server cancels it (pg_cancel_backend, QueryCanceledError); the writer backs off and
    writes it again once the lock is gone. Nothing is lost, nothing is written twice."""
    caplog.set_level(logging.WARNING, logger="engine.runtime.retry")
    tis = await _claimed(store, "transient", ["t"])
    ti = tis["t"]
    rec = _Recorder(store)
    locker = await asyncpg.connect(db_url)
    try:
        tx = locker.transaction()
        await tx.start()
        await locker.execute(
            "SELECT 1 FROM deferral_task_instances WHERE id = $1 FOR UPDATE", ti.id
        )

        async def blocked_writes() -> list[int]:
            rows = await locker.fetch(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> "
                "pg_backend_pid() AND datname = current_database()"
            )
            return [r["pid"] for r in rows]

        async def blocked() -> bool:
            return bool(await blocked_writes())

        def retried() -> bool:
            return any("QueryCanceledError" in r.getMessage() for r in caplog.records)

        async def retried_and_blocked() -> bool:
            return retried() and bool(await blocked_writes())

        async with anyio.create_task_group() as tg:
            tg.start_soon(rec.outbox.run)
            rec.outbox.put(_outcome(tis, "t", "success"))
            await wait_until(blocked, what="the write to wait on the row lock")
            (pid,) = await blocked_writes()
            assert await locker.fetchval("SELECT pg_cancel_backend($1)", pid)
            await wait_until(retried_and_blocked, what="the cancelled write to be tried again")
            assert rec.written == []  # nothing was written yet
            await tx.rollback()
            with anyio.fail_after(30):
                await rec.outbox.drain()
            tg.cancel_scope.cancel()
    finally:
        await locker.close()
    assert rec.states() == {ti.id: "success"}
    assert len(rec.written) == 1
    assert (await _rows(store, "transient"))["t"].state == "success"


async def test_flush_writes_in_the_caller_and_keeps_what_an_error_left_first(
    store: Store,
) -> None:
    """An outbox with no writer task (the log sink's): ``flush`` writes what is queued in
    batches in the calling task; an error that is neither transient nor about one item's
    data is raised, and what it left unwritten stays queued ahead of what came after."""
    tis = await _claimed(store, "flush", ["a", "b", "c"])
    # (Twice: the batch, then its first item written alone.)
    failures = [RuntimeError("the write failed"), RuntimeError("the write failed again")]
    written: list[list[int]] = []

    async def write(batch: list[TaskOutcome]) -> dict[Key, str]:
        if failures:
            raise failures.pop()
        written.append([o.ti_id for o in batch])
        return {(f.id, f.worker_id): f.state for f in await store.finish_tasks(batch)}

    outbox: Outbox[TaskOutcome, Key, str] = Outbox(
        "record outcomes",
        write=write,
        substitute=_substitute,
        on_written=lambda batch, results: None,
        max_items=2,
    )
    outbox.put_all([_outcome(tis, "a", "success"), _outcome(tis, "b", "success")])
    with pytest.raises(RuntimeError):
        await outbox.flush()
    assert (len(outbox), outbox.in_flight) == (2, 0)
    outbox.put(_outcome(tis, "c", "skipped"))
    await outbox.flush()
    assert written == [[tis["a"].id, tis["b"].id], [tis["c"].id]]
    assert not outbox.pending()
    rows = await _rows(store, "flush")
    assert {name: rows[name].state for name in "abc"} == {
        "a": "success",
        "b": "success",
        "c": "skipped",
    }


async def test_a_write_that_follows_closely_lingers_for_more_items(store: Store) -> None:
    """An idle outbox writes a lone item at once; the write after it, closely following,
    waits (up to ``linger_s``) until ``linger_items`` are queued and writes them in one
    statement. (Without the linger, b would go alone as soon as it is queued.)"""
    tis = await _claimed(store, "linger", ["a", "b", "c", "d"])
    rec = _Recorder(store, linger_s=600.0, linger_items=3)

    def batches() -> list[list[int]]:
        return [[o.ti_id for o in batch] for batch, _results in rec.written]

    async def written(count: int) -> bool:
        return len(rec.written) == count

    async with anyio.create_task_group() as tg:
        tg.start_soon(rec.outbox.run)
        rec.outbox.put(_outcome(tis, "a", "success"))
        await wait_until(lambda: written(1), what="the lone first item to be written")
        rec.outbox.put(_outcome(tis, "b", "success"))
        await anyio.wait_all_tasks_blocked()
        assert (batches(), len(rec.outbox)) == ([[tis["a"].id]], 1)  # b lingers, queued
        rec.outbox.put_all([_outcome(tis, "c", "success"), _outcome(tis, "d", "skipped")])
        await wait_until(lambda: written(2), what="the three lingering items to be written")
        tg.cancel_scope.cancel()
    assert batches() == [[tis["a"].id], [tis["b"].id, tis["c"].id, tis["d"].id]]
    assert rec.states() == {
        tis["a"].id: "success",
        tis["b"].id: "success",
        tis["c"].id: "success",
        tis["d"].id: "skipped",
    }


async def test_drain_does_not_wait_for_the_linger(store: Store) -> None:
    """A worker stopping drains its outbox: an item lingering for company is written at once
    (the linger here would last ten minutes)."""
    tis = await _claimed(store, "linger_drain", ["a", "b"])
    rec = _Recorder(store, linger_s=600.0, linger_items=100)

    async def written() -> bool:
        return bool(rec.written)

    async with anyio.create_task_group() as tg:
        tg.start_soon(rec.outbox.run)
        rec.outbox.put(_outcome(tis, "a", "success"))
        await wait_until(written, what="the first item to be written")
        rec.outbox.put(_outcome(tis, "b", "success"))
        await anyio.wait_all_tasks_blocked()
        assert len(rec.written) == 1  # b lingers
        with anyio.fail_after(30):
            await rec.outbox.drain()
        tg.cancel_scope.cancel()
    assert rec.states() == {tis["a"].id: "success", tis["b"].id: "success"}
    assert (await _rows(store, "linger_drain"))["b"].state == "success"


def test_a_negative_linger_is_refused() -> None:
    async def write(batch: list[TaskOutcome]) -> dict[Key, str]:
        return {}

    with pytest.raises(ValueError, match="linger_s must be >= 0"):
        Outbox(
            "record outcomes",
            write=write,
            substitute=_substitute,
            on_written=lambda b, r: None,
            linger_s=-1,
        )
