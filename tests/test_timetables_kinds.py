"""Schedules beyond the data-interval cron (engine/dags/timetables/): DST gaps with
catchup=False and manual runs, CronTriggerTimetable, @quarterly, @continuous, relativedelta,
EventsTimetable, custom timetables from DAG files, naive dates and ``default_timezone``.
Pure functions of times: no database (the scheduler's run creation is in test_schedules)."""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import sys
import textwrap
import zoneinfo
from collections.abc import Iterator
from pathlib import Path

import pendulum
import pytest
from dateutil.relativedelta import relativedelta
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import DAG
from engine.config import Settings
from engine.dags import defaults
from engine.dags.dagbag import DagBag
from engine.dags.timetables import (
    ContinuousTimetable,
    CronTriggerTimetable,
    DagRunInfo,
    DataInterval,
    EventsTimetable,
    ScheduleError,
    Timetable,
    load_timetable,
    make_timetable,
    to_aware,
)
from engine.dags.timetables.custom import _known, allow_custom_timetables
from engine.scheduler.dagruns import _runs_due
from engine.store.models import DueDag
from operators.python import PythonOperator

UTC = dt.UTC
NY = zoneinfo.ZoneInfo("America/New_York")
ZURICH = zoneinfo.ZoneInfo("Europe/Zurich")
AMS = zoneinfo.ZoneInfo("Europe/Amsterdam")
SYDNEY = zoneinfo.ZoneInfo("Australia/Sydney")


def utc(*args: int) -> dt.datetime:
    return dt.datetime(*args, tzinfo=UTC)  # type: ignore[misc]


@pytest.fixture(autouse=True)
def _fresh_authoring() -> Iterator[None]:
    defaults.configure(Settings())
    yield
    defaults.reset()


def _due(dag: DAG, stored: DagRunInfo, now: dt.datetime) -> DueDag:
    schedule = dag.serialize_schedule()
    return DueDag(
        dag_id=dag.dag_id,
        timetable=schedule["timetable"],
        start_date=dag.start_date,
        end_date=dag.end_date,
        catchup=dag.catchup,
        next_dagrun_data_interval_start=stored.data_interval.start,
        next_dagrun_data_interval_end=stored.data_interval.end,
        next_dagrun_create_after=stored.run_after,
        db_now=now,
    )


# -- bug: catchup=False lost the run before a spring-forward gap ---------------------------


@pytest.mark.parametrize(
    ("zone", "gap_day"),
    [(NY, dt.date(2024, 3, 10)), (ZURICH, dt.date(2023, 3, 26))],
)
def test_catchup_off_creates_the_interval_that_ends_on_a_spring_forward_day(
    zone: zoneinfo.ZoneInfo, gap_day: dt.date
) -> None:
    daily = make_timetable("0 2 * * *", zone)
    # 02:00 does not exist that day: the interval ends at 03:00, the first moment after it.
    end = dt.datetime.combine(gap_day, dt.time(3), tzinfo=zone).astimezone(UTC)
    start = dt.datetime.combine(gap_day - dt.timedelta(days=1), dt.time(2), tzinfo=zone)
    expected = DataInterval(start.astimezone(UTC), end)
    for late in (dt.timedelta(0), dt.timedelta(minutes=1), dt.timedelta(hours=5)):
        info = daily.next_dagrun_info(
            last=None, earliest=utc(2023, 1, 1), latest=None, catchup=False, now=end + late
        )
        assert info is not None
        assert info.data_interval == expected
        assert info.run_after <= end + late
    # The scheduler, holding that interval as the DAG's next run, creates it.
    with DAG(f"gap_{zone.key.replace('/', '_')}", schedule="0 2 * * *",
             start_date=dt.datetime(2023, 1, 1, tzinfo=zone)) as dag:  # fmt: skip
        PythonOperator(task_id="t", python_callable=print)
    stored = DagRunInfo(expected, expected.end)
    now = end + dt.timedelta(seconds=2)
    infos, following = _runs_due(_due(dag, stored, now), dag.timetable)
    assert [i.data_interval for i in infos] == [expected]
    assert following.logical_date == end


CRONS = ["0 2 * * *", "30 2 * * *", "0 1 * * *", "0 3 * * 0", "15 2 1 * *", "0 */3 * * *"]
ZONES = [NY, ZURICH, AMS, SYDNEY, zoneinfo.ZoneInfo("Australia/Lord_Howe")]


