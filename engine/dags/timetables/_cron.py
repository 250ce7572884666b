"""Cron expressions evaluated in a time zone: the boundaries both cron timetables step along.

croniter works on naive wall clock times. A boundary is read in the DAG's zone:

* a cron that fires at least once an hour steps by elapsed time across a DST change (so
  ``30 * * * *`` also runs in the repeated hour of autumn);
* any other cron keeps its wall clock time (``0 3 * * *`` stays at 03:00); a wall clock time
  that does not exist (spring forward) moves forward by the gap, one that exists twice
  (autumn) is the second one.

A step is strictly monotonic: the boundary before ``t`` is earlier than ``t`` and the one after
it later, also when the wall clock time croniter names lands on ``t`` or past it once placed
in the zone (the skipped 02:00 of a spring-forward day read forward to 03:00, the repeated
01:00 of an autumn day read as the second one). Without that, the day before a spring-forward
gap would have no interval of its own.
"""

from __future__ import annotations

import datetime as dt
import functools

from croniter import CroniterBadCronError, CroniterBadDateError, CroniterError, croniter

from engine.dags.timetables.base import UTC, ScheduleError, localize

__all__ = ["PRESETS", "Cron", "check_cron"]

#: The presets a schedule may name, and the cron expression each stands for.
PRESETS: dict[str, str] = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@quarterly": "0 0 1 */3 *",
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
}
#: The presets that are not cron expressions (other timetables).
OTHER_PRESETS = ("@once", "@continuous")
_CRON_FIELDS = ("minute", "hour", "day of month", "month", "day of week")
#: Boundaries croniter may name before one lands strictly past ``current`` (a DST change
#: costs one; more means the expression never fires, like ``0 0 30 2 *``).
_MAX_STEPS = 8


@functools.lru_cache(maxsize=4096)
def _cron_step(expression: str, tz: dt.tzinfo, current: dt.datetime, forward: bool) -> dt.datetime:
    """The next (or previous) boundary of a cron expression strictly after (before)
    ``current`` (aware, UTC). Cached: a thousand DAGs on one schedule ask for the same
    boundary at the same time."""
    naive = current.astimezone(tz).replace(tzinfo=None)
    cron = croniter(expression, naive)
    every_hour = cron.expanded[1] == ["*"]
    for _ in range(_MAX_STEPS):
        scheduled: dt.datetime = (
            cron.get_next(dt.datetime) if forward else cron.get_prev(dt.datetime)
        )
        if every_hour:
            # Fires every hour: step by elapsed time, so the repeated hour of autumn runs too.
            found = current + (scheduled - naive)
        else:
            found = localize(scheduled, tz).astimezone(UTC)
        if (found > current) if forward else (found < current):
            return found
    raise ScheduleError(f"cron expression {expression!r} has no boundary near {current}")


@functools.lru_cache(maxsize=4096)
def check_cron(expression: str, given: str) -> None:
    """Raise ScheduleError if croniter cannot use ``expression`` (``given``: as written).
    Cached (a bad one is not, and is checked again): the scheduler rebuilds the timetable of
    every due DAG, and parsing the expression was most of its time for a thousand DAGs."""
    try:
        croniter(expression)
    except (CroniterBadCronError, CroniterBadDateError, CroniterError, ValueError) as exc:
        raise ScheduleError(_cron_problem(given, exc)) from None


def _cron_problem(expression: str, exc: Exception) -> str:
    """Which field of a bad cron expression is wrong, as well as croniter can tell."""
    fields = expression.split()
    if expression.startswith("@"):
        known = [p for p in (*OTHER_PRESETS, *PRESETS) if p not in ("@midnight", "@annually")]
        return f"unknown schedule preset {expression!r}; use one of {', '.join(known)}"
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


class Cron:
    """A cron expression (or a preset) in a time zone: its boundaries."""

    def __init__(self, expression: str, tz: dt.tzinfo = UTC) -> None:
        if not isinstance(expression, str) or not expression.strip():
            raise ScheduleError(f"a cron expression must be a non-empty str, got {expression!r}")
        given = expression.strip()
        self.expression = PRESETS.get(given, given)
        self.given = given
        self.tz = tz
        check_cron(self.expression, given)

    def get_next(self, current: dt.datetime) -> dt.datetime:
        """The first boundary after ``current``."""
        return _cron_step(self.expression, self.tz, current, True)

    def get_prev(self, current: dt.datetime) -> dt.datetime:
        """The last boundary before ``current``."""
        return _cron_step(self.expression, self.tz, current, False)

    def align_to_next(self, current: dt.datetime) -> dt.datetime:
        """``current`` if it is a boundary, else the next boundary."""
        following = self.get_next(current)
        return following if self.get_prev(following) != current else current

    def align_to_prev(self, current: dt.datetime) -> dt.datetime:
        """``current`` if it is a boundary, else the previous boundary."""
        previous = self.get_prev(current)
        return previous if self.get_next(previous) != current else current
