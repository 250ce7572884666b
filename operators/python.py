"""Run a Python callable as a task.

``PythonSensor`` lives in :mod:`operators.sensors` with the other sensors (this module imports
that one, never the other way round); it is re-exported here, where it used to live.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from operators.base import BaseOperator, Context, call_with_context
from operators.sensors import PythonSensor

__all__ = ["PythonOperator", "PythonSensor"]


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
        return call_with_context(self.python_callable, self.op_args, self.op_kwargs, context)
