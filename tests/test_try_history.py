"""Each try of a task instance is kept once the next one starts (a retry, a clear) or its task
instance goes (a backfill reprocessing its run), with the times of its spans: what the status
page's try selector and Gantt view show (engine/store/browse.py, migration 0016)."""

from __future__ import annotations

import datetime as dt

import pytest

from engine import DAG
from engine.store import Deferral, Store, TaskOutcome, TriggerOutcome
from engine.store.models import TryRecord
from engine.web.views.tries import latest_tries, spans
from operators.python import PythonOperator
from tests.triggers_for_tests import NeverTrigger
from triggers.base import encode_value, validate_trigger

pytestmark = pytest.mark.anyio

DAY = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _noop() -> None:
    pass


async def _dag(store: Store) -> None:
    with DAG(dag_id="tries") as dag:
        PythonOperator(task_id="a", python_callable=_noop, retries=2, retry_delay=dt.timedelta(0))
    await store.upsert_dag("tries", "tries.py", dag.serialize_tasks(), None)


def _deferral() -> Deferral:
    trigger = validate_trigger(NeverTrigger("tries"))
    return Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name="resume",
        method_kwargs=encode_value({}),
        timeout_s=None,
    )


async def _claim(store: Store, worker: int) -> int:
    (ti,) = (await store.claim_tasks(worker, 10)).claimed
    return ti.try_number


async def _finish(store: Store, ti_id: int, worker: int, try_number: int, kind: str) -> None:
    error = f"boom {try_number}" if kind == "failed" else None
    outcome = TaskOutcome(
        ti_id=ti_id, worker_id=worker, try_number=try_number, kind=kind, error=error
    )
    assert await store.finish_tasks([outcome])


async def _tries(store: Store) -> list[TryRecord]:
    return latest_tries(await store.task_tries("tries", "r1", "a"))


async def test_a_retried_try_is_kept_with_its_error_times_and_rendered_fields(
    store: Store,
) -> None:
    await _dag(store)
    await store.create_dag_run("tries", "r1", logical_date=DAY)
    worker = await store.register_worker("h", 1, 4)
    assert await _claim(store, worker) == 1
    (ti,) = await store.list_task_instances(dag_id="tries", run_id="r1")
    await store.set_rendered_fields(ti.id, worker, 1, {"cmd": "echo one"})
    await _finish(store, ti.id, worker, 1, "failed")
    # Until the next try starts, try 1 is the task instance's own row.
    (only,) = await _tries(store)
    assert (only.try_number, only.state, only.current) == (1, "up_for_retry", True)

    assert await _claim(store, worker) == 2
    await store.set_rendered_fields(ti.id, worker, 2, {"cmd": "echo two"})
    await _finish(store, ti.id, worker, 2, "success")
    first, second = await _tries(store)
    assert (first.try_number, first.state, first.current) == (1, "up_for_retry", False)
    assert first.error == "boom 1"
    assert first.rendered_fields == {"cmd": "echo one"}
    assert first.queued_at is not None
    assert first.started_at is not None
    assert first.ended_at is not None
    assert first.started_at <= first.ended_at
    assert [s.kind for s in spans(first)] == ["queued", "running"]
    assert (second.try_number, second.state, second.current) == (2, "success", True)
    assert second.rendered_fields == {"cmd": "echo two"}
    assert second.error is None
    assert second.started_at is not None
    assert first.ended_at <= second.started_at


async def test_a_deferred_try_records_when_it_deferred_fired_and_resumed(store: Store) -> None:
    await _dag(store)
    await store.create_dag_run("tries", "r1", logical_date=DAY)
    worker = await store.register_worker("h", 1, 4)
    await _claim(store, worker)
    (ti,) = await store.list_task_instances(dag_id="tries", run_id="r1")
    assert await store.defer_task(ti.id, worker, _deferral())
    (waiting,) = await _tries(store)
    assert waiting.deferred_at is not None
    assert waiting.fired_at is None
    assert [s.kind for s in spans(waiting)] == ["queued", "running", "deferred"]
    assert spans(waiting)[-1].open  # still deferred: it ends now

    triggerer = await store.register_triggerer("t", 2, 10, 60.0)
    (trigger,) = (await store.claim_triggers(triggerer, 10)).claimed
    event = TriggerOutcome(trigger_id=trigger.id, fence=trigger.fence, kind="event")
    await store.fire_triggers(triggerer, [event])
    (fired,) = await _tries(store)
    assert [s.kind for s in spans(fired)] == ["queued", "running", "deferred", "queued"]

    assert await _claim(store, worker) == 1  # a resume continues the try
    await _finish(store, ti.id, worker, 1, "success")
    (done,) = await _tries(store)
    assert done.fired_at is not None
    assert done.deferred_at is not None
    assert done.resumed_at is not None
    assert done.fired_at <= done.resumed_at
    kinds = [s.kind for s in spans(done)]
    assert kinds == ["queued", "running", "deferred", "queued", "running"]
    assert not any(s.open for s in spans(done))


async def test_a_cleared_try_is_kept_as_it_stood_and_not_overwritten_by_a_second_clear(
    store: Store,
) -> None:
    await _dag(store)
    await store.create_dag_run("tries", "r1", logical_date=DAY)
    worker = await store.register_worker("h", 1, 4)
    await _claim(store, worker)
    (ti,) = await store.list_task_instances(dag_id="tries", run_id="r1")
    await _finish(store, ti.id, worker, 1, "success")
    assert await store.clear_task(ti.id, who="t")
    assert await store.clear_task(ti.id, who="t")  # again, before any new try
    (kept,) = await _tries(store)
    assert (kept.try_number, kept.state, kept.current) == (1, "success", False)
    assert kept.ended_at is not None

    assert await _claim(store, worker) == 2
    first, second = await _tries(store)
    assert (first.state, first.current) == ("success", False)  # the claim's copy was not kept
    assert (second.try_number, second.state, second.current) == (2, "running", True)


async def test_a_reprocessed_run_keeps_the_tries_of_its_old_task_instances(store: Store) -> None:
    await _dag(store)
    run_pk = await store.create_dag_run("tries", "r1", logical_date=DAY)
    worker = await store.register_worker("h", 1, 4)
    await _claim(store, worker)
    (ti,) = await store.list_task_instances(dag_id="tries", run_id="r1")
    await _finish(store, ti.id, worker, 1, "failed")
    await _claim(store, worker)
    await _finish(store, ti.id, worker, 2, "success")
    await store.finish_dag_runs([run_pk])
    assert await store.reset_dag_runs([run_pk]) == [run_pk]
    await store.start_queued_runs(["tries"])
    assert await _claim(store, worker) == 3  # numbered on from the old task instance's
    tries = await _tries(store)
    assert [(t.try_number, t.state, t.current) for t in tries] == [
        (1, "up_for_retry", False),
        (2, "success", False),
        (3, "running", True),
    ]
