"""Run a Python callable as a task.

``BranchPythonOperator`` and ``ShortCircuitOperator`` skip downstream tasks
(:mod:`operators.branch`). ``PythonSensor`` lives in :mod:`operators.sensors` with the other sensors
(``operators/sensors/python.py``; this module imports that one, never the other way round); it
is re-exported here, where it used to live.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from operators.base import BaseOperator, Context, call_with_context
from operators.branch import BranchMixIn, descendants
from operators.sensors import PythonSensor
from operators.signals import SkipTasks

__all__ = ["BranchPythonOperator", "PythonOperator", "PythonSensor", "ShortCircuitOperator"]


class PythonOperator(BaseOperator):
    """Calls ``python_callable(*op_args, **op_kwargs)`` in a worker thread; its return value is
    the task's result. Parameters named like context entries (``ds``, ``logical_date``,
    ``data_interval_start``, ``run_id``, ``params``, ...) receive them; ``**kwargs`` receives
    them all. ``op_args``, ``op_kwargs`` and ``templates_dict`` are templated; the callable
    gets ``templates_dict`` rendered by asking for a parameter of that name."""

    template_fields = ("templates_dict", "op_args", "op_kwargs")

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Sequence[Any] | None = None,
        op_kwargs: Mapping[str, Any] | None = None,
        templates_dict: Mapping[str, Any] | None = None,
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
        self.templates_dict = None if templates_dict is None else dict(templates_dict)

    def execute(self, context: Context) -> Any:
        with_templates: Context = {**context, "templates_dict": self.templates_dict}
        return call_with_context(self.python_callable, self.op_args, self.op_kwargs, with_templates)


class BranchPythonOperator(BranchMixIn, PythonOperator):
    """A ``PythonOperator`` whose callable returns the task id (or list of task ids) to follow,
    or None to follow none: the other tasks directly downstream are skipped, and skipping
    propagates by the trigger rules. Its result is what the callable returned."""

    def execute(self, context: Context) -> Any:
        return self.do_branch(context, super().execute(context))


class ShortCircuitOperator(PythonOperator):
    """Runs the callable; a truthy result lets the downstream tasks run, a falsy one skips
    them. With ``ignore_downstream_trigger_rules=True`` (the default) every task downstream is
    skipped, whatever its trigger rule; with False only the direct downstream tasks are, and
    the tasks after them follow their own trigger rules (a join with ``all_done`` still
    runs). Its result is the callable's."""

    def __init__(self, *, ignore_downstream_trigger_rules: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_downstream_trigger_rules = bool(ignore_downstream_trigger_rules)

    def execute(self, context: Context) -> Any:
        condition = super().execute(context)
        return self.short_circuit(condition)

    def short_circuit(self, condition: Any) -> Any:
        """``condition`` as the result, with the downstream tasks to skip when it is falsy."""
        if condition:
            self.log.info("condition is %r: the downstream tasks run", condition)
            return condition
        if self.ignore_downstream_trigger_rules:
            skip = descendants(self, [self.task_id])
        else:
            skip = set(self.downstream_task_ids)
        self.log.info(
            "condition is %r: skipping %s", condition, ", ".join(sorted(skip)) or "nothing"
        )
        return SkipTasks(condition, skip)
