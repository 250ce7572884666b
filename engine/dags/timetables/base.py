"""What every timetable shares: data intervals, the runs a schedule asks for, time zones.

Pure functions of times (no database, no clock of their own: ``now`` is passed in), so the
scheduler, ``dags trigger`` and ``dags backfill`` all compute the same runs, and tests check
them directly. All times here are aware and in UTC; a DAG's time zone only decides where a
cron expression's wall clock is read and where naive dates are placed.
"""

from __future__ import annotations

import datetime as dt
import zoneinfo
from collections.abc import Iterator
from typing import Any, NamedTuple

import msgspec

__all__ = [
    "UTC",
    "DagRunInfo",
    "DataInterval",
    "ScheduleError",
    "TimeRestriction",
    "Timetable",
    "dag_timezone",
    "localize",
    "parse_timezone",
    "to_aware",
    "tz_from_name",
    "tz_name",
]

UTC = dt.UTC


class ScheduleError(ValueError):
    """A schedule that cannot be used (bad cron expression, bad timedelta, unknown zone)."""


class DataInterval(msgspec.Struct, frozen=True):
    """``[start, end)``, both aware (UTC)."""

    start: dt.datetime
    end: dt.datetime

    @classmethod
    def exact(cls, at: dt.datetime) -> DataInterval:
        """An interval of one moment (``start == end``)."""
        return cls(at, at)


class DagRunInfo(msgspec.Struct, frozen=True):
    """A run a schedule asks for: its interval, and when it may be created. Its logical date
    is the interval's start (for a trigger timetable without ``interval``: the moment it
    fires)."""

    data_interval: DataInterval
    run_after: dt.datetime

    @property
    def logical_date(self) -> dt.datetime:
        return self.data_interval.start

    @classmethod
    def exact(cls, at: dt.datetime) -> DagRunInfo:
        """A run at one moment, created at that moment."""
        return cls(DataInterval(at, at), at)

    @classmethod
    def interval(cls, start: dt.datetime, end: dt.datetime) -> DagRunInfo:
        """A run over ``[start, end)``, created once ``end`` has passed."""
        return cls(DataInterval(start, end), end)


class TimeRestriction(NamedTuple):
    """What a custom timetable is told of the DAG (as Airflow's ``TimeRestriction``): no run
    before ``earliest`` (start_date) nor after ``latest`` (end_date), both included, and
    whether missed runs are caught up."""

    earliest: dt.datetime | None
    latest: dt.datetime | None
    catchup: bool


# -- time zones -----------------------------------------------------------------------------


def dag_timezone(start_date: dt.datetime | None, default: dt.tzinfo = UTC) -> dt.tzinfo:
    """The DAG's time zone: ``start_date``'s, ``default`` (the ``default_timezone`` setting)
    when naive or absent."""
    if start_date is None or start_date.tzinfo is None:
        return default
    return start_date.tzinfo


def to_aware(value: dt.datetime, tz: dt.tzinfo = UTC) -> dt.datetime:
    """``value`` in UTC (a plain ``datetime``, also for a pendulum one); a naive one is read
    in ``tz``."""
    if value.tzinfo is None:
        value = localize(value, tz)
    utc = value.astimezone(UTC)
    if type(utc) is not dt.datetime:  # (pendulum's DateTime, say: stored and compared plain)
        utc = dt.datetime(
            utc.year, utc.month, utc.day, utc.hour, utc.minute, utc.second, utc.microsecond,
            tzinfo=UTC,
        )  # fmt: skip
    return utc


def localize(naive: dt.datetime, tz: dt.tzinfo) -> dt.datetime:
    """A wall clock time in ``tz``: the second of two (autumn), moved forward by the gap when
    it does not exist (spring)."""
    aware = naive.replace(tzinfo=tz, fold=1)
    if aware.astimezone(UTC).astimezone(tz).replace(tzinfo=None) != naive:
        aware = naive.replace(tzinfo=tz, fold=0)  # in a gap: fold=0 reads it forward
    return aware


def tz_name(tz: dt.tzinfo) -> str:
    """How a time zone is stored: its IANA name, ``UTC``, or ``offset:<seconds>``."""
    if isinstance(tz, zoneinfo.ZoneInfo):
        return tz.key
    name = getattr(tz, "name", None)  # (pendulum's zones carry their IANA name)
    if isinstance(name, str) and "/" in name:
        return name
    if tz is UTC or tz.utcoffset(None) == dt.timedelta(0):
        return "UTC"
    offset = tz.utcoffset(None)
    if offset is None:
        raise ScheduleError(f"the time zone {tz!r} has no fixed offset and no name")
    return f"offset:{offset.total_seconds():g}"


def tz_from_name(name: str) -> dt.tzinfo:
    if name == "UTC":
        return UTC
    if name.startswith("offset:"):
        return dt.timezone(dt.timedelta(seconds=float(name.removeprefix("offset:"))))
    return zoneinfo.ZoneInfo(name)


def parse_timezone(value: str | dt.tzinfo) -> dt.tzinfo:
    """A time zone given as an IANA name (``Europe/Amsterdam``) or a ``tzinfo``."""
    if isinstance(value, dt.tzinfo):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ScheduleError(f"a time zone must be an IANA name or a tzinfo, got {value!r}")
    if value.strip().upper() == "UTC":
        return UTC
    try:
        return zoneinfo.ZoneInfo(value.strip())
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(
            f"unknown time zone {value!r} (an IANA name: Europe/Amsterdam)"
        ) from None


# -- the contract --------------------------------------------------------------------------


class Timetable:
    """Where the runs of a schedule fall.

    The engine's own timetables implement :meth:`next_dagrun_info` with the keyword
    arguments below. A timetable of your own (a class in a DAG file, as in Airflow) implements
    ``next_dagrun_info(*, last_automated_data_interval, restriction)`` and
    ``infer_manual_data_interval(*, run_after)`` instead, with ``serialize``/``deserialize``
    for its settings: see :mod:`engine.dags.timetables.custom`."""

    #: What ``dags list`` shows.
    summary: str = "None"
    #: Whether the scheduler creates runs (False: manual runs only).
    periodic: bool = True
    #: The most runs of the DAG that may be active at once (None: the DAG says).
    active_runs_limit: int | None = None

    def next_dagrun_info(
        self,
        *,
        last: DataInterval | None,
        earliest: dt.datetime | None,
        latest: dt.datetime | None,
        catchup: bool,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        """The next run after the one whose interval was ``last`` (None: no run yet), with
        no interval starting before ``earliest`` (start_date) or after ``latest``
        (end_date); None when there is none.

        With ``catchup=False`` and ``last=None`` the answer is the latest run due by
        ``now`` (the scheduler creates it instead of older ones); when none is due yet,
        the first one after ``now``."""
        raise NotImplementedError

    def infer_manual_data_interval(self, run_after: dt.datetime) -> DataInterval:
        return DataInterval(run_after, run_after)

    def runs_between(self, earliest: dt.datetime, latest: dt.datetime) -> Iterator[DagRunInfo]:
        """Every run whose logical date lies in ``[earliest, latest]`` (backfill)."""
        info = self.next_dagrun_info(
            last=None, earliest=earliest, latest=latest, catchup=True, now=earliest
        )
        while info is not None:
            yield info
            info = self.next_dagrun_info(
                last=info.data_interval,
                earliest=earliest,
                latest=latest,
                catchup=True,
                now=earliest,
            )

    def dump(self) -> dict[str, Any]:
        """What the store keeps to rebuild this timetable
        (:func:`engine.dags.timetables.load_timetable`)."""
        raise NotImplementedError
