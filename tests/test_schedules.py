"""Runs from schedules on a real store: the scheduler's run creation, admission behind
max_active_runs, pause, manual and backfill runs, ExternalTaskSensor between scheduled DAGs."""

from __future__ import annotations

import datetime as dt
import itertools
import os
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from engine import DAG
from engine.scheduler.backfill import backfill
from engine.scheduler.dagrecord import record_dags
from engine.scheduler.dagruns import create_due_runs
from engine.store import Store
from engine.store.models import RunRow
from engine.testing.harness import run_engine
from operators.base import FailTask
from operators.python import PythonOperator
from operators.sensors import ExternalTaskSensor
from tests.helpers import wait_until
from triggers.base import decode_value

pytestmark = pytest.mark.anyio

DAY = dt.timedelta(days=1)


def _noop() -> None:
    return None


def _midnight(moment: dt.datetime) -> dt.datetime:
    return moment.astimezone(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def daily_dag(dag_id: str, start: dt.datetime, **kwargs: Any) -> DAG:
    with DAG(dag_id, schedule="@daily", start_date=start, **kwargs) as dag:
        PythonOperator(task_id="t", python_callable=_noop)
    return dag


async def runs_of(store: Store, dag_id: str) -> list[RunRow]:
    return sorted(await store.list_runs(dag_id=dag_id), key=lambda r: r.logical_date)


async def test_catchup_creates_every_missed_interval_oldest_first(store: Store) -> None:
    today = _midnight(await store.now())
    dag = daily_dag("catchup_on", today - 3 * DAY, catchup=True)
    await record_dags(store, [dag])
    assert await create_due_runs(store) == 3
    runs = await runs_of(store, dag.dag_id)
    assert [(r.logical_date, r.data_interval_start, r.data_interval_end) for r in runs] == [
        (today - n * DAY, today - n * DAY, today - (n - 1) * DAY) for n in (3, 2, 1)
    ]
    assert {r.run_type for r in runs} == {"scheduled"}
    assert runs[0].run_id == f"scheduled__{(today - 3 * DAY).isoformat()}"
    # Nothing more is due until today's interval ends; the DAG says when that is.
    assert await create_due_runs(store) == 0
    stored = await store.get_dag(dag.dag_id)
    assert stored is not None
    assert (stored.next_dagrun, stored.next_dagrun_create_after) == (today, today + DAY)


async def test_without_catchup_only_the_latest_interval_runs(store: Store) -> None:
    today = _midnight(await store.now())
    dag = daily_dag("catchup_off", today - 10 * DAY)
    await record_dags(store, [dag])
    assert await create_due_runs(store) == 1
    (run,) = await runs_of(store, dag.dag_id)
    assert (run.data_interval_start, run.data_interval_end) == (today - DAY, today)


async def test_no_run_starts_after_the_end_date(store: Store) -> None:
    today = _midnight(await store.now())
    dag = daily_dag("ended", today - 6 * DAY, end_date=today - 4 * DAY, catchup=True)
    await record_dags(store, [dag])
    await create_due_runs(store)
    runs = await runs_of(store, dag.dag_id)
    assert [r.logical_date for r in runs] == [today - 6 * DAY, today - 5 * DAY, today - 4 * DAY]
    stored = await store.get_dag(dag.dag_id)
    assert stored is not None
    assert stored.next_dagrun_create_after is None


async def test_paused_dags_get_no_scheduled_runs_until_unpaused(store: Store) -> None:
    today = _midnight(await store.now())
    dag = daily_dag("paused", today - 2 * DAY, catchup=True, is_paused_upon_creation=True)
    await record_dags(store, [dag])
    assert await create_due_runs(store) == 0
    # A rescan of the file does not unpause it.
    await record_dags(store, [dag])
    assert (await store.get_dag(dag.dag_id)).is_paused  # type: ignore[union-attr]
    assert await store.set_dag_paused(dag.dag_id, False)
    assert await create_due_runs(store) == 2
    assert await store.set_dag_paused(dag.dag_id, True)
    assert not await store.set_dag_paused("no_such_dag", True)


async def test_a_changed_schedule_is_picked_up(store: Store) -> None:
    today = _midnight(await store.now())
    await record_dags(store, [daily_dag("changes", today - 2 * DAY, catchup=True)])
    assert await create_due_runs(store) == 2
    with DAG("changes", schedule="0 12 * * *", start_date=today - 2 * DAY, catchup=True) as dag:
        PythonOperator(task_id="t", python_callable=_noop)
    await record_dags(store, [dag])
    stored = await store.get_dag("changes")
    assert stored is not None
    assert stored.next_dagrun is not None
    assert stored.next_dagrun.hour == 12


async def test_recording_an_unchanged_dag_again_does_not_touch_its_row(
    store: Store, db_url: str
) -> None:
    # The scheduler records every DAG of its folder every dag_rescan_interval_s; an upsert that
    # changed nothing still locked each row (a transaction id and a WAL flush per DAG).
    today = _midnight(await store.now())
    dag = daily_dag("unchanged", today - 2 * DAY)
    await record_dags(store, [dag])
    conn = await asyncpg.connect(db_url)
    try:

        async def row_version() -> tuple[str, str]:
            row = await conn.fetchrow(
                "SELECT xmin::text, xmax::text FROM deferral_dags WHERE dag_id = $1", dag.dag_id
            )
            return row["xmin"], row["xmax"]

        before = await row_version()
        await record_dags(store, [dag])
        assert await row_version() == before
        changed = daily_dag("unchanged", today - 2 * DAY, description="now described")
        await record_dags(store, [changed])
        assert await row_version() != before
    finally:
        await conn.close()
    stored = await store.get_dag(dag.dag_id)
    assert stored is not None
    assert stored.description == "now described"


async def test_every_due_dag_has_its_runs_before_any_run_starts(store: Store) -> None:
    # Starting runs creates their task instances; a batch of due DAGs waiting for the start of
    # the batch before it was most of the scheduling delay of a thousand DAGs.
    today = _midnight(await store.now())
    dags = [daily_dag(f"batched_{i}", today - 3 * DAY, catchup=True, max_active_runs=2)
            for i in range(5)]  # fmt: skip
    await record_dags(store, dags)
    assert await create_due_runs(store, batch=2) == 15
    runs = await store.list_runs()
    assert len(runs) == 15
    started = [r.started_at for r in runs if r.started_at is not None]
    assert len(started) == 10  # two of each DAG's three: max_active_runs holds
    assert {r.state for r in runs if r.started_at is None} == {"queued"}
    assert max(r.created_at for r in runs) <= min(started)


async def test_runs_beyond_max_active_runs_wait_queued_and_never_overlap(store: Store) -> None:
    today = _midnight(await store.now())
    dag = daily_dag("one_at_a_time", today - 4 * DAY, catchup=True, max_active_runs=1)
    await record_dags(store, [dag])
    assert await create_due_runs(store) == 4
    states = [r.state for r in await runs_of(store, dag.dag_id)]
    assert states == ["running", "queued", "queued", "queued"]  # oldest first
    async with run_engine(store, dags=[dag]):

        async def all_done() -> bool:
            return {r.state for r in await runs_of(store, dag.dag_id)} == {"success"}

        await wait_until(all_done, what="the four runs to succeed")
    runs = await runs_of(store, dag.dag_id)
    for earlier, later in itertools.pairwise(runs):
        assert earlier.ended_at is not None
        assert later.started_at is not None
        assert earlier.ended_at <= later.started_at, "two runs overlapped"


async def test_two_schedulers_at_once_create_each_interval_once(store: Store) -> None:
    start = (await store.now()).replace(second=0, microsecond=0) - dt.timedelta(minutes=90)
    dags = []
    for n in range(5):
        with DAG(f"race{n}", schedule="* * * * *", start_date=start, catchup=True) as dag:
            PythonOperator(task_id="t", python_callable=_noop)
        dags.append(dag)
    await record_dags(store, dags)
    created: list[int] = []

    async def scheduler() -> None:
        total = 0
        for _ in range(5):
            total += await create_due_runs(store, batch=2)
        created.append(total)

    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(scheduler)
    runs = await store.list_runs()
    keys = [(r.dag_id, r.logical_date) for r in runs]
    assert len(keys) == len(set(keys)) == sum(created)
    for dag in dags:
        dates = sorted(r.logical_date for r in runs if r.dag_id == dag.dag_id)
        assert dates[0] == start
        assert dates == [start + dt.timedelta(minutes=i) for i in range(len(dates))]
        assert len(dates) >= 90


async def test_the_unique_interval_index_refuses_a_second_scheduled_run(store: Store) -> None:
    from engine.store.models import NewRun

    today = _midnight(await store.now())
    dag = daily_dag("unique", today - DAY)
    await record_dags(store, [dag])
    run = NewRun(dag_id="unique", run_id="a", logical_date=today, data_interval_start=today,
                 data_interval_end=today + DAY, run_type="scheduled")  # fmt: skip
    other = NewRun(dag_id="unique", run_id="b", logical_date=today, data_interval_start=today,
                   data_interval_end=today + DAY, run_type="backfill")  # fmt: skip
    results = await store.insert_runs([run]), await store.insert_runs([other])
    assert [len(r) for r in results] == [1, 0]


def _fails_on_second_day(logical_date: dt.datetime) -> str:
    if logical_date.day == 2:
        raise FailTask("day two is bad")
    return logical_date.isoformat()


def _backfill_dag(dag_id: str) -> DAG:
    # (Paused: no scheduled run; a backfill runs all the same.)
    with DAG(dag_id, schedule="@daily", start_date=dt.datetime(2024, 1, 1),
             is_paused_upon_creation=True) as dag:  # fmt: skip
        PythonOperator(task_id="t", python_callable=_fails_on_second_day)
    return dag


async def test_backfill_covers_both_ends_and_reprocesses_as_told(store: Store) -> None:
    dag = _backfill_dag("filled")
    first, last = dt.datetime(2024, 1, 1), dt.datetime(2024, 1, 3)
    async with run_engine(store, dags=[dag]):
        done = await backfill(store, dag.dag_id, first, last, wait=True)
        assert (done.total, done.created, done.ended, done.failed) == (3, 3, 3, 1)
        runs = await runs_of(store, dag.dag_id)
        assert [(r.logical_date.day, r.run_type, r.state) for r in runs] == [
            (1, "backfill", "success"), (2, "backfill", "failed"), (3, "backfill", "success"),
        ]  # fmt: skip
        assert runs[0].data_interval_end == dt.datetime(2024, 1, 2, tzinfo=dt.UTC)

        again = await backfill(store, dag.dag_id, first, last, wait=True)
        assert (again.created, again.skipped) == (0, 3)
        failed = await backfill(store, dag.dag_id, first, last, reprocess="failed", wait=True)
        assert (failed.created, failed.skipped, failed.failed) == (1, 2, 1)
        every = await backfill(store, dag.dag_id, first, last, reprocess="completed", wait=True)
        assert (every.created, every.failed) == (3, 1)
    assert len(await runs_of(store, dag.dag_id)) == 3
    # Reprocessed runs made new tries, numbered on from the old ones (their logs apart).
    tis = await store.list_task_instances(dag_id=dag.dag_id)
    assert sorted((ti.run_id[-25:-15], ti.try_number) for ti in tis) == [
        ("2024-01-01", 2), ("2024-01-02", 3), ("2024-01-03", 2),
    ]  # fmt: skip


def _always_fails() -> None:
    raise ValueError("never works")


async def test_a_reprocessed_run_s_tries_number_on_and_get_their_retries_again(
    store: Store,
) -> None:
    with DAG("retried", schedule="@daily", start_date=dt.datetime(2024, 1, 1),
             is_paused_upon_creation=True) as dag:  # fmt: skip
        PythonOperator(task_id="t", python_callable=_always_fails, retries=1,
                       retry_delay=dt.timedelta(0))  # fmt: skip
    day = dt.datetime(2024, 1, 1)
    async with run_engine(store, dags=[dag]):
        for passes in (1, 2, 3):
            done = await backfill(store, dag.dag_id, day, day, reprocess="completed", wait=True)
            assert (done.created, done.failed) == (1, 1)
            (ti,) = await store.list_task_instances(dag_id=dag.dag_id)
            # Two tries each time (the retry is not used up by the earlier passes).
            assert (ti.state, ti.try_number) == ("failed", 2 * passes)


async def test_an_interrupted_backfill_resumes_where_it_stopped(store: Store) -> None:
    with DAG("resumed", schedule="@daily", start_date=dt.datetime(2024, 1, 1),
             is_paused_upon_creation=True) as dag:  # fmt: skip
        PythonOperator(task_id="t", python_callable=_noop)
    first, last = dt.datetime(2024, 1, 1), dt.datetime(2024, 1, 5)
    await record_dags(store, [dag])
    # No worker: the first run never ends, so with max_active_runs=1 the backfill waits for
    # it; it is interrupted there.
    with anyio.move_on_after(2):
        await backfill(store, dag.dag_id, first, last, max_active_runs=1, poll_s=0.05)
    assert len(await runs_of(store, dag.dag_id)) == 1
    async with run_engine(store, dags=[dag]):
        done = await backfill(store, dag.dag_id, first, last, max_active_runs=2, wait=True)
    assert (done.created, done.skipped, done.ended, done.failed) == (4, 1, 5, 0)
    runs = await runs_of(store, dag.dag_id)
    assert [r.logical_date.day for r in runs] == [1, 2, 3, 4, 5]
    assert {r.state for r in runs} == {"success"}


def _returns_params(**context: Any) -> dict[str, Any]:
    return {
        "params": context["params"],
        "run_type": context["run_type"],
        "interval": [context["data_interval_start"].isoformat(),
                     context["data_interval_end"].isoformat()],
    }  # fmt: skip


async def test_params_are_overridden_by_conf_and_the_context_has_the_interval(
    store: Store,
) -> None:
    from engine.client.runs import _create
    from engine.store.models import NewRun

    with DAG("params", schedule="@daily", start_date=dt.datetime(2024, 1, 1),
             params={"region": "eu", "limit": 10}) as dag:  # fmt: skip
        PythonOperator(task_id="t", python_callable=_returns_params)
    moment = dt.datetime(2024, 3, 5, 7, tzinfo=dt.UTC)
    async with run_engine(store, dags=[dag]) as engine:
        run = NewRun(
            dag_id="params",
            run_id="m",
            logical_date=moment,
            data_interval_start=moment,
            data_interval_end=moment,
            run_type="manual",
            conf={"limit": 3, "x": 1},  # x is no param: it stays in conf only
        )
        assert await _create(store, run) == ("m", "running")
        out = await engine.finish("params", "m")
    assert decode_value(out["t"]["result"]) == {
        "params": {"region": "eu", "limit": 3},
        "run_type": "manual",
        "interval": ["2024-03-04T00:00:00+00:00", "2024-03-05T00:00:00+00:00"],
    }


def _upstream_result(logical_date: dt.datetime) -> str:
    return logical_date.isoformat()


async def test_external_task_sensor_lines_up_with_the_other_dags_scheduled_runs(
    store: Store,
) -> None:
    today = _midnight(await store.now())
    with DAG("producer", schedule="0 0 * * *", start_date=today - 2 * DAY, catchup=True) as up:
        PythonOperator(task_id="load", python_callable=_upstream_result)
    with DAG("consumer", schedule="0 1 * * *", start_date=today - 2 * DAY, catchup=True) as down:
        ExternalTaskSensor(
            task_id="wait_load",
            external_dag_id="producer",
            external_task_id="load",
            execution_delta=dt.timedelta(hours=1),
            check_existence=True,
            poke_interval=0.1,
            timeout=60,
            mode="reschedule",
        )
    async with run_engine(store, dags=[up, down], poll_interval_s=0.1):

        async def both_done() -> bool:
            runs = await store.list_runs()
            return len(runs) >= 3 and all(r.state == "success" for r in runs)

        await wait_until(both_done, what="the scheduled runs of both DAGs to succeed")
    consumer = await runs_of(store, "consumer")
    producer = {r.logical_date for r in await runs_of(store, "producer")}
    assert consumer
    assert all(r.run_type == "scheduled" for r in consumer)
    assert {r.logical_date - dt.timedelta(hours=1) for r in consumer} <= producer


async def test_the_scheduler_loop_creates_each_run_as_its_interval_ends(store: Store) -> None:
    start = await store.now()
    with DAG("every_second", schedule=dt.timedelta(seconds=1), start_date=start,
             catchup=True) as dag:  # fmt: skip
        PythonOperator(task_id="t", python_callable=_noop)
    async with run_engine(store, dags=[dag], poll_interval_s=5.0):

        async def three_done() -> bool:
            runs = await runs_of(store, dag.dag_id)
            return sum(r.state == "success" for r in runs) >= 3

        await wait_until(three_done, what="three scheduled runs to succeed")
    runs = await runs_of(store, dag.dag_id)
    assert runs[0].logical_date == start
    for run in runs:
        assert run.data_interval_end == run.data_interval_start + dt.timedelta(seconds=1)
        assert run.created_at >= run.data_interval_end  # never before its interval ended


DAG_FILE = """
import datetime as dt
from engine import DAG
from operators.python import PythonOperator

with DAG("{dag_id}", schedule="@daily", start_date=dt.datetime(2026, 1, 1), catchup=True):
    PythonOperator(task_id="t", python_callable=print)
"""


async def test_a_dag_gone_from_the_folder_gets_no_more_scheduled_runs(
    store: Store, tmp_path: Path
) -> None:
    from engine.dags.dagbag import DagBag
    from engine.scheduler.dagsync import sync_dags

    folder = tmp_path / "dags"
    folder.mkdir()
    kept, removed = folder / "kept.py", folder / "removed.py"
    kept.write_text(DAG_FILE.format(dag_id="kept"))
    removed.write_text(DAG_FILE.format(dag_id="removed"))
    bag = DagBag(folder)
    assert await sync_dags(store, bag) == 2

    async def active() -> dict[str, bool]:
        return {d.dag_id: d.is_active for d in await store.list_dags()}

    # A file that fails to import keeps its DAGs as they were (a typo must not stop them).
    kept.write_text("this is not python")
    os.utime(kept, (1, 1))  # a new modification time, however coarse the file system's clock
    await sync_dags(store, bag)
    assert await active() == {"kept": True, "removed": True}
    kept.write_text(DAG_FILE.format(dag_id="kept"))
    removed.unlink()
    await sync_dags(store, bag)
    assert await active() == {"kept": True, "removed": False}
    gone = await store.get_dag("removed")
    assert gone is not None
    assert gone.next_dagrun_create_after is None
    created = await create_due_runs(store)
    assert {r.dag_id for r in await store.list_runs()} == {"kept"}
    assert created > 0
    # Back in the folder: active again, and its missed intervals are scheduled.
    removed.write_text(DAG_FILE.format(dag_id="removed"))
    await sync_dags(store, bag)
    assert await active() == {"kept": True, "removed": True}
    assert await create_due_runs(store) > 0
    assert "removed" in {r.dag_id for r in await store.list_runs()}
