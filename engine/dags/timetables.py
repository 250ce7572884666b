"""Schedules as data intervals: which runs a DAG's schedule asks for, and when.

Pure functions of times (no database, no clock of their own: ``now`` is passed in), so the
scheduler, ``dags trigger`` and ``dags backfill`` all compute the same intervals, and tests
check them directly.

The semantics are Airflow 2's for cron and timedelta schedules:

* a run covers the data interval ``[start, end)``; its ``logical_date`` is ``start`` and it
  is created once ``end`` has passed (``run_after``);
* a cron expression is evaluated in the DAG's time zone (``start_date``'s; naive means UTC).
  A cron that fires at least once an hour steps by elapsed time across a DST change (so
  ``30 * * * *`` also runs in the repeated hour of autumn); any other cron keeps its wall
  clock time (``0 3 * * *`` stays at 03:00, its interval lasting 23 or 25 hours). A wall
  clock time that does not exist (spring forward) moves forward by the gap; one that exists
  twice (autumn) is the second one;
* ``catchup=False`` creates only the latest complete interval; ``catchup=True`` every one
  since ``start_date``, oldest first; no run's interval starts after ``end_date``;
* a manual run at time ``t`` gets the last complete interval before ``t`` (cron), or
  ``[t - delta, t)`` (timedelta), or ``[t, t]`` (no schedule, ``@once``).
"""

from __future__ import annotations

import datetime as dt
import functools
import zoneinfo
from collections.abc import Iterator
from typing import Any

import msgspec
from croniter import CroniterBadCronError, CroniterBadDateError, CroniterError, croniter

__all__ = [
    "PRESETS",
    "CronTimetable",
    "DagRunInfo",
    "DataInterval",
    "DeltaTimetable",
    "NullTimetable",
    "OnceTimetable",
    "ScheduleError",
    "Timetable",
    "dag_timezone",
    "dump_with_timezone",
    "load_timetable",
    "make_timetable",
    "manual_run_interval",
    "stored_timezone",
    "to_aware",
]

UTC = dt.UTC

#: The presets a schedule may name, and the cron expression each stands for.
PRESETS: dict[str, str] = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
}
_CRON_FIELDS = ("minute", "hour", "day of month", "month", "day of week")


class ScheduleError(ValueError):
    """A schedule that cannot be used (bad cron expression, bad timedelta, unknown zone)."""


class DataInterval(msgspec.Struct, frozen=True):
    """``[start, end)``, both aware (UTC)."""

    start: dt.datetime
    end: dt.datetime


class DagRunInfo(msgspec.Struct, frozen=True):
    """A run a schedule asks for: its interval, and when it may be created."""

    data_interval: DataInterval
    run_after: dt.datetime

    @property
    def logical_date(self) -> dt.datetime:
        return self.data_interval.start


def dag_timezone(start_date: dt.datetime | None) -> zoneinfo.ZoneInfo | dt.tzinfo:
    """The DAG's time zone: ``start_date``'s, UTC when naive or absent."""
    if start_date is None or start_date.tzinfo is None:
        return UTC
    return start_date.tzinfo


def to_aware(value: dt.datetime, tz: dt.tzinfo = UTC) -> dt.datetime:
    """``value`` in UTC; a naive one is read in ``tz``."""
    if value.tzinfo is None:
        value = _localize(value, tz)
    return value.astimezone(UTC)


def _localize(naive: dt.datetime, tz: dt.tzinfo) -> dt.datetime:
    """A wall clock time in ``tz``: the second of two (autumn), moved forward by the gap when
    it does not exist (spring)."""
    aware = naive.replace(tzinfo=tz, fold=1)
    if aware.astimezone(UTC).astimezone(tz).replace(tzinfo=None) != naive:
        aware = naive.replace(tzinfo=tz, fold=0)  # in a gap: fold=0 reads it forward
    return aware


def _tz_name(tz: dt.tzinfo) -> str:
    if isinstance(tz, zoneinfo.ZoneInfo):
        return tz.key
    if tz is UTC or tz.utcoffset(None) == dt.timedelta(0):
        return "UTC"
    offset = tz.utcoffset(None)
    if offset is None:
        raise ScheduleError(f"start_date's time zone {tz!r} has no fixed offset and no name")
    return f"offset:{offset.total_seconds():g}"


def _tz_from_name(name: str) -> dt.tzinfo:
    if name == "UTC":
        return UTC
    if name.startswith("offset:"):
        return dt.timezone(dt.timedelta(seconds=float(name.removeprefix("offset:"))))
    return zoneinfo.ZoneInfo(name)


