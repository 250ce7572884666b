"""Trigger timetables: a run at each time a cron expression fires, as cron itself would (Airflow
3's default for cron strings).

The run that fires at ``t`` is created at ``t``; its logical date is ``t`` and its data
interval ``[t - interval, t]`` (``interval`` defaults to zero: both ends at ``t``, so the
logical date is the moment it fired). ``catchup=False`` creates the latest time it fired
(not before ``start_date``) and then each time it fires; ``catchup=True`` every time it
fired since ``start_date``. A manual run at ``t`` gets ``[t - interval, t]``.

Choose it per DAG (``schedule=CronTriggerTimetable("0 3 * * *", timezone="UTC")``) or for
every cron string with the setting ``create_cron_data_intervals = false``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from engine.dags.timetables._cron import Cron
from engine.dags.timetables.base import (
    UTC,
    DagRunInfo,
    DataInterval,
    ScheduleError,
    Timetable,
    parse_timezone,
    tz_name,
)
from engine.dags.timetables.interval import Delta, dump_delta, load_delta

__all__ = ["CronTriggerTimetable"]


class CronTriggerTimetable(Timetable):
    """A run each time ``cron`` fires in ``timezone``, created when it fires.

    ``interval`` (a timedelta or relativedelta) is how far back the data interval reaches
    from that time (default: zero)."""

    def __init__(
        self,
        cron: str,
        *,
        timezone: str | dt.tzinfo = UTC,
        interval: Delta = dt.timedelta(),
    ) -> None:
        self.cron = Cron(cron, parse_timezone(timezone))
        self.tz = self.cron.tz
        if isinstance(interval, dt.timedelta) and interval < dt.timedelta(0):
            raise ScheduleError(
                f"CronTriggerTimetable: interval must not be negative: {interval!r}"
            )
        self.interval = interval
        self.summary = self.cron.given

    def _info(self, at: dt.datetime) -> DagRunInfo:
        return DagRunInfo(DataInterval(self._back(at), at), at)

    def _back(self, at: dt.datetime) -> dt.datetime:
        start = at - self.interval
        return start.astimezone(UTC)

    def next_dagrun_info(
        self,
        *,
        last: DataInterval | None,
        earliest: dt.datetime | None,
        latest: dt.datetime | None,
        catchup: bool,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        # (A run's own time is the end of its interval.)
        candidates: list[dt.datetime] = []
        if last is not None:
            candidates.append(self.cron.get_next(last.end))
        if earliest is not None:
            candidates.append(self.cron.align_to_next(earliest))
        if not catchup:
            # The latest time it fired by now (created at once), not an older one.
            candidates.append(self.cron.align_to_prev(now))
        if not candidates:
            return None
        at = max(candidates)
        if latest is not None and at > latest:
            return None
        return self._info(at)

    def infer_manual_data_interval(self, run_after: dt.datetime) -> DataInterval:
        return DataInterval(self._back(run_after), run_after)

    def dump(self) -> dict[str, Any]:
        return {
            "kind": "cron_trigger",
            "expression": self.cron.given,
            "zone": tz_name(self.tz),
            "interval": dump_delta(self.interval),
        }

    @classmethod
    def load(cls, data: dict[str, Any]) -> CronTriggerTimetable:
        return cls(
            data["expression"],
            timezone=parse_timezone(data["zone"]),
            interval=load_delta(data["interval"]),
        )
