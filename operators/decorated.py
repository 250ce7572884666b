"""The operators TaskFlow's decorators make (operators/taskflow.py), built on the built-in
ones: imported when a decorated function is first called in a DAG."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from operators.base import BaseOperator, Context, call_with_context
from operators.bash import BashOperator
from operators.python import BranchPythonOperator, PythonOperator, ShortCircuitOperator
from operators.sensors.python import PythonSensor
from operators.xcom import PokeReturnValue

__all__ = ["OPERATORS"]


def _store_outputs(context: Context, result: Any, task_id: str) -> None:
    """Push each key of a ``multiple_outputs`` task's returned dict as an XCom of its own."""
    if result is None:
        return
    if not isinstance(result, dict) or not all(isinstance(k, str) for k in result):
        raise TypeError(
            f"task {task_id} has multiple_outputs, so it must return a dict with str keys, "
            f"got {type(result).__name__}"
        )
    ti = context["ti"]
    for key, value in result.items():
        ti.xcom_push(key, value)


class _PythonDecoratedOperator(PythonOperator):
    """The task a ``@task`` function makes: its call, with references resolved."""

    def __init__(self, *, multiple_outputs: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.multiple_outputs = multiple_outputs

    def execute(self, context: Context) -> Any:
        result = call_with_context(self.python_callable, self.op_args, self.op_kwargs, context)
        if self.multiple_outputs:
            _store_outputs(context, result, self.task_id)
        return result


class _DecoratedSensor(PythonSensor):
    """The sensor a ``@task.sensor`` function makes: done when it returns something truthy
    (a :class:`PokeReturnValue`'s ``is_done``); then its result (the ``xcom_value``)."""

    def poke(self, context: Context) -> Any:
        result = call_with_context(self.python_callable, self.op_args, self.op_kwargs, context)
        if isinstance(result, PokeReturnValue):
            return _Done(result.xcom_value) if result.is_done else False
        return result

    def execute(self, context: Context) -> Any:
        result = super().execute(context)
        return result.value if isinstance(result, _Done) else result


class _Done:
    """A finished poke whose value (perhaps None or falsy) is the sensor's result."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


#: What a ``@task.bash`` task's command is until its function has run.
_COMMAND_PENDING = "(the command the task's function returns)"


class _DecoratedBash(BashOperator):
    """The ``BashOperator`` a ``@task.bash`` function makes: the function (run in a worker
    thread) returns the command."""

    def __init__(
        self,
        *,
        python_callable: Callable[..., Any],
        op_args: Any = (),
        op_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(bash_command=_COMMAND_PENDING, **kwargs)
        self.python_callable = python_callable
        self.op_args = list(op_args or ())
        self.op_kwargs = dict(op_kwargs or {})

    template_fields = ("op_args", "op_kwargs", "env")  # type: ignore[assignment]

    async def execute(self, context: Context) -> str | None:
        command = await asyncio.to_thread(
            call_with_context, self.python_callable, self.op_args, self.op_kwargs, context
        )
        if not isinstance(command, str) or not command.strip():
            raise TypeError(
                f"task {self.task_id}: a @task.bash function must return the command as a "
                f"non-empty str, got {command!r}"
            )
        self.bash_command = command
        return await super().execute(context)


#: The operator each kind of decorator makes.
OPERATORS: dict[str, type[BaseOperator]] = {
    "python": _PythonDecoratedOperator,
    "sensor": _DecoratedSensor,
    "bash": _DecoratedBash,
    "branch": BranchPythonOperator,
    "short_circuit": ShortCircuitOperator,
}