class Timetable:
    """Where the runs of a schedule fall. Subclasses: no schedule, ``@once``, cron,
    timedelta."""

    #: What ``dags list`` shows.
    summary: str = "None"
    #: Whether the scheduler creates runs (False: manual runs only).
    periodic: bool = True

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
        (end_date); None when there is none."""
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
        """What the store keeps to rebuild this timetable (:func:`load_timetable`)."""
        raise NotImplementedError


class NullTimetable(Timetable):
    """``schedule=None``: manual runs only."""

    summary = "None"
    periodic = False

    def next_dagrun_info(self, **_: Any) -> DagRunInfo | None:
        return None

    def runs_between(self, earliest: dt.datetime, latest: dt.datetime) -> Iterator[DagRunInfo]:
        return iter(())

    def dump(self) -> dict[str, Any]:
        return {"kind": "none"}


class OnceTimetable(Timetable):
    """``@once``: one run, at ``start_date``."""

    summary = "@once"

    def next_dagrun_info(
        self,
        *,
        last: DataInterval | None,
        earliest: dt.datetime | None,
        latest: dt.datetime | None,
        catchup: bool,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        if last is not None or earliest is None:
            return None
        if latest is not None and earliest > latest:
            return None
        return DagRunInfo(DataInterval(earliest, earliest), earliest)

    def dump(self) -> dict[str, Any]:
        return {"kind": "once"}


class _IntervalTimetable(Timetable):
    """Continuous intervals, each from one boundary to the next (cron and timedelta)."""

    def _get_next(self, current: dt.datetime) -> dt.datetime:
        raise NotImplementedError

    def _get_prev(self, current: dt.datetime) -> dt.datetime:
        raise NotImplementedError

    def _align_to_next(self, current: dt.datetime) -> dt.datetime:
        """``current`` if it is a boundary, else the next boundary."""
        return current

    def _align_to_prev(self, current: dt.datetime) -> dt.datetime:
        """``current`` if it is a boundary, else the previous boundary."""
        return current

    def _skip_to_latest(self, earliest: dt.datetime | None, now: dt.datetime) -> dt.datetime:
        raise NotImplementedError

    def next_dagrun_info(
        self,
        *,
        last: DataInterval | None,
        earliest: dt.datetime | None,
        latest: dt.datetime | None,
        catchup: bool,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        if not catchup:
            earliest = self._skip_to_latest(earliest, now)
        elif earliest is not None:
            earliest = self._align_to_next(earliest)
        if last is None:
            if earliest is None:
                return None
            start = earliest
        else:
            start = self._align_to_prev(last.end)
            if earliest is not None:
                start = max(start, earliest)
        if latest is not None and start > latest:
            return None
        end = self._get_next(start)
        return DagRunInfo(DataInterval(start, end), end)

    def infer_manual_data_interval(self, run_after: dt.datetime) -> DataInterval:
        end = self._align_to_prev(run_after)
        return DataInterval(self._get_prev(end), end)


@functools.lru_cache(maxsize=4096)
def _cron_step(expression: str, tz: dt.tzinfo, current: dt.datetime, forward: bool) -> dt.datetime:
    """The next (or previous) boundary of a cron expression from ``current`` (aware, UTC).
    Cached: a thousand DAGs on one schedule ask for the same boundary at the same time."""
    naive = current.astimezone(tz).replace(tzinfo=None)
    cron = croniter(expression, naive)
    scheduled: dt.datetime = cron.get_next(dt.datetime) if forward else cron.get_prev(dt.datetime)
    if cron.expanded[1] == ["*"]:
        # Fires every hour: step by elapsed time, so the repeated hour of autumn runs too.
        return current + (scheduled - naive)
    return _localize(scheduled, tz).astimezone(UTC)


@functools.lru_cache(maxsize=4096)
def _check_cron(expression: str, given: str) -> None:
    """Raise ScheduleError if croniter cannot use ``expression`` (``given``: as written).
    Cached (a bad one is not, and is checked again): the scheduler rebuilds the timetable of
    every due DAG, and parsing the expression was most of its time for a thousand DAGs."""
    try:
        croniter(expression)
    except (CroniterBadCronError, CroniterBadDateError, CroniterError, ValueError) as exc:
        raise ScheduleError(_cron_problem(given, exc)) from None


class CronTimetable(_IntervalTimetable):
    """A cron expression (or a preset) evaluated in the DAG's time zone."""

    def __init__(self, expression: str, tz: dt.tzinfo = UTC) -> None:
        self.expression = PRESETS.get(expression, expression)
        self.given = expression
        self.tz = tz
        self.summary = expression
        _check_cron(self.expression, expression)

    def _get_next(self, current: dt.datetime) -> dt.datetime:
        return _cron_step(self.expression, self.tz, current, True)

    def _get_prev(self, current: dt.datetime) -> dt.datetime:
        return _cron_step(self.expression, self.tz, current, False)

    def _align_to_next(self, current: dt.datetime) -> dt.datetime:
        following = self._get_next(current)
        return following if self._get_prev(following) != current else current

    def _align_to_prev(self, current: dt.datetime) -> dt.datetime:
        previous = self._get_prev(current)
        return previous if self._get_next(previous) != current else current

    def _skip_to_latest(self, earliest: dt.datetime | None, now: dt.datetime) -> dt.datetime:
        last_start = self._get_prev(now)
        next_start = self._get_next(last_start)
        new_start = last_start if next_start == now else self._get_prev(last_start)
        if earliest is None:
            return new_start
        return max(new_start, self._align_to_next(earliest))

    def dump(self) -> dict[str, Any]:
        return {"kind": "cron", "expression": self.given, "timezone": _tz_name(self.tz)}