@functools.cache
def _transitions(zone: zoneinfo.ZoneInfo, year: int) -> list[dt.datetime]:
    """The moments (UTC) the zone's offset changed in that year."""
    hour = dt.timedelta(hours=1)
    moment, found = utc(year, 1, 1), []
    while moment.year == year:
        if moment.astimezone(zone).utcoffset() != (moment + hour).astimezone(zone).utcoffset():
            found.append(moment + hour)
        moment += hour
    return found


@settings(max_examples=300, deadline=None)
@given(
    cron=st.sampled_from(CRONS),
    zone=st.sampled_from(ZONES),
    year=st.integers(min_value=2021, max_value=2027),
    which=st.integers(min_value=0, max_value=1),
    offset_min=st.integers(min_value=-36 * 60, max_value=36 * 60),
)
def test_catchup_off_never_proposes_an_interval_that_has_not_ended(
    cron: str, zone: zoneinfo.ZoneInfo, year: int, which: int, offset_min: int
) -> None:
    # Around a DST change of that zone and year, where the cron's wall clock time may be
    # skipped or repeated.
    timetable = make_timetable(cron, zone)
    moment = _transitions(zone, year)[which] + dt.timedelta(minutes=offset_min)
    info = timetable.next_dagrun_info(
        last=None, earliest=utc(2020, 1, 1), latest=None, catchup=False, now=moment
    )
    assert info is not None
    assert info.data_interval.start < info.data_interval.end <= moment
    # Every boundary step is strictly monotonic, also across DST changes.
    cron_tt = timetable.cron  # type: ignore[attr-defined]
    assert cron_tt.get_prev(moment) < moment < cron_tt.get_next(moment)


# -- manual runs on DST days (Airflow 3's fixed behaviour) ---------------------------------


def test_a_manual_run_on_a_spring_forward_day_gets_the_whole_day_not_a_zero_length_one() -> None:
    daily = make_timetable("0 2 * * *", NY)
    interval = daily.infer_manual_data_interval(utc(2024, 3, 10, 7, 30))
    assert interval == DataInterval(utc(2024, 3, 9, 7), utc(2024, 3, 10, 7))


def test_a_manual_run_on_a_fall_back_day_never_gets_an_interval_ending_after_it() -> None:
    daily = make_timetable("0 1 * * *", NY)
    run_after = utc(2024, 11, 3, 5, 30)  # 01:30 EDT, before the repeated 01:00 EST
    interval = daily.infer_manual_data_interval(run_after)
    assert interval.end <= run_after
    assert interval == DataInterval(utc(2024, 11, 1, 5), utc(2024, 11, 2, 5))


# -- naive dates: the default_timezone setting, as Airflow reads them ----------------------


def test_a_naive_end_date_is_read_in_the_default_timezone_not_the_start_dates() -> None:
    dag = DAG(
        "naive_end", schedule="@daily",
        start_date=dt.datetime(2024, 1, 1, tzinfo=AMS), end_date=dt.datetime(2024, 6, 30),
    )  # fmt: skip
    assert dag.timezone is AMS
    assert dag.end_date == utc(2024, 6, 30)


def test_default_timezone_places_naive_dates_and_becomes_the_dag_zone() -> None:
    defaults.configure(Settings(default_timezone="Asia/Tokyo"))
    dag = DAG("tokyo", schedule="0 9 * * *", start_date=dt.datetime(2024, 1, 1))
    assert dag.start_date == utc(2023, 12, 31, 15)
    info = dag.timetable.next_dagrun_info(
        last=None, earliest=dag.start_date, latest=None, catchup=True, now=utc(2024, 1, 3)
    )
    assert info is not None
    assert info.logical_date == utc(2024, 1, 1, 0)  # 09:00 in Tokyo


def test_a_bad_default_timezone_is_a_settings_error() -> None:
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="default_timezone: unknown time zone 'Mars/Base'"):
        Settings(default_timezone="Mars/Base")


# -- presets, relativedelta ----------------------------------------------------------------


def test_quarterly_runs_on_the_first_of_every_third_month() -> None:
    quarterly = make_timetable("@quarterly")
    starts = [i.logical_date for i in quarterly.runs_between(utc(2024, 1, 1), utc(2024, 12, 31))]
    assert starts == [utc(2024, 1, 1), utc(2024, 4, 1), utc(2024, 7, 1), utc(2024, 10, 1)]
    assert quarterly.summary == "@quarterly"


