"""Run a Python callable as a task."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from operators.base import BaseOperator, Context
from operators.sensors import BaseSensorOperator
from triggers.base import BaseTrigger
from triggers.python import PythonTrigger

__all__ = ["PythonOperator", "PythonSensor"]


def _context_kwargs(fn: Callable[..., Any], context: Context) -> dict[str, Any]:
    """The context entries the callable asks for by parameter name (all of them for **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins have no signature: pass no context
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(context)
    return {name: value for name, value in context.items() if name in params}


class PythonOperator(BaseOperator):
    """Calls ``python_callable(*op_args, **op_kwargs)`` in a worker thread; its return value is
    the task's result. Parameters named like context entries (``logical_date``, ``run_id``,
    ``conf``, ...) receive them."""

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Sequence[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not callable(python_callable):
            raise TypeError(f"task {self.task_id}: python_callable must be callable")
        if inspect.iscoroutinefunction(python_callable):
            raise TypeError(
                f"task {self.task_id}: python_callable is async; write an operator whose "
                "execute is an async def instead (it runs on the worker's loop)"
            )
        self.python_callable = python_callable
        self.op_args = list(op_args or ())
        self.op_kwargs = dict(op_kwargs or {})

    def execute(self, context: Context) -> Any:
        extra = _context_kwargs(self.python_callable, context)
        extra = {k: v for k, v in extra.items() if k not in self.op_kwargs}
        return self.python_callable(*self.op_args, **self.op_kwargs, **extra)


class PythonSensor(BaseSensorOperator):
    """Waits until ``python_callable(*op_args, **op_kwargs)`` returns something truthy (the
    result, unless it is ``True``). Poke and reschedule mode run the callable on the worker;
    ``deferrable=True`` needs ``async_check``, an import path to an ``async def`` taking
    ``**op_kwargs`` that the triggerer awaits instead (a sync callable would block its loop).
    """

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
        extra = _context_kwargs(self.python_callable, context)
        extra = {k: v for k, v in extra.items() if k not in self.op_kwargs}
        return self.python_callable(*self.op_args, **self.op_kwargs, **extra)

    def can_defer(self) -> bool:
        return self.async_check is not None

    def trigger(self, context: Context) -> BaseTrigger:
        assert self.async_check is not None
        return PythonTrigger(self.async_check, kwargs=self.op_kwargs, **self.trigger_kwargs())
