"""Triggers that wait for a moment in time."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

from triggers.base import BaseTrigger, TaskSuccessEvent, TriggerEvent

__all__ = ["DateTimeTrigger", "TimeDeltaTrigger"]


def _aware(moment: dt.datetime | str, name: str) -> dt.datetime:
    if isinstance(moment, str):
        try:
            moment = dt.datetime.fromisoformat(moment)
        except ValueError:
            raise ValueError(f"{name} {moment!r} is not an ISO 8601 date-time") from None
    if not isinstance(moment, dt.datetime):
        raise TypeError(f"{name} must be a datetime, got {type(moment).__name__}")
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"{name} {moment.isoformat()} has no time zone; pass an aware datetime")
    return moment.astimezone(dt.UTC)


class DateTimeTrigger(BaseTrigger):
    """Fires at ``moment`` (an aware datetime). The event's payload is the moment.

    With ``end_from_trigger=True`` the task ends as success right here, without going
    back to a worker.

    Clocks: it fires when the *triggerer host's* clock reaches ``moment``, while the deferral's
    deadline is kept on the database clock. A built-in trigger imports the contracts only and
    has no database connection of its own, so it cannot read that clock; the bound is the
    skew between the two hosts: with a triggerer clock ``s`` seconds behind the database it
    fires ``s`` seconds late (and a deadline within ``s`` of the moment may end the wait
    first); ``s`` ahead, ``s`` early. Keep the hosts NTP-synchronized (skew of milliseconds).
    The :class:`operators.sensors.DateTimeSensor` in poke and reschedule mode uses the
    database clock.
    """

    def __init__(self, moment: dt.datetime | str, *, end_from_trigger: bool = False) -> None:
        self.moment = _aware(moment, "moment")
        self.end_from_trigger = bool(end_from_trigger)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.temporal.DateTimeTrigger",
            {"moment": self.moment, "end_from_trigger": self.end_from_trigger},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        delay = (self.moment - dt.datetime.now(dt.UTC)).total_seconds()
        if delay > 0:
            await asyncio.sleep(delay)
        if self.end_from_trigger:
            yield TaskSuccessEvent(self.moment)
        else:
            yield TriggerEvent(self.moment)


class TimeDeltaTrigger(DateTimeTrigger):
    """Fires ``delta`` after it is created; stored as the equivalent :class:`DateTimeTrigger`."""

    def __init__(self, delta: dt.timedelta | float, *, end_from_trigger: bool = False) -> None:
        if isinstance(delta, int | float) and not isinstance(delta, bool):
            delta = dt.timedelta(seconds=delta)
        if not isinstance(delta, dt.timedelta):
            raise TypeError(f"delta must be a timedelta or seconds, got {type(delta).__name__}")
        super().__init__(dt.datetime.now(dt.UTC) + delta, end_from_trigger=end_from_trigger)
