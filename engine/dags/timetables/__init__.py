"""Schedules: which runs a DAG's schedule asks for, and when.

One module per family, as in Airflow: :mod:`.interval` (data intervals: cron strings and
deltas by default), :mod:`.trigger` (``CronTriggerTimetable``), :mod:`.simple` (no schedule,
``@once``, ``@continuous``), :mod:`.events` (``EventsTimetable``), :mod:`.custom` (a
timetable class of your own), :mod:`.base` (the shared types and time zones). This module
turns a DAG's ``schedule`` into a timetable and back from what the store recorded.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from dateutil.relativedelta import relativedelta

from engine.dags.timetables._cron import PRESETS
from engine.dags.timetables.assets import (
    AssetTriggeredTimetable,
    asset_schedule,
    make_asset_timetable,
)
from engine.dags.timetables.base import (
    UTC,
    DagRunInfo,
    DataInterval,
    ScheduleError,
    TimeRestriction,
    Timetable,
    dag_timezone,
    parse_timezone,
    to_aware,
    tz_from_name,
    tz_name,
)
from engine.dags.timetables.custom import CustomTimetable, is_custom, load_custom
from engine.dags.timetables.events import EventsTimetable
from engine.dags.timetables.interval import (
    CronDataIntervalTimetable,
    CronTimetable,
    DeltaDataIntervalTimetable,
    DeltaTimetable,
    load_delta,
)
from engine.dags.timetables.simple import ContinuousTimetable, NullTimetable, OnceTimetable
from engine.dags.timetables.trigger import CronTriggerTimetable

__all__ = [
    "PRESETS",
    "AssetTriggeredTimetable",
    "ContinuousTimetable",
    "CronDataIntervalTimetable",
    "CronTimetable",
    "CronTriggerTimetable",
    "CustomTimetable",
    "DagRunInfo",
    "DataInterval",
    "DeltaDataIntervalTimetable",
    "DeltaTimetable",
    "EventsTimetable",
    "NullTimetable",
    "OnceTimetable",
    "ScheduleError",
    "TimeRestriction",
    "Timetable",
    "asset_schedule",
    "dag_timezone",
    "dump_with_timezone",
    "load_timetable",
    "make_timetable",
    "manual_run_interval",
    "parse_timezone",
    "stored_timezone",
    "to_aware",
]

_SCHEDULE_HELP = (
    "schedule must be None, a cron expression, a preset (@once, @continuous, @hourly, @daily, "
    "@weekly, @monthly, @quarterly, @yearly), a datetime.timedelta, a "
    "dateutil.relativedelta.relativedelta, a timetable, or assets (a list of Assets, a & b, a | b)"
)


def make_timetable(
    schedule: object, tz: dt.tzinfo = UTC, *, cron_data_intervals: bool = True
) -> Timetable:
    """The timetable of a DAG's ``schedule`` argument; ScheduleError if it cannot be one.

    A cron string makes a data-interval timetable, or with ``cron_data_intervals=False``
    (the setting ``create_cron_data_intervals``) a :class:`CronTriggerTimetable`; either is
    evaluated in ``tz``, the DAG's time zone."""
    if schedule is None:
        return NullTimetable()
    condition = asset_schedule(schedule)
    if condition is not None:
        return make_asset_timetable(condition)
    if isinstance(schedule, dt.timedelta | relativedelta):
        return DeltaDataIntervalTimetable(schedule, tz)
    if isinstance(schedule, str):
        text = schedule.strip()
        if text == "@once":
            return OnceTimetable()
        if text == "@continuous":
            return ContinuousTimetable()
        if cron_data_intervals:
            return CronDataIntervalTimetable(text, tz)
        return CronTriggerTimetable(text, timezone=tz)
    if isinstance(schedule, Timetable) and not is_custom(schedule):
        return schedule
    if is_custom(schedule):
        return CustomTimetable(schedule)
    raise ScheduleError(f"{_SCHEDULE_HELP}, got {schedule!r}")


def stored_timezone(data: dict[str, Any] | None) -> dt.tzinfo:
    """The DAG's time zone as stored next to its timetable (``"timezone"``; UTC if none)."""
    name = (data or {}).get("timezone")
    return UTC if not name else tz_from_name(str(name))


def dump_with_timezone(timetable: Timetable, tz: dt.tzinfo) -> dict[str, Any]:
    """What the store keeps of a DAG's schedule: the timetable and the DAG's time zone."""
    return {**timetable.dump(), "timezone": tz_name(tz)}


def manual_run_interval(
    timetable: Timetable, tz: dt.tzinfo, logical_date: dt.datetime
) -> tuple[dt.datetime, DataInterval]:
    """A manual run's logical date (aware: a naive one is in the DAG's time zone ``tz``) and
    its data interval, inferred from the schedule as Airflow does (a cron schedule: the last
    complete interval before it). The one inference of ``deferral dags trigger`` and
    ``deferral tasks test``."""
    when = to_aware(logical_date, tz)
    return when, timetable.infer_manual_data_interval(when)


def load_timetable(data: dict[str, Any] | None) -> Timetable:
    """Rebuild a timetable from what :meth:`Timetable.dump` stored."""
    kind = (data or {}).get("kind", "none")
    if data is None or kind == "none":
        return NullTimetable()
    if kind == "once":
        return OnceTimetable()
    if kind == "continuous":
        return ContinuousTimetable()
    if kind == "cron":
        # ("zone": the cron's own time zone; rows recorded before it have the DAG's only.)
        zone = tz_from_name(data.get("zone") or data["timezone"])
        return CronDataIntervalTimetable(data["expression"], zone)
    if kind == "cron_trigger":
        return CronTriggerTimetable.load(data)
    if kind == "delta":
        return DeltaDataIntervalTimetable(dt.timedelta(seconds=data["seconds"]))
    if kind == "relativedelta":
        zone = tz_from_name(data.get("zone") or data.get("timezone") or "UTC")
        return DeltaDataIntervalTimetable(load_delta(data["delta"]), zone)
    if kind == "events":
        return EventsTimetable.load(data)
    if kind == "custom":
        return load_custom(data)
    if kind == "assets":
        return AssetTriggeredTimetable.load(data)
    raise ScheduleError(f"unknown stored timetable {data!r}")