def test_a_relativedelta_schedule_keeps_the_wall_clock_of_the_dag_zone() -> None:
    dag = DAG("monthly", schedule=relativedelta(months=1),
              start_date=dt.datetime(2024, 1, 31, 6, tzinfo=AMS), catchup=True)  # fmt: skip
    runs = list(dag.timetable.runs_between(dag.start_date, to_aware(dt.datetime(2024, 5, 1), AMS)))
    local = [i.logical_date.astimezone(AMS) for i in runs]
    assert [(d.month, d.day, d.hour) for d in local] == [(1, 31, 6), (2, 29, 6), (3, 29, 6),
                                                         (4, 29, 6)]  # fmt: skip
    again = load_timetable(dag.serialize_schedule()["timetable"])
    assert list(again.runs_between(runs[0].logical_date, runs[-1].logical_date)) == runs
    with pytest.raises(ScheduleError, match="must be positive"):
        DAG("backwards", schedule=relativedelta(months=-1), start_date=utc(2024, 1, 1))


# -- CronTriggerTimetable ------------------------------------------------------------------


def test_cron_trigger_runs_at_each_firing_with_that_moment_as_logical_date() -> None:
    hourly = CronTriggerTimetable("0 * * * *", timezone="UTC")
    runs = list(hourly.runs_between(utc(2024, 1, 1, 0, 30), utc(2024, 1, 1, 3)))
    assert [(i.logical_date, i.run_after) for i in runs] == [
        (utc(2024, 1, 1, h), utc(2024, 1, 1, h)) for h in (1, 2, 3)
    ]
    assert all(i.data_interval.start == i.data_interval.end for i in runs)


def test_cron_trigger_with_an_interval_covers_the_time_before_it_fires() -> None:
    daily = CronTriggerTimetable("0 3 * * *", timezone=AMS, interval=dt.timedelta(hours=24))
    info = daily.next_dagrun_info(
        last=None, earliest=utc(2024, 1, 1), latest=None, catchup=True, now=utc(2024, 1, 5)
    )
    assert info is not None
    assert info.run_after == utc(2024, 1, 1, 2)  # 03:00 Amsterdam
    assert info.data_interval == DataInterval(utc(2023, 12, 31, 2), utc(2024, 1, 1, 2))
    assert daily.infer_manual_data_interval(utc(2024, 2, 1, 12)) == DataInterval(
        utc(2024, 1, 31, 12), utc(2024, 2, 1, 12)
    )


def test_cron_trigger_without_catchup_runs_the_latest_firing_then_each_one() -> None:
    hourly = CronTriggerTimetable("0 * * * *", timezone="UTC")
    now = utc(2024, 3, 1, 10, 20)
    info = hourly.next_dagrun_info(
        last=None, earliest=utc(2024, 1, 1), latest=None, catchup=False, now=now
    )
    assert info is not None
    assert info.logical_date == utc(2024, 3, 1, 10)
    following = hourly.next_dagrun_info(
        last=info.data_interval, earliest=utc(2024, 1, 1), latest=None, catchup=False, now=now
    )
    assert following is not None
    assert following.run_after == utc(2024, 3, 1, 11)
    # A start date in the future: its first firing.
    future = hourly.next_dagrun_info(
        last=None, earliest=utc(2024, 3, 2, 5, 30), latest=None, catchup=False, now=now
    )
    assert future is not None
    assert future.logical_date == utc(2024, 3, 2, 6)


def test_the_setting_chooses_the_timetable_of_cron_strings_and_the_dag_records_it() -> None:
    data_interval = DAG("di", schedule="@daily", start_date=utc(2024, 1, 1))
    defaults.configure(Settings(create_cron_data_intervals=False))
    trigger = DAG("tr", schedule="@daily", start_date=utc(2024, 1, 1))
    assert not isinstance(data_interval.timetable, CronTriggerTimetable)
    assert isinstance(trigger.timetable, CronTriggerTimetable)
    stored = load_timetable(trigger.serialize_schedule()["timetable"])
    assert isinstance(stored, CronTriggerTimetable)
    info = stored.next_dagrun_info(
        last=None, earliest=trigger.start_date, latest=None, catchup=True, now=utc(2024, 2, 1)
    )
    assert info == DagRunInfo.exact(utc(2024, 1, 1))
    # Passed explicitly, each DAG keeps its own whatever the setting says.
    explicit = DAG("ex", schedule=CronTriggerTimetable("0 5 * * *", timezone="Asia/Tokyo",
                                                       interval=relativedelta(days=1)),
                   start_date=utc(2024, 1, 1))  # fmt: skip
    reloaded = load_timetable(explicit.serialize_schedule()["timetable"])
    assert isinstance(reloaded, CronTriggerTimetable)
    assert reloaded.tz == zoneinfo.ZoneInfo("Asia/Tokyo")
    assert reloaded.interval == relativedelta(days=1)


