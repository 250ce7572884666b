"""Data-interval timetables: a cron expression or a delta cuts time into contiguous intervals,
and each interval's run is created once it has ended (Airflow 2's model, and the default
here for cron strings and deltas).

* a run covers ``[start, end)``; its ``logical_date`` is ``start`` and it is created once
  ``end`` has passed (``run_after``);
* ``catchup=False`` creates only the latest complete interval; ``catchup=True`` every one
  since ``start_date``, oldest first; no run's interval starts after ``end_date``;
* a manual run at time ``t`` gets the last complete interval before ``t`` (cron), or
  ``[t - delta, t)`` (delta). On the day a DST change skips the cron's time, that is still
  the whole day's interval (Airflow 3's behaviour; Airflow 2 gave a zero-length one).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from dateutil.relativedelta import relativedelta, weekday

from engine.dags.timetables._cron import Cron
from engine.dags.timetables.base import (
    UTC,
    DagRunInfo,
    DataInterval,
    ScheduleError,
    Timetable,
    localize,
    parse_timezone,
    tz_name,
)

__all__ = [
    "CronDataIntervalTimetable",
    "CronTimetable",
    "DeltaDataIntervalTimetable",
    "DeltaTimetable",
    "dump_delta",
    "load_delta",
]

Delta = dt.timedelta | relativedelta


class _IntervalTimetable(Timetable):
    """Continuous intervals, each from one boundary to the next (cron and delta)."""

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


class CronDataIntervalTimetable(_IntervalTimetable):
    """A cron expression (or a preset) evaluated in a time zone, one run per interval between
    two of its times (``schedule="0 3 * * *"`` by default)."""

    def __init__(self, cron: str, timezone: str | dt.tzinfo = UTC) -> None:
        self.cron = Cron(cron, parse_timezone(timezone))
        self.expression = self.cron.expression
        self.given = self.cron.given
        self.tz = self.cron.tz
        self.summary = self.cron.given

    def _get_next(self, current: dt.datetime) -> dt.datetime:
        return self.cron.get_next(current)

    def _get_prev(self, current: dt.datetime) -> dt.datetime:
        return self.cron.get_prev(current)

    def _align_to_next(self, current: dt.datetime) -> dt.datetime:
        return self.cron.align_to_next(current)

    def _align_to_prev(self, current: dt.datetime) -> dt.datetime:
        return self.cron.align_to_prev(current)

    def _skip_to_latest(self, earliest: dt.datetime | None, now: dt.datetime) -> dt.datetime:
        last_start = self._get_prev(now)
        next_start = self._get_next(last_start)
        new_start = last_start if next_start == now else self._get_prev(last_start)
        if earliest is None:
            return new_start
        return max(new_start, self._align_to_next(earliest))

    def dump(self) -> dict[str, Any]:
        # ("zone": the cron's own; "timezone", added beside it, is the DAG's.)
        return {"kind": "cron", "expression": self.given, "zone": tz_name(self.tz)}


#: The name it had before the trigger timetable came.
CronTimetable = CronDataIntervalTimetable


class DeltaDataIntervalTimetable(_IntervalTimetable):
    """A fixed delta between runs, counted from ``start_date``: a ``datetime.timedelta``
    (elapsed time) or a ``dateutil.relativedelta`` (calendar steps, ``months=1``, read on the
    wall clock of the DAG's time zone)."""

    def __init__(self, delta: Delta, tz: dt.tzinfo = UTC) -> None:
        if isinstance(delta, dt.timedelta):
            if delta <= dt.timedelta(0):
                raise ScheduleError(f"a timedelta schedule must be positive, got {delta!r}")
        elif isinstance(delta, relativedelta):
            probe = dt.datetime(2000, 1, 1)
            if probe + delta <= probe:
                raise ScheduleError(f"a relativedelta schedule must be positive, got {delta!r}")
        else:
            raise ScheduleError(f"a delta schedule must be a timedelta or relativedelta: {delta!r}")
        self.delta = delta
        self.tz = tz
        self.summary = str(delta) if isinstance(delta, dt.timedelta) else _describe(delta)

    def _step(self, current: dt.datetime, sign: int) -> dt.datetime:
        if isinstance(self.delta, dt.timedelta):
            return current + sign * self.delta
        wall = current.astimezone(self.tz).replace(tzinfo=None)
        moved = wall + self.delta if sign > 0 else wall - self.delta
        return localize(moved, self.tz).astimezone(UTC)

    def _get_next(self, current: dt.datetime) -> dt.datetime:
        return self._step(current, 1)

    def _get_prev(self, current: dt.datetime) -> dt.datetime:
        return self._step(current, -1)

    def _seconds(self) -> float:
        if isinstance(self.delta, dt.timedelta):
            return self.delta.total_seconds()
        probe = dt.datetime(2001, 1, 1)  # (an approximate length, as Airflow rounds with)
        return ((probe + self.delta) - probe).total_seconds()

    def _skip_to_latest(self, earliest: dt.datetime | None, now: dt.datetime) -> dt.datetime:
        seconds = self._seconds()
        stamp = now.timestamp()
        rounded = dt.datetime.fromtimestamp(stamp - stamp % seconds, tz=UTC)
        new_start = self._get_prev(rounded)
        if earliest is None:
            return new_start
        return max(new_start, earliest)

    def dump(self) -> dict[str, Any]:
        if isinstance(self.delta, dt.timedelta):
            return {"kind": "delta", "seconds": self.delta.total_seconds()}
        return {"kind": "relativedelta", "delta": dump_delta(self.delta), "zone": tz_name(self.tz)}


#: The name it had before relativedelta schedules came.
DeltaTimetable = DeltaDataIntervalTimetable

_RELATIVE = ("years", "months", "days", "leapdays", "hours", "minutes", "seconds", "microseconds")
_ABSOLUTE = ("year", "month", "day", "hour", "minute", "second", "microsecond")


def _describe(delta: relativedelta) -> str:
    parts = [f"{name}={getattr(delta, name)}" for name in (*_RELATIVE, *_ABSOLUTE)
             if getattr(delta, name)]  # fmt: skip
    if delta.weekday is not None:
        parts.append(f"weekday={delta.weekday!r}")
    return f"relativedelta({', '.join(parts)})"


def dump_delta(delta: Delta) -> dict[str, Any]:
    """A timedelta or relativedelta as JSON data (:func:`load_delta`)."""
    if isinstance(delta, dt.timedelta):
        return {"seconds": delta.total_seconds()}
    data: dict[str, Any] = {
        name: getattr(delta, name) for name in _RELATIVE if getattr(delta, name)
    }
    data.update({name: getattr(delta, name) for name in _ABSOLUTE
                 if getattr(delta, name) is not None})  # fmt: skip
    if delta.weekday is not None:
        data["weekday"] = [delta.weekday.weekday, delta.weekday.n]
    return {"relativedelta": data}


def load_delta(data: dict[str, Any]) -> Delta:
    if "relativedelta" not in data:
        return dt.timedelta(seconds=float(data["seconds"]))
    fields = dict(data["relativedelta"])
    day = fields.pop("weekday", None)
    if day is not None:
        fields["weekday"] = weekday(day[0], day[1])
    return relativedelta(**fields)
