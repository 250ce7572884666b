"""Sensors: tasks that wait until a condition is true.

Every sensor checks with ``poke(context)`` and runs in one of three ways:

* ``mode="poke"``: hold the worker slot and check every ``poke_interval``;
* ``mode="reschedule"``: check once, then give the slot back until the next check;
* ``deferrable=True``: check once on the worker (a condition already true costs no
  deferral), then hand the wait to a triggerer via the sensor's :meth:`trigger`.

``timeout`` counts from the sensor's first try, across reschedules and deferrals.
``soft_fail`` turns a timeout into ``skipped``.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from typing import Any

from operators.base import (
    BaseOperator,
    Context,
    FailTask,
    RescheduleRequested,
    SkipTask,
    to_seconds,
)
from triggers.base import BaseTrigger
from triggers.temporal import DateTimeTrigger

__all__ = [
    "BaseSensorOperator",
    "DateTimeSensor",
    "SensorTimeout",
    "TimeDeltaSensor",
    "default_deferrable",
]

DEFAULT_SENSOR_TIMEOUT_S = 7 * 24 * 3600.0
DEFAULT_POKE_INTERVAL_S = 60.0


def default_deferrable() -> bool:
    """``DEFERRAL_DEFAULT_DEFERRABLE`` (true/false); false when unset."""
    value = os.environ.get("DEFERRAL_DEFAULT_DEFERRABLE", "").strip().lower()
    return value in ("1", "true", "yes", "on")


class SensorTimeout(FailTask):
    """The sensor's condition did not become true within its timeout."""


class BaseSensorOperator(BaseOperator):
    """Base class of sensors; subclasses implement :meth:`poke` and, to be deferrable,
    :meth:`trigger`."""

    def __init__(
        self,
        *,
        poke_interval: dt.timedelta | float = DEFAULT_POKE_INTERVAL_S,
        timeout: dt.timedelta | float = DEFAULT_SENSOR_TIMEOUT_S,
        mode: str = "poke",
        soft_fail: bool = False,
        exponential_backoff: bool = False,
        max_wait: dt.timedelta | float | None = None,
        deferrable: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if mode not in ("poke", "reschedule"):
            raise ValueError(
                f"task {self.task_id}: mode must be 'poke' or 'reschedule', not {mode!r}"
            )
        self.poke_interval_s = to_seconds(poke_interval, "poke_interval") or 0.0
        self.timeout_s = to_seconds(timeout, "timeout") or 0.0
        self.mode = mode
        self.soft_fail = bool(soft_fail)
        self.exponential_backoff = bool(exponential_backoff)
        self.max_wait_s = to_seconds(max_wait, "max_wait")
        self.deferrable = default_deferrable() if deferrable is None else bool(deferrable)

    # -- what subclasses write -------------------------------------------------------------

    def poke(self, context: Context) -> bool:
        """Check the condition once; True ends the wait."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement poke()")

    def trigger(self, context: Context) -> BaseTrigger:
        """The trigger that waits for the condition in deferrable mode."""
        raise NotImplementedError(
            f"{type(self).__qualname__} cannot defer: it has no trigger(); use mode='poke' or "
            "'reschedule'"
        )

    def execute_complete(self, context: Context, event: Any = None) -> Any:
        """Runs on a worker after the trigger fired; returns the event's payload."""
        return event

    # -- the three ways to wait ----------------------------------------------------------

    def _elapsed_s(self, context: Context, started: float) -> float:
        claimed_at = context.get("claimed_at")
        first_try_at = context.get("first_try_at")
        before = (claimed_at - first_try_at).total_seconds() if claimed_at and first_try_at else 0.0
        return before + (time.monotonic() - started)

    def _interval_s(self, elapsed_s: float) -> float:
        interval = self.poke_interval_s
        if self.exponential_backoff:
            # Each wait as long as all the waiting so far: poke_interval, x1, x2, x4, ...
            interval = max(interval, elapsed_s)
        if self.max_wait_s is not None:
            interval = min(interval, self.max_wait_s)
        return interval

    def _timed_out(self, elapsed_s: float) -> None:
        message = f"sensor timed out after {elapsed_s:.1f}s (timeout {self.timeout_s:.1f}s)"
        if self.soft_fail:
            raise SkipTask(message)
        raise SensorTimeout(message)

    def execute(self, context: Context) -> Any:
        started = time.monotonic()
        while True:
            if self.poke(context):
                return None
            elapsed = self._elapsed_s(context, started)
            if elapsed >= self.timeout_s:
                self._timed_out(elapsed)
            if self.deferrable:
                self.defer(
                    trigger=self.trigger(context),
                    method_name="execute_complete",
                    timeout=self.timeout_s - elapsed,
                )
            interval = min(self._interval_s(elapsed), self.timeout_s - elapsed)
            if self.mode == "reschedule":
                claimed_at = context.get("claimed_at") or dt.datetime.now(dt.UTC)
                at = claimed_at + dt.timedelta(seconds=time.monotonic() - started + interval)
                raise RescheduleRequested(at)
            time.sleep(interval)


class DateTimeSensor(BaseSensorOperator):
    """Waits until ``target_time`` (an aware datetime)."""

    def __init__(self, *, target_time: dt.datetime, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if target_time.tzinfo is None:
            raise ValueError(f"task {self.task_id}: target_time must be timezone-aware")
        self.target_time = target_time

    def target(self, context: Context) -> dt.datetime:
        return self.target_time

    def poke(self, context: Context) -> bool:
        return dt.datetime.now(dt.UTC) >= self.target(context)

    def trigger(self, context: Context) -> BaseTrigger:
        return DateTimeTrigger(self.target(context))


class TimeDeltaSensor(DateTimeSensor):
    """Waits until ``delta`` after the run's logical date."""

    def __init__(self, *, delta: dt.timedelta | float, **kwargs: Any) -> None:
        seconds = to_seconds(delta, "delta")
        BaseSensorOperator.__init__(self, **kwargs)
        self.delta = dt.timedelta(seconds=seconds or 0.0)

    def target(self, context: Context) -> dt.datetime:
        logical_date = context.get("logical_date") or dt.datetime.now(dt.UTC)
        return logical_date + self.delta