# -- @continuous ---------------------------------------------------------------------------


def test_continuous_runs_one_at_a_time_and_has_nothing_to_backfill() -> None:
    dag = DAG("forever", schedule="@continuous", start_date=utc(2024, 1, 1), catchup=True)
    assert isinstance(dag.timetable, ContinuousTimetable)
    assert (dag.max_active_runs, dag.catchup) == (1, False)
    with pytest.raises(ValueError, match="at most 1 run"):
        DAG("too_many", schedule="@continuous", start_date=utc(2024, 1, 1), max_active_runs=2)
    now = utc(2024, 5, 1, 12)
    first = dag.timetable.next_dagrun_info(
        last=None, earliest=dag.start_date, latest=None, catchup=False, now=now
    )
    assert first == DagRunInfo.exact(now)
    # After a run, the next is stored just after it (created once the run has ended).
    following = dag.timetable.next_dagrun_info(
        last=first.data_interval, earliest=dag.start_date, latest=None, catchup=False, now=now
    )
    assert following is not None
    assert following.run_after > now
    with pytest.raises(ScheduleError, match="no logical dates to backfill"):
        list(dag.timetable.runs_between(utc(2024, 1, 1), utc(2024, 2, 1)))


# -- EventsTimetable -----------------------------------------------------------------------


EVENTS = [utc(2024, 3, 1, 9), utc(2024, 1, 15, 9), pendulum.datetime(2024, 6, 1, 9, tz="UTC")]


def test_events_run_at_each_listed_moment() -> None:
    events = EventsTimetable(EVENTS)
    assert events.summary == "3 events"
    runs = list(events.runs_between(utc(2024, 1, 1), utc(2024, 12, 31)))
    assert [i.logical_date for i in runs] == [utc(2024, 1, 15, 9), utc(2024, 3, 1, 9),
                                              utc(2024, 6, 1, 9)]  # fmt: skip
    assert all(i.run_after == i.logical_date for i in runs)
    # Without catchup: the latest event that passed, then the next ones as they come.
    latest = events.next_dagrun_info(
        last=None, earliest=utc(2024, 1, 1), latest=None, catchup=False, now=utc(2024, 4, 1)
    )
    assert latest == DagRunInfo.exact(utc(2024, 3, 1, 9))
    assert events.next_dagrun_info(
        last=latest.data_interval, earliest=None, latest=None, catchup=False, now=utc(2024, 4, 1)
    ) == DagRunInfo.exact(utc(2024, 6, 1, 9))
    assert (
        events.next_dagrun_info(
            last=None, earliest=None, latest=utc(2024, 1, 1), catchup=True, now=utc(2024, 4, 1)
        )
        is None
    )


def test_a_manual_run_of_an_events_timetable() -> None:
    assert EventsTimetable(EVENTS).infer_manual_data_interval(utc(2024, 2, 2)) == (
        DataInterval.exact(utc(2024, 2, 2))
    )
    restricted = EventsTimetable(EVENTS, restrict_to_events=True)
    assert restricted.infer_manual_data_interval(utc(2024, 4, 1)) == DataInterval.exact(
        utc(2024, 3, 1, 9)
    )
    assert restricted.infer_manual_data_interval(utc(2023, 1, 1)) == DataInterval.exact(
        utc(2024, 1, 15, 9)
    )
    dag = DAG("events", schedule=restricted, start_date=utc(2024, 1, 1))
    again = load_timetable(dag.serialize_schedule()["timetable"])
    assert isinstance(again, EventsTimetable)
    assert (again.event_dates, again.restrict_to_events) == (restricted.event_dates, True)


# -- custom timetables ---------------------------------------------------------------------

