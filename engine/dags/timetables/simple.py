"""Timetables without a period: no schedule, ``@once``, and ``@continuous``."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

from engine.dags.timetables.base import DagRunInfo, DataInterval, ScheduleError, Timetable

__all__ = ["ContinuousTimetable", "NullTimetable", "OnceTimetable"]

#: How far past the previous run a continuous DAG's next one is stored (it is created when
#: the previous run has ended, whatever the time then).
_TICK = dt.timedelta(microseconds=1)


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


class ContinuousTimetable(Timetable):
    """``@continuous``: a new run as soon as the previous one ended, one at a time
    (``max_active_runs=1``), from ``start_date`` to ``end_date``.

    Each run's logical date is the moment it was created, its data interval that moment
    (zero length). The scheduler creates a continuous DAG's next run only while none of its
    runs is queued or running (``due_dags``); ``catchup`` does not apply."""

    summary = "@continuous"
    active_runs_limit = 1

    def next_dagrun_info(
        self,
        *,
        last: DataInterval | None,
        earliest: dt.datetime | None,
        latest: dt.datetime | None,
        catchup: bool,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        if earliest is None:
            return None
        # The first: now (or at start_date). After one: strictly later than it and than now,
        # so one pass creates one run; the scheduler holds it back until the run ended.
        at = max(earliest, now) if last is None else max(now, last.end) + _TICK
        if latest is not None and at > latest:
            return None
        return DagRunInfo.exact(at)

    def runs_between(self, earliest: dt.datetime, latest: dt.datetime) -> Iterator[DagRunInfo]:
        raise ScheduleError("a @continuous DAG has no logical dates to backfill")

    def dump(self) -> dict[str, Any]:
        return {"kind": "continuous"}
