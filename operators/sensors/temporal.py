"""Sensors that wait for a moment: a given time, or a delay after the run's logical date."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from operators.base import Context, to_seconds
from operators.sensors.base import BaseSensorOperator
from triggers.base import BaseTrigger
from triggers.temporal import DateTimeTrigger

__all__ = ["DateTimeSensor", "TimeDeltaSensor"]


class DateTimeSensor(BaseSensorOperator):
    """Waits until ``target_time`` (an aware datetime).

    Poke and reschedule modes compare the target with the database clock, the clock of the
    sensor's timeout and of every deadline: the time the worker claimed the task
    (``context["claimed_at"]``, read from the database) plus the monotonic time since this try
    began. A worker host whose clock is off therefore neither ends the wait early nor holds it
    past its timeout. (Deferred, the wait is the :class:`DateTimeTrigger`'s, which compares
    with the triggerer host's clock: see its docstring for that bound.)
    """

    def __init__(self, *, target_time: dt.datetime, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if target_time.tzinfo is None:
            raise ValueError(f"task {self.task_id}: target_time must be timezone-aware")
        self.target_time = target_time
        self._clock_origin: tuple[dt.datetime, float] | None = None

    def target(self, context: Context) -> dt.datetime:
        return self.target_time

    def execute(self, context: Context) -> Any:
        claimed_at = context.get("claimed_at")
        self._clock_origin = None if claimed_at is None else (claimed_at, time.monotonic())
        return super().execute(context)

    def database_now(self) -> dt.datetime:
        """The database clock now, as read at the claim and carried on by the monotonic clock
        (a few milliseconds behind it: the wait ends that much late, never early). Without a
        claim time (``poke`` called outside a worker), the host clock."""
        origin: tuple[dt.datetime, float] | None = getattr(self, "_clock_origin", None)
        if origin is None:
            return dt.datetime.now(dt.UTC)
        claimed_at, at = origin
        return claimed_at + dt.timedelta(seconds=time.monotonic() - at)

    def poke(self, context: Context) -> bool:
        return self.database_now() >= self.target(context)

    def trigger(self, context: Context) -> BaseTrigger:
        return DateTimeTrigger(self.target(context), end_from_trigger=self.ends_in_trigger)


class TimeDeltaSensor(DateTimeSensor):
    """Waits until ``delta`` after the run's logical date."""

    def __init__(self, *, delta: dt.timedelta | float, **kwargs: Any) -> None:
        seconds = to_seconds(delta, "delta")
        BaseSensorOperator.__init__(self, **kwargs)
        self.delta = dt.timedelta(seconds=seconds or 0.0)

    def target(self, context: Context) -> dt.datetime:
        logical_date = context.get("logical_date") or dt.datetime.now(dt.UTC)
        return logical_date + self.delta