_WORKDAY = '''
import datetime as dt

from pendulum import UTC, Date, DateTime, Time

from engine import DAG
from engine.dags.timetables import DagRunInfo, DataInterval, TimeRestriction, Timetable
from operators.python import PythonOperator


class AfterWorkday(Timetable):
    """Airflow's example: a run per workday, over that day, created the next morning."""

    def __init__(self, hour: int = 0) -> None:
        self.hour = hour

    def serialize(self):
        return {"hour": self.hour}

    @classmethod
    def deserialize(cls, data):
        return cls(data["hour"])

    @property
    def summary(self):
        return f"after workday ({self.hour}h)"

    def infer_manual_data_interval(self, *, run_after: DateTime) -> DataInterval:
        start = DateTime.combine((run_after - dt.timedelta(days=1)).date(), Time.min)
        start = start.replace(tzinfo=UTC)
        return DataInterval(start=start, end=start + dt.timedelta(days=1))

    def next_dagrun_info(self, *, last_automated_data_interval, restriction: TimeRestriction):
        if last_automated_data_interval is not None:
            start = last_automated_data_interval.end
            if start.weekday() in (5, 6):
                start = start + dt.timedelta(days=7 - start.weekday())
        else:
            if restriction.earliest is None:
                return None
            start = restriction.earliest.set(hour=0, minute=0, second=0, microsecond=0)
            while start.weekday() in (5, 6):
                start = start.add(days=1)
        if restriction.latest is not None and start > restriction.latest:
            return None
        end = start.add(days=1)
        return DagRunInfo(run_after=end.add(hours=self.hour),
                          data_interval=DataInterval(start=start, end=end))


with DAG("payroll", schedule=AfterWorkday(hour=6), start_date=DateTime(2024, 3, 1, tzinfo=UTC),
         catchup=True):
    PythonOperator(task_id="pay", python_callable=print)
'''


def _workday_bag(folder: Path) -> DagBag:
    (folder / "workday_dags.py").write_text(textwrap.dedent(_WORKDAY))
    return DagBag(folder)


def test_a_custom_timetable_from_a_dag_file_schedules_with_airflows_interface(
    tmp_path: Path,
) -> None:
    dag = _workday_bag(tmp_path).get_dag("payroll")
    assert dag.timetable.summary == "after workday (6h)"
    runs = list(itertools.islice(dag.timetable.runs_between(utc(2024, 3, 1), utc(2024, 3, 12)), 9))
    assert [i.logical_date.day for i in runs] == [1, 4, 5, 6, 7, 8, 11, 12]
    assert runs[0].run_after == utc(2024, 3, 2, 6)
    assert type(runs[0].logical_date) is dt.datetime  # (stored as plain UTC datetimes)
    assert dag.timetable.infer_manual_data_interval(utc(2024, 3, 5, 12)) == DataInterval(
        utc(2024, 3, 4), utc(2024, 3, 5)
    )


def test_a_stored_custom_timetable_is_imported_only_when_trigger_allow_allows_it(
    tmp_path: Path,
) -> None:
    dag = _workday_bag(tmp_path).get_dag("payroll")
    stored = dag.serialize_schedule()["timetable"]
    assert stored["classpath"] == "workday_dags.AfterWorkday"
    assert stored["data"] == {"hour": 6}
    # A scheduler that never declared the DAG itself imports the class by its path ...
    _known.clear()
    sys.modules.pop("workday_dags", None)
    try:
        allow_custom_timetables(lambda path: path.startswith("workday_dags."))
        rebuilt = load_timetable(stored)
        assert rebuilt.summary == "after workday (6h)"
        # ... and only when its trigger_allow list allows that path.
        _known.clear()
        allow_custom_timetables(lambda path: path.startswith("triggers."))
        with pytest.raises(ScheduleError, match="not allowed by the setting trigger_allow"):
            load_timetable({**stored, "classpath": "os.system"})
        with pytest.raises(ScheduleError, match="not allowed by the setting trigger_allow"):
            load_timetable(stored)
    finally:
        allow_custom_timetables(None)


def test_a_custom_timetable_must_return_aware_times() -> None:
    class Naive(Timetable):
        def infer_manual_data_interval(self, *, run_after: dt.datetime) -> DataInterval:
            return DataInterval(dt.datetime(2024, 1, 1), dt.datetime(2024, 1, 2))

        def next_dagrun_info(self, **_: object) -> None:
            return None

    with pytest.raises(ScheduleError, match="top level of its module"):
        make_timetable(Naive())
    with pytest.raises(ScheduleError, match="schedule must be None, a cron expression"):
        make_timetable(42)
