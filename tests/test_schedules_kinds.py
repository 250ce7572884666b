"""The newer schedules on a real store and scheduler: @continuous (a new run as soon as the
last ended, one at a time), CronTriggerTimetable and EventsTimetable runs, a manual run's
interval from a trigger timetable."""

from __future__ import annotations

import datetime as dt
import itertools

import pytest

from engine import DAG
from engine.dags.timetables import CronTriggerTimetable, EventsTimetable
from engine.scheduler.dagrecord import record_dags
from engine.scheduler.dagruns import create_due_runs, manual_data_interval
from engine.store import Store
from engine.store.models import RunRow
from engine.testing.harness import run_engine
from operators.python import PythonOperator
from tests.helpers import wait_until

pytestmark = pytest.mark.anyio

DAY = dt.timedelta(days=1)


def _noop() -> None:
    return None


async def _runs(store: Store, dag_id: str) -> list[RunRow]:
    return sorted(await store.list_runs(dag_id=dag_id), key=lambda r: r.logical_date)


async def test_a_continuous_dag_gets_no_second_run_while_one_is_not_ended(store: Store) -> None:
    now = await store.now()
    with DAG("cont_gate", schedule="@continuous", start_date=now - DAY) as dag:
        PythonOperator(task_id="t", python_callable=_noop)
    await record_dags(store, [dag])
    assert await create_due_runs(store) == 1
    # Its next run is due, but waits for the first to end (no scheduler pass spins on it).
    assert await create_due_runs(store) == 0
    assert await store.next_due_in() is None
    assert len(await _runs(store, "cont_gate")) == 1


async def test_a_continuous_dag_starts_each_run_once_the_last_one_ended(store: Store) -> None:
    now = await store.now()
    with DAG("cont_runs", schedule="@continuous", start_date=now - DAY) as dag:
        PythonOperator(task_id="t", python_callable=_noop)

    async def three_ended() -> bool:
        return sum(r.state == "success" for r in await _runs(store, "cont_runs")) >= 3

    async with run_engine(store, dags=[dag]):
        await wait_until(three_ended, what="three continuous runs")
    runs = await _runs(store, "cont_runs")
    ended = [r for r in runs if r.ended_at is not None]
    for earlier, later in itertools.pairwise(ended):
        assert earlier.ended_at is not None
        assert later.created_at >= earlier.ended_at  # one at a time
        assert later.logical_date > earlier.logical_date
    assert {r.run_type for r in runs} == {"scheduled"}


async def test_a_cron_trigger_dag_runs_at_its_firing_with_that_moment_as_logical_date(
    store: Store,
) -> None:
    now = await store.now()
    hour = now.replace(minute=0, second=0, microsecond=0)
    with DAG(
        "trig_hourly",
        schedule=CronTriggerTimetable("0 * * * *", timezone="UTC"),
        start_date=hour - 3 * dt.timedelta(hours=1),
        catchup=True,
    ) as dag:
        PythonOperator(task_id="t", python_callable=_noop)
    await record_dags(store, [dag])
    assert await create_due_runs(store) == 4
    runs = await _runs(store, "trig_hourly")
    assert [r.logical_date for r in runs] == [
        hour - n * dt.timedelta(hours=1) for n in (3, 2, 1, 0)
    ]
    assert all(r.data_interval_start == r.data_interval_end == r.logical_date for r in runs)
    stored = await store.get_dag("trig_hourly")
    assert stored is not None
    assert stored.next_dagrun_create_after == hour + dt.timedelta(hours=1)


async def test_a_manual_run_of_a_cron_trigger_dag_covers_its_interval_before_it(
    store: Store,
) -> None:
    with DAG(
        "trig_manual",
        schedule=CronTriggerTimetable("0 3 * * *", timezone="UTC", interval=dt.timedelta(hours=6)),
        start_date=dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    ) as dag:
        PythonOperator(task_id="t", python_callable=_noop)
    await record_dags(store, [dag])
    when = dt.datetime(2024, 5, 1, 12, tzinfo=dt.UTC)
    assert await manual_data_interval(store, "trig_manual", when) == (
        when, when - dt.timedelta(hours=6), when
    )  # fmt: skip


async def test_an_events_dag_runs_the_events_that_passed(store: Store) -> None:
    now = await store.now()
    events = [now - 3 * DAY, now - DAY, now + 30 * DAY]
    with DAG("events_dag", schedule=EventsTimetable(events), start_date=now - 10 * DAY,
             catchup=True) as dag:  # fmt: skip
        PythonOperator(task_id="t", python_callable=_noop)
    await record_dags(store, [dag])
    assert await create_due_runs(store) == 2
    runs = await _runs(store, "events_dag")
    assert [r.logical_date for r in runs] == events[:2]
    stored = await store.get_dag("events_dag")
    assert stored is not None
    assert stored.next_dagrun == events[2]
