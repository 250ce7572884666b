"""Data intervals of schedules (engine/dags/timetables.py): pure functions of times, no database."""

from __future__ import annotations

import datetime as dt
import itertools
import zoneinfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import DAG
from engine.dags.timetables import (
    DataInterval,
    ScheduleError,
    Timetable,
    load_timetable,
    make_timetable,
    to_aware,
)
from operators.python import PythonOperator

UTC = dt.UTC
AMS = zoneinfo.ZoneInfo("Europe/Amsterdam")


def utc(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def catchup_runs(
    timetable: Timetable,
    start: dt.datetime,
    now: dt.datetime,
    end: dt.datetime | None = None,
    limit: int = 10_000,
) -> list[DataInterval]:
    """Every interval a catchup=True DAG gets by ``now``, oldest first (what the scheduler
    creates, one after the other)."""
    out: list[DataInterval] = []
    last = None
    while True:
        info = timetable.next_dagrun_info(
            last=last, earliest=start, latest=end, catchup=True, now=now
        )
        if info is None or info.run_after > now or len(out) == limit:
            return out
        assert info.logical_date == info.data_interval.start
        out.append(info.data_interval)
        last = info.data_interval


def test_cron_intervals_run_when_they_end_with_the_start_as_logical_date() -> None:
    daily = make_timetable("0 3 * * *")
    runs = catchup_runs(daily, utc(2024, 1, 1), now=utc(2024, 1, 4, 3))
    assert runs == [
        DataInterval(utc(2024, 1, 1, 3), utc(2024, 1, 2, 3)),
        DataInterval(utc(2024, 1, 2, 3), utc(2024, 1, 3, 3)),
        DataInterval(utc(2024, 1, 3, 3), utc(2024, 1, 4, 3)),  # ends exactly now: created
    ]
    # One microsecond earlier the last interval has not ended.
    assert len(catchup_runs(daily, utc(2024, 1, 1), now=utc(2024, 1, 4, 2, 59, 59, 999999))) == 2


def test_timedelta_intervals_count_from_the_start_date() -> None:
    every_90_min = make_timetable(dt.timedelta(minutes=90))
    runs = catchup_runs(every_90_min, utc(2024, 1, 1, 0, 10), now=utc(2024, 1, 1, 4, 40))
    assert runs == [
        DataInterval(utc(2024, 1, 1, 0, 10), utc(2024, 1, 1, 1, 40)),
        DataInterval(utc(2024, 1, 1, 1, 40), utc(2024, 1, 1, 3, 10)),
        DataInterval(utc(2024, 1, 1, 3, 10), utc(2024, 1, 1, 4, 40)),
    ]


@pytest.mark.parametrize(
    ("preset", "first"),
    [
        ("@hourly", DataInterval(utc(2024, 1, 1), utc(2024, 1, 1, 1))),
        ("@daily", DataInterval(utc(2024, 1, 1), utc(2024, 1, 2))),
        ("@weekly", DataInterval(utc(2024, 1, 7), utc(2024, 1, 14))),  # Sundays
        ("@monthly", DataInterval(utc(2024, 1, 1), utc(2024, 2, 1))),
        ("@yearly", DataInterval(utc(2024, 1, 1), utc(2025, 1, 1))),
    ],
)
def test_presets(preset: str, first: DataInterval) -> None:
    runs = catchup_runs(make_timetable(preset), utc(2024, 1, 1), now=utc(2026, 1, 1), limit=2)
    assert runs[0] == first
    assert make_timetable(preset).summary == preset


def test_once_runs_at_the_start_date_and_never_again() -> None:
    once = make_timetable("@once")
    runs = catchup_runs(once, utc(2024, 5, 1, 12), now=utc(2030, 1, 1))
    assert runs == [DataInterval(utc(2024, 5, 1, 12), utc(2024, 5, 1, 12))]


def test_catchup_off_gives_only_the_latest_complete_interval() -> None:
    hourly = make_timetable("@hourly")
    now = utc(2024, 3, 10, 15, 20)
    info = hourly.next_dagrun_info(
        last=None, earliest=utc(2024, 1, 1), latest=None, catchup=False, now=now
    )
    assert info is not None
    assert info.data_interval == DataInterval(utc(2024, 3, 10, 14), utc(2024, 3, 10, 15))
    # After it, the next one is the interval in progress, created when it ends.
    following = hourly.next_dagrun_info(
        last=info.data_interval, earliest=utc(2024, 1, 1), latest=None, catchup=False, now=now
    )
    assert following is not None
    assert following.data_interval.start == utc(2024, 3, 10, 15)
    assert following.run_after == utc(2024, 3, 10, 16)
    # With catchup every hour since January would be created.
    assert len(catchup_runs(hourly, utc(2024, 3, 9), now=now)) == 39


def test_catchup_off_never_starts_before_the_start_date() -> None:
    daily = make_timetable("@daily")
    info = daily.next_dagrun_info(
        last=None, earliest=utc(2024, 3, 10, 12), latest=None, catchup=False,
        now=utc(2024, 3, 10, 15),
    )  # fmt: skip
    assert info is not None
    assert info.data_interval.start == utc(2024, 3, 11)  # the first boundary after it


def test_no_interval_starts_after_the_end_date() -> None:
    daily = make_timetable("@daily")
    runs = catchup_runs(daily, utc(2024, 1, 1), now=utc(2024, 2, 1), end=utc(2024, 1, 3))
    assert [r.start for r in runs] == [utc(2024, 1, 1), utc(2024, 1, 2), utc(2024, 1, 3)]
    runs = catchup_runs(daily, utc(2024, 1, 1), now=utc(2024, 2, 1), end=utc(2024, 1, 2, 23))
    assert [r.start for r in runs] == [utc(2024, 1, 1), utc(2024, 1, 2)]


def test_daily_cron_keeps_its_wall_clock_time_across_spring_forward() -> None:
    # Amsterdam moved from +01:00 to +02:00 at 02:00 on 2025-03-30.
    daily = make_timetable("0 3 * * *", AMS)
    start = to_aware(dt.datetime(2025, 3, 28), AMS)
    runs = catchup_runs(daily, start, now=to_aware(dt.datetime(2025, 4, 1, 12), AMS))
    starts = [r.start.astimezone(AMS) for r in runs]
    assert [(s.day, s.hour) for s in starts] == [(28, 3), (29, 3), (30, 3), (31, 3)]
    lengths = [r.end - r.start for r in runs]
    assert lengths == [dt.timedelta(hours=h) for h in (24, 23, 24, 24)]


def test_hourly_cron_runs_in_the_repeated_hour_of_autumn() -> None:
    # Amsterdam went back from +02:00 to +01:00 at 03:00 on 2025-10-26: 02:30 happened twice.
    half_past = make_timetable("30 * * * *", AMS)
    start = to_aware(dt.datetime(2025, 10, 26, 0, 30), AMS)
    runs = catchup_runs(half_past, start, now=to_aware(dt.datetime(2025, 10, 26, 5), AMS))
    local = [(r.start.astimezone(AMS).hour, r.start.utcoffset()) for r in runs]
    assert [hour for hour, _ in local] == [0, 1, 2, 2, 3]
    assert all(r.end - r.start == dt.timedelta(hours=1) for r in runs)


def test_a_wall_clock_time_that_does_not_exist_moves_forward() -> None:
    # 02:30 did not happen in Amsterdam on 2025-03-30: that day's run is at 03:30 (+02:00).
    daily = make_timetable("30 2 * * *", AMS)
    start = to_aware(dt.datetime(2025, 3, 29), AMS)
    runs = catchup_runs(daily, start, now=to_aware(dt.datetime(2025, 4, 1), AMS))
    assert runs[1].start == utc(2025, 3, 30, 1, 30)


def test_a_manual_run_gets_the_last_complete_interval_before_it() -> None:
    daily = make_timetable("@daily")
    assert daily.infer_manual_data_interval(utc(2024, 1, 25, 1)) == DataInterval(
        utc(2024, 1, 24), utc(2024, 1, 25)
    )
    delta = make_timetable(dt.timedelta(hours=2))
    assert delta.infer_manual_data_interval(utc(2024, 1, 25, 1)) == DataInterval(
        utc(2024, 1, 24, 23), utc(2024, 1, 25, 1)
    )
    assert make_timetable(None).infer_manual_data_interval(utc(2024, 1, 25)) == DataInterval(
        utc(2024, 1, 25), utc(2024, 1, 25)
    )


def test_backfill_range_includes_both_ends() -> None:
    daily = make_timetable("@daily")
    dates = [i.logical_date for i in daily.runs_between(utc(2024, 1, 1), utc(2024, 1, 3))]
    assert dates == [utc(2024, 1, 1), utc(2024, 1, 2), utc(2024, 1, 3)]
    # Ends off the schedule: the logical dates inside.
    dates = [i.logical_date for i in daily.runs_between(utc(2024, 1, 1, 6), utc(2024, 1, 3, 6))]
    assert dates == [utc(2024, 1, 2), utc(2024, 1, 3)]
    assert list(make_timetable(None).runs_between(utc(2024, 1, 1), utc(2024, 2, 1))) == []


@pytest.mark.parametrize(
    ("schedule", "problem"),
    [
        ("0 25 * * *", "bad hour field '25'"),
        ("61 * * * *", "bad minute field '61'"),
        ("0 3 * * mo", "bad day of week field 'mo'"),
        ("0 3 * *", "must have 5 fields"),
        ("@fortnightly", "unknown schedule preset '@fortnightly'"),
    ],
)
def test_a_bad_cron_string_names_the_dag_and_the_field(schedule: str, problem: str) -> None:
    with pytest.raises(ScheduleError) as caught:
        DAG("nightly", schedule=schedule, start_date=utc(2024, 1, 1))
    assert str(caught.value).startswith("DAG nightly: schedule: ")
    assert problem in str(caught.value)


def test_the_dag_zone_is_the_start_dates_and_naive_means_utc() -> None:
    dag = DAG("z", schedule="0 3 * * *", start_date=dt.datetime(2024, 1, 1, tzinfo=AMS))
    assert dag.timezone is AMS
    naive = DAG("n", schedule="0 3 * * *", start_date=dt.datetime(2024, 1, 1))
    assert naive.start_date == utc(2024, 1, 1)
    stored = load_timetable(dag.serialize_schedule()["timetable"])
    assert stored.next_dagrun_info(
        last=None, earliest=dag.start_date, latest=None, catchup=True, now=utc(2024, 1, 3)
    ) == dag.timetable.next_dagrun_info(
        last=None, earliest=dag.start_date, latest=None, catchup=True, now=utc(2024, 1, 3)
    )


def test_default_args_apply_unless_the_task_passes_the_argument() -> None:
    with DAG(
        "defaults",
        default_args={"retries": 3, "retry_delay": dt.timedelta(seconds=7), "pool": "p",
                      "owner": "someone"},
    ):  # fmt: skip
        plain = PythonOperator(task_id="plain", python_callable=print)
        own = PythonOperator(task_id="own", python_callable=print, retries=0, pool="q")
    assert (plain.retries, plain.retry_delay_s, plain.pool) == (3, 7.0, "p")
    assert (own.retries, own.retry_delay_s, own.pool) == (0, 7.0, "q")
    outside = PythonOperator(task_id="outside", python_callable=print)
    assert outside.retries == 0


CRONS = ["*/7 * * * *", "0 3 * * *", "15 */2 * * 1-5", "0 0 1 * *", "30 * * * *", "0 2 * * 0"]
ZONES = [UTC, AMS, zoneinfo.ZoneInfo("America/New_York"), zoneinfo.ZoneInfo("Australia/Sydney")]


@settings(max_examples=40, deadline=None)
@given(
    cron=st.sampled_from(CRONS),
    zone=st.sampled_from(ZONES),
    start=st.datetimes(min_value=dt.datetime(2020, 1, 1), max_value=dt.datetime(2030, 1, 1)),
    span_h=st.integers(min_value=1, max_value=24 * 8),
)
def test_catchup_intervals_are_contiguous_and_catchup_off_gives_the_last_of_them(
    cron: str, zone: dt.tzinfo, start: dt.datetime, span_h: int
) -> None:
    timetable = make_timetable(cron, zone)
    begin = to_aware(start, zone)
    now = begin + dt.timedelta(hours=span_h)
    runs = catchup_runs(timetable, begin, now=now)
    for run in runs:
        assert begin <= run.start < run.end <= now
    for earlier, later in itertools.pairwise(runs):
        assert earlier.end == later.start
    # Without catchup: the last of those, if any ended by now.
    latest = timetable.next_dagrun_info(
        last=None, earliest=begin, latest=None, catchup=False, now=now
    )
    if runs:
        assert latest is not None
        assert latest.data_interval == runs[-1]
