"""The sensor that waits for a task (or a run) of another DAG."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

from operators.base import Context, to_seconds
from operators.sensors.base import BaseSensorOperator
from triggers.base import BaseTrigger
from triggers.connections import DEFAULT_DEFERRAL_CONN_ID
from triggers.external_task import (
    DEFAULT_ALLOWED_STATES,
    DEFAULT_FAILED_STATES,
    TaskStateTrigger,
)

__all__ = ["ExternalTaskSensor"]


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
