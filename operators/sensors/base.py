"""The base of sensors: tasks that wait until a condition is true.

Every sensor checks with ``poke(context)`` and runs in one of three ways:

* ``mode="poke"``: hold the worker slot and check every ``poke_interval``;
* ``mode="reschedule"``: check once, then give the slot back until the next check;
* ``deferrable=True``: check once on the worker (a condition already true costs no
  deferral), then hand the wait to a triggerer via the sensor's :meth:`trigger`.

``deferrable=None`` (the default) follows the engine's ``default_deferrable`` setting, which
the worker hands over at run time in ``context["default_deferrable"]`` (a sensor that cannot
defer, e.g. with no async check, then waits in its ``mode``).

``timeout`` counts from the sensor's first try, across reschedules, deferrals and retries.
``soft_fail`` turns a timeout into ``skipped``. A timeout never uses the task's retries (as
in Airflow): in the worker it is a :class:`SensorTimeout`, and a timed-out deferral of a
sensor ends as failed (``no_retry_on_timeout``).

The built-in sensors write their condition once, as the ``check()`` of a polling trigger
(:mod:`triggers.polling`); ``poke`` runs that same check on the worker.
"""

from __future__ import annotations

import asyncio
import datetime as dt
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
from triggers.base import BaseTrigger, TaskFailedEvent, TaskSkippedEvent, TriggerEvent
from triggers.polling import is_met

__all__ = [
    "DEFAULT_POKE_INTERVAL_S",
    "DEFAULT_SENSOR_TIMEOUT_S",
    "BaseSensorOperator",
    "SensorConditionFailed",
    "SensorTimeout",
]

DEFAULT_SENSOR_TIMEOUT_S = 7 * 24 * 3600.0
DEFAULT_POKE_INTERVAL_S = 60.0


class SensorTimeout(FailTask):
    """The sensor's condition did not become true within its timeout (no retries)."""


class SensorConditionFailed(Exception):
    """The check found a state that can never become true (retries apply)."""


class BaseSensorOperator(BaseOperator):
    """Base class of sensors; subclasses implement :meth:`poke` and, to be deferrable,
    :meth:`trigger` (or only :meth:`trigger`, when it is a polling trigger whose ``check()``
    serves as the poke)."""

    #: A deferral timeout ends the task as failed without retries (stored per task instance).
    no_retry_on_timeout = True

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
        #: True or False as given; None follows the engine's ``default_deferrable``.
        self.deferrable = None if deferrable is None else bool(deferrable)

    def defers(self, context: Context) -> bool:
        """Whether this sensor hands its wait to a triggerer: ``deferrable`` when given, else
        the engine's ``default_deferrable`` (from the context) if it :meth:`can_defer`."""
        if self.deferrable is not None:
            return self.deferrable
        return bool(context.get("default_deferrable", False)) and self.can_defer()

    def can_defer(self) -> bool:
        """Whether this sensor has a trigger to defer to (subclasses with conditions say so)."""
        return type(self).trigger is not BaseSensorOperator.trigger

    # -- what subclasses write -------------------------------------------------------------

    def poke(self, context: Context) -> Any:
        """Check the condition once; a truthy value ends the wait (anything but ``True`` is
        the task's result). The default runs the ``check()`` of :meth:`trigger`."""
        trigger = self.trigger(context)
        check = getattr(trigger, "check", None)
        if check is None:
            raise NotImplementedError(f"{type(self).__qualname__} must implement poke()")

        async def once() -> Any:
            try:
                return await check()
            finally:
                await trigger.cleanup()

        # poke runs in a worker thread, which has no event loop of its own.
        return asyncio.run(once())

    def trigger(self, context: Context) -> BaseTrigger:
        """The trigger that waits for the condition in deferrable mode."""
        raise NotImplementedError(
            f"{type(self).__qualname__} cannot defer: it has no trigger(); use mode='poke' or "
            "'reschedule'"
        )

    def execute_complete(self, context: Context, event: Any = None) -> Any:
        """Runs on a worker after the trigger fired; returns the event's payload.

        A sensor that does not override it lets its trigger end the task directly
        (``end_from_trigger``), without a worker hop."""
        return event

    # -- helpers for subclasses ----------------------------------------------------------

    @property
    def ends_in_trigger(self) -> bool:
        """Whether the trigger may end the task itself (nothing to run after the event). Not
        with ``outlets``: their events are written with the success by a worker."""
        return (
            type(self).execute_complete is BaseSensorOperator.execute_complete and not self.outlets
        )

    def trigger_kwargs(self) -> dict[str, Any]:
        """``poll_interval`` and ``end_from_trigger`` for a built-in polling trigger."""
        return {"poll_interval": self.poke_interval_s, "end_from_trigger": self.ends_in_trigger}

    # -- the three ways to wait ----------------------------------------------------------

    def _elapsed_s(self, context: Context, started: float) -> float:
        claimed_at = context.get("claimed_at")
        first_try_at = context.get("first_try_at")
        before = (claimed_at - first_try_at).total_seconds() if claimed_at and first_try_at else 0.0
        return before + (time.monotonic() - started)

    def interval_s(self, elapsed_s: float) -> float:
        """The wait before the next check, ``elapsed_s`` after the first try started.

        With ``exponential_backoff`` each wait is as long as all the waiting so far, so the
        waits go poke_interval, x1, x2, x4, ... (stateless: it needs no poke counter across
        reschedules), capped by ``max_wait``."""
        interval = self.poke_interval_s
        if self.exponential_backoff:
            interval = max(interval, elapsed_s)
        if self.max_wait_s is not None:
            interval = min(interval, self.max_wait_s)
        return interval

    def _timed_out(self, elapsed_s: float) -> None:
        message = (
            f"sensor timed out after {elapsed_s:.1f}s: its timeout of {self.timeout_s:.1f}s "
            "(counted from its first try) passed before the condition was true"
        )
        if self.soft_fail:
            raise SkipTask(f"{message}; skipped (soft_fail)")
        raise SensorTimeout(
            f"{message}; not retried, on purpose: a sensor's timeout ends it whatever retries "
            "are left (retries are for errors)"
        )

    def _poke_once(self, context: Context) -> Any:
        result = self.poke(context)
        if isinstance(result, TaskSkippedEvent):
            raise SkipTask(str(result.payload))
        if isinstance(result, TaskFailedEvent):
            raise SensorConditionFailed(str(result.payload))
        if isinstance(result, TriggerEvent):
            return True if result.payload is None else result.payload
        return result

    def execute(self, context: Context) -> Any:
        started = time.monotonic()
        while True:
            result = self._poke_once(context)
            if is_met(result):
                return None if result is True else result
            elapsed = self._elapsed_s(context, started)
            if elapsed >= self.timeout_s:
                self._timed_out(elapsed)
            if self.defers(context):
                self.defer(
                    trigger=self.trigger(context),
                    method_name="execute_complete",
                    timeout=self.timeout_s - elapsed,
                )
            interval = min(self.interval_s(elapsed), self.timeout_s - elapsed)
            if self.mode == "reschedule":
                claimed_at = context.get("claimed_at") or dt.datetime.now(dt.UTC)
                at = claimed_at + dt.timedelta(seconds=time.monotonic() - started + interval)
                raise RescheduleRequested(at)
            time.sleep(interval)