class DeltaTimetable(_IntervalTimetable):
    """A fixed ``timedelta`` between runs, counted from ``start_date``."""

    def __init__(self, delta: dt.timedelta) -> None:
        if delta <= dt.timedelta(0):
            raise ScheduleError(f"a timedelta schedule must be positive, got {delta!r}")
        self.delta = delta
        self.summary = str(delta)

    def _get_next(self, current: dt.datetime) -> dt.datetime:
        return current + self.delta

    def _get_prev(self, current: dt.datetime) -> dt.datetime:
        return current - self.delta

    def _skip_to_latest(self, earliest: dt.datetime | None, now: dt.datetime) -> dt.datetime:
        seconds = self.delta.total_seconds()
        stamp = now.timestamp()
        rounded = dt.datetime.fromtimestamp(stamp - stamp % seconds, tz=UTC)
        new_start = self._get_prev(rounded)
        if earliest is None:
            return new_start
        return max(new_start, earliest)

    def dump(self) -> dict[str, Any]:
        return {"kind": "delta", "seconds": self.delta.total_seconds()}


def _cron_problem(expression: str, exc: Exception) -> str:
    """Which field of a bad cron expression is wrong, as well as croniter can tell."""
    fields = expression.split()
    if expression.startswith("@"):
        return (
            f"unknown schedule preset {expression!r}; use one of @once, "
            f"{', '.join(p for p in PRESETS if p not in ('@midnight', '@annually'))}"
        )
    if len(fields) != 5:
        return (
            f"cron expression {expression!r} must have 5 fields ({', '.join(_CRON_FIELDS)}), "
            f"has {len(fields)}"
        )
    for i, (name, value) in enumerate(zip(_CRON_FIELDS, fields, strict=True)):
        probe = ["*"] * 5
        probe[i] = value
        try:
            croniter(" ".join(probe))
        except (CroniterBadCronError, CroniterBadDateError, CroniterError, ValueError):
            return f"cron expression {expression!r}: bad {name} field {value!r} ({exc})"
    return f"cron expression {expression!r}: {exc}"


def make_timetable(schedule: object, tz: dt.tzinfo = UTC) -> Timetable:
    """The timetable of a DAG's ``schedule`` argument; ScheduleError if it cannot be one."""
    if schedule is None:
        return NullTimetable()
    if isinstance(schedule, dt.timedelta):
        return DeltaTimetable(schedule)
    if isinstance(schedule, str):
        text = schedule.strip()
        if text == "@once":
            return OnceTimetable()
        return CronTimetable(text, tz)
    raise ScheduleError(
        "schedule must be None, a cron expression, a preset (@once, @hourly, @daily, "
        f"@weekly, @monthly, @yearly) or a datetime.timedelta, got {schedule!r}"
    )


def stored_timezone(data: dict[str, Any] | None) -> dt.tzinfo:
    """The DAG's time zone as stored next to its timetable (``"timezone"``; UTC if none)."""
    name = (data or {}).get("timezone")
    return UTC if not name else _tz_from_name(str(name))


def dump_with_timezone(timetable: Timetable, tz: dt.tzinfo) -> dict[str, Any]:
    """What the store keeps of a DAG's schedule: the timetable and the DAG's time zone."""
    return {**timetable.dump(), "timezone": _tz_name(tz)}


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
    if kind == "cron":
        return CronTimetable(data["expression"], _tz_from_name(data["timezone"]))
    if kind == "delta":
        return DeltaTimetable(dt.timedelta(seconds=data["seconds"]))
    raise ScheduleError(f"unknown stored timetable {data!r}")
