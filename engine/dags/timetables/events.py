"""``EventsTimetable``: runs at a list of moments (``schedule=EventsTimetable([...])``)."""

from __future__ import annotations

import bisect
import datetime as dt
from collections.abc import Iterable
from typing import Any

from engine.dags.timetables.base import (
    UTC,
    DagRunInfo,
    DataInterval,
    ScheduleError,
    Timetable,
    to_aware,
)

__all__ = ["EventsTimetable"]


class EventsTimetable(Timetable):
    """A run at each of ``event_dates`` (its logical date, and when it is created; the data
    interval is that moment). Naive dates are read in UTC, as the engine's other naive
    dates are in the ``default_timezone`` setting's zone: give aware ones.

    ``catchup=False`` creates the latest event that has passed (not one before
    ``start_date``) and then each event as it comes; ``catchup=True`` every event since
    ``start_date``. A manual run at ``t`` covers ``t``; with ``restrict_to_events=True``, the
    latest event at or before ``t`` (the first event when all are later)."""

    def __init__(
        self,
        event_dates: Iterable[dt.datetime],
        *,
        restrict_to_events: bool = False,
        presorted: bool = False,
        description: str | None = None,
    ) -> None:
        events: list[dt.datetime] = []
        for when in event_dates:
            if not isinstance(when, dt.datetime):
                raise ScheduleError(f"EventsTimetable: every event must be a datetime: {when!r}")
            events.append(to_aware(when, UTC))
        self.event_dates = events if presorted else sorted(events)
        self.restrict_to_events = bool(restrict_to_events)
        self.description = description
        count = len(self.event_dates)
        self.summary = description or f"{count} event{'s' if count != 1 else ''}"

    def next_dagrun_info(
        self,
        *,
        last: DataInterval | None,
        earliest: dt.datetime | None,
        latest: dt.datetime | None,
        catchup: bool,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        events = self.event_dates
        i = 0 if earliest is None else bisect.bisect_left(events, earliest)
        if last is not None:
            i = max(i, bisect.bisect_right(events, last.end))
        if not catchup:
            # Not an event older than the latest one that has passed.
            i = max(i, bisect.bisect_right(events, now) - 1)
        if i >= len(events):
            return None
        at = events[i]
        if latest is not None and at > latest:
            return None
        return DagRunInfo.exact(at)

    def infer_manual_data_interval(self, run_after: dt.datetime) -> DataInterval:
        if not self.restrict_to_events or not self.event_dates:
            return DataInterval.exact(run_after)
        i = bisect.bisect_right(self.event_dates, run_after) - 1
        return DataInterval.exact(self.event_dates[max(i, 0)])

    def dump(self) -> dict[str, Any]:
        return {
            "kind": "events",
            "events": [e.isoformat() for e in self.event_dates],
            "restrict_to_events": self.restrict_to_events,
            "description": self.description,
        }

    @classmethod
    def load(cls, data: dict[str, Any]) -> EventsTimetable:
        return cls(
            [dt.datetime.fromisoformat(e) for e in data["events"]],
            restrict_to_events=bool(data.get("restrict_to_events")),
            presorted=True,
            description=data.get("description"),
        )
