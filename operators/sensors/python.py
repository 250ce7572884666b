"""The sensor that waits until a Python function returns something truthy.

``operators.python`` re-exports :class:`PythonSensor`; this module imports nothing of it (no
import cycle)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from operators.base import Context, call_with_context
from operators.sensors.base import BaseSensorOperator
from triggers.base import BaseTrigger
from triggers.python import PythonTrigger

__all__ = ["PythonSensor"]


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
