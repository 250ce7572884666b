"""Sensors: tasks that wait until a condition is true.

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
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from operators.base import (
    BaseOperator,
    Context,
    FailTask,
    RescheduleRequested,
    SkipTask,
    call_with_context,
    to_seconds,
)
from triggers.base import (
    BaseTrigger,
    ImportPathError,
    TaskFailedEvent,
    TaskSkippedEvent,
    TriggerEvent,
    import_object,
)
from triggers.connections import DEFAULT_DEFERRAL_CONN_ID
from triggers.external_task import (
    DEFAULT_ALLOWED_STATES,
    DEFAULT_FAILED_STATES,
    TaskStateTrigger,
)
from triggers.file import FileTrigger, find_files
from triggers.http import HttpResponse, HttpTrigger
from triggers.polling import is_met
from triggers.python import PythonTrigger
from triggers.sql import SqlTrigger
from triggers.temporal import DateTimeTrigger

__all__ = [
    "BaseSensorOperator",
    "DateTimeSensor",
    "ExternalTaskSensor",
    "FileSensor",
    "HttpSensor",
    "PythonSensor",
    "SensorConditionFailed",
    "SensorTimeout",
    "SqlSensor",
    "TimeDeltaSensor",
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
        """Whether the trigger may end the task itself (nothing to run after the event)."""
        return type(self).execute_complete is BaseSensorOperator.execute_complete

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


class FileSensor(BaseSensorOperator):
    """Waits until ``filepath`` (a path or glob; ``**`` with ``recursive``) matches a file;
    the result is the sorted list of matches."""

    template_fields = ("filepath",)

    def __init__(self, *, filepath: str, recursive: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filepath = filepath
        self.recursive = bool(recursive)

    def poke(self, context: Context) -> Any:
        return find_files(self.filepath, self.recursive) or None

    def trigger(self, context: Context) -> BaseTrigger:
        return FileTrigger(self.filepath, recursive=self.recursive, **self.trigger_kwargs())


class HttpSensor(BaseSensorOperator):
    """Waits until ``endpoint`` answers with one of ``expected_status`` and ``response_check``
    accepts the :class:`~triggers.http.HttpResponse`. ``endpoint`` is a URL, or a path
    relative to the URL of the connection ``conn_id``; ``url`` is another name for it.
    ``endpoint``, ``headers`` and ``data`` are templated. ``response_check`` is an import path
    (or a module-level function, turned into one); a lambda or closure works in poke and
    reschedule mode only, since a triggerer cannot import it."""

    template_fields = ("endpoint", "headers", "data")

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        url: str | None = None,
        method: str = "GET",
        headers: dict[str, str] | None = None,
        data: str | None = None,
        expected_status: Sequence[int] = (200,),
        response_check: str | Callable[[HttpResponse], Any] | None = None,
        conn_id: str | None = None,
        request_timeout: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if (endpoint is None) == (url is None):
            raise ValueError(
                f"task {self.task_id}: give HttpSensor one endpoint (or url, its other name)"
            )
        self.endpoint: str = endpoint if endpoint is not None else url  # type: ignore[assignment]
        self.method = method
        self.headers = dict(headers or {})
        self.data = data
        self.expected_status = list(expected_status)
        self.conn_id = conn_id
        self.request_timeout = request_timeout
        self.check_fn: Callable[[HttpResponse], Any] | None = None
        self.check_path: str | None = None
        if isinstance(response_check, str) or response_check is None:
            self.check_path = response_check
        else:
            self.check_path = _import_path_of(response_check)
            self.check_fn = response_check
            if self.check_path is None and self.deferrable:
                raise ValueError(
                    f"task {self.task_id}: a deferrable HttpSensor needs response_check as an "
                    "import path ('module.function'); a lambda or closure cannot reach a triggerer"
                )

    def can_defer(self) -> bool:
        return self.check_fn is None or self.check_path is not None

    def _trigger(self) -> HttpTrigger:
        return HttpTrigger(
            url=self.endpoint,
            method=self.method,
            headers=self.headers,
            data=self.data,
            expected_status=self.expected_status,
            conn_id=self.conn_id,
            request_timeout=self.request_timeout,
            response_check=self.check_path,
            **self.trigger_kwargs(),
        )

    def poke(self, context: Context) -> Any:
        trigger = self._trigger()
        trigger.response_check_fn = self.check_fn
        return asyncio.run(trigger.check())

    def trigger(self, context: Context) -> BaseTrigger:
        return self._trigger()


def _import_path_of(fn: Callable[..., Any]) -> str | None:
    """``module.qualname`` of a function importable under that name, else None."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in name or "." in name:
        return None
    path = f"{module}.{name}"
    try:
        found = import_object(path, "function")
    except ImportPathError:
        return None
    return path if found is fn else None


