"""DateTimeSensor waits by the database clock (the claim time a worker read from the database),
not by the worker host's clock: a host clock that is off neither ends the wait early nor holds
it past its target."""

from __future__ import annotations

import datetime as dt

import pytest

from operators.base import Context
from operators.sensors import DateTimeSensor, SensorTimeout, TimeDeltaSensor

HOUR = dt.timedelta(hours=1)


def _context(db_now: dt.datetime) -> Context:
    return Context(
        dag_id="clock", run_id="r", task_id="s", try_number=1, claimed_at=db_now,
        first_try_at=db_now, logical_date=db_now,
    )  # fmt: skip


def _sensor(target: dt.datetime) -> DateTimeSensor:
    return DateTimeSensor(
        task_id="s", target_time=target, mode="poke", deferrable=False,
        poke_interval=0.01, timeout=0.05,
    )  # fmt: skip


def test_a_target_the_database_clock_passed_is_met_though_the_host_clock_is_behind() -> None:
    host_now = dt.datetime.now(dt.UTC)
    sensor = _sensor(host_now + HOUR / 2)
    assert sensor.execute(_context(db_now=host_now + HOUR)) is None


def test_a_target_the_database_clock_has_not_reached_is_not_met_though_the_host_passed_it() -> None:
    host_now = dt.datetime.now(dt.UTC)
    sensor = _sensor(host_now - HOUR / 2)
    with pytest.raises(SensorTimeout):
        sensor.execute(_context(db_now=host_now - HOUR))


def test_a_time_delta_sensor_waits_by_the_database_clock_too() -> None:
    host_now = dt.datetime.now(dt.UTC)
    sensor = TimeDeltaSensor(
        task_id="d", delta=HOUR / 2, mode="poke", deferrable=False, poke_interval=0.01,
        timeout=0.05,
    )  # fmt: skip
    context = _context(db_now=host_now)
    context["logical_date"] = host_now - HOUR
    # The database says: half an hour past the target.
    context["claimed_at"] = context["first_try_at"] = host_now
    assert sensor.execute(context) is None
    # The database says: half an hour before the target.
    context["claimed_at"] = context["first_try_at"] = host_now - HOUR
    with pytest.raises(SensorTimeout):
        sensor.execute(context)