class SqlSensor(BaseSensorOperator):
    """Waits until the first cell of the first row of ``sql`` is truthy, on the database
    ``conn`` (a URL or a connection id); the result is that cell. ``sql`` and ``parameters``
    are templated; an ``sql`` ending in ``.sql`` names a file in the DAG's folder (or
    ``template_searchpath``), read and rendered."""

    template_fields = ("sql", "parameters")
    template_ext = (".sql",)

    def __init__(
        self, *, conn: str, sql: str, parameters: Sequence[Any] = (), **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.conn = conn
        self.sql = sql
        self.parameters = list(parameters)

    def trigger(self, context: Context) -> BaseTrigger:
        return SqlTrigger(self.conn, self.sql, parameters=self.parameters, **self.trigger_kwargs())


class ExternalTaskSensor(BaseSensorOperator):
    """Waits for ``external_task_id`` of ``external_dag_id`` (or, with no task id, for the
    external run itself) to reach one of ``allowed_states`` in the run whose logical date is
    this run's minus ``execution_delta`` (or ``execution_date_fn(logical_date, context)``).

    A state in ``failed_states`` fails the sensor (skips it with ``soft_fail``). When no
    external run exists at that date the log says so at once, with the nearest dates that do
    exist; ``check_existence=True`` fails the sensor instead of waiting.
    ``external_dag_id`` and ``external_task_id`` are templated.
    """

    template_fields = ("external_dag_id", "external_task_id")

    def __init__(
        self,
        *,
        external_dag_id: str,
        external_task_id: str | None = None,
        execution_delta: dt.timedelta | float | None = None,
        execution_date_fn: Callable[[dt.datetime, Context], dt.datetime] | None = None,
        allowed_states: Sequence[str] = DEFAULT_ALLOWED_STATES,
        failed_states: Sequence[str] = DEFAULT_FAILED_STATES,
        check_existence: bool = False,
        conn: str = DEFAULT_DEFERRAL_CONN_ID,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if execution_delta is not None and execution_date_fn is not None:
            raise ValueError(
                f"task {self.task_id}: pass execution_delta or execution_date_fn, not both"
            )
        self.external_dag_id = external_dag_id
        self.external_task_id = external_task_id
        self.execution_delta = dt.timedelta(
            seconds=to_seconds(execution_delta, "execution_delta") or 0.0
        )
        self.execution_date_fn = execution_date_fn
        self.allowed_states = list(allowed_states)
        self.failed_states = list(failed_states)
        self.check_existence = bool(check_existence)
        self.conn = conn
        self._cached: TaskStateTrigger | None = None

    def external_logical_date(self, context: Context) -> dt.datetime:
        logical_date = context.get("logical_date") or dt.datetime.now(dt.UTC)
        if self.execution_date_fn is not None:
            return self.execution_date_fn(logical_date, context)
        return logical_date - self.execution_delta

    def trigger(self, context: Context) -> BaseTrigger:
        # One instance per execution, so "no such run" is logged once per try, not per poke.
        if self._cached is None:
            self._cached = TaskStateTrigger(
                self.external_dag_id,
                self.external_task_id,
                self.external_logical_date(context),
                states=self.allowed_states,
                failed_states=self.failed_states,
                check_existence=self.check_existence,
                soft_fail=self.soft_fail,
                conn=self.conn,
                **self.trigger_kwargs(),
            )
        return self._cached


class PythonSensor(BaseSensorOperator):
    """Waits until ``python_callable(*op_args, **op_kwargs)`` returns something truthy (the
    result, unless it is ``True``). Poke and reschedule mode run the callable on the worker;
    ``deferrable=True`` needs ``async_check``, an import path to an ``async def`` taking
    ``**op_kwargs`` that the triggerer awaits instead (a sync callable would block its loop).
    ``op_args`` and ``op_kwargs`` are templated.
    """

    template_fields = ("op_args", "op_kwargs")

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Sequence[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        async_check: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not callable(python_callable) or inspect.iscoroutinefunction(python_callable):
            raise TypeError(f"task {self.task_id}: python_callable must be a plain callable")
        if self.deferrable and async_check is None:
            raise ValueError(
                f"task {self.task_id}: a deferrable PythonSensor needs async_check, an import "
                "path to an async def the triggerer can await"
            )
        self.python_callable = python_callable
        self.op_args = list(op_args or ())
        self.op_kwargs = dict(op_kwargs or {})
        self.async_check = async_check

    def poke(self, context: Context) -> Any:
        return call_with_context(self.python_callable, self.op_args, self.op_kwargs, context)

    def can_defer(self) -> bool:
        return self.async_check is not None

    def trigger(self, context: Context) -> BaseTrigger:
        assert self.async_check is not None
        return PythonTrigger(self.async_check, kwargs=self.op_kwargs, **self.trigger_kwargs())
