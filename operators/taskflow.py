"""TaskFlow: plain functions as tasks, and their return values passed as arguments.

``@task`` (bare, or with any ``BaseOperator`` argument: ``task_id``, ``retries``, ``pool``,
``queue``, ...) turns a function into a task factory. Called inside a ``with DAG(...)`` block,
it adds a task and returns an :class:`~operators.xcom.XComArg`, a reference to the task's
return value; a reference passed to another call is replaced by the value when that task runs,
and makes it downstream of the first: ``total(extract())``. A function called twice gets task
ids ``name``, ``name__1``, ``name__2``, ...

``@task(multiple_outputs=True)`` (or a function annotated to return a ``dict``) stores each key
of the returned dict as an XCom of its own too, which ``ref["key"]`` refers to.

A function may take context entries as parameters (``ti``, ``dag_run``, ``logical_date``,
``params``, ``ds``, ...) or ``**context``; :func:`operators.xcom.get_current_context` returns
the context anywhere inside a running task.

``@task.sensor`` makes a sensor of a function returning a bool (or a
:class:`PokeReturnValue`); ``@task.bash`` a ``BashOperator`` of a function returning its
command. This module imports contracts and built-in operators only.
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any, cast

from operators.base import BaseOperator, Context, call_with_context, current_dag
from operators.bash import BashOperator
from operators.python import PythonOperator
from operators.sensors.python import PythonSensor
from operators.xcom import XComArg, find_refs

__all__ = ["PokeReturnValue", "TaskDecorator", "task"]

_SUFFIX = re.compile(r"^(?P<base>.+?)__(?P<n>\d+)$")


class PokeReturnValue:
    """What a ``@task.sensor`` function may return: whether the wait is over, and the value
    the task then returns (its ``return_value`` XCom)."""

    __slots__ = ("is_done", "xcom_value")

    def __init__(self, is_done: bool, xcom_value: Any = None) -> None:
        self.is_done = bool(is_done)
        self.xcom_value = xcom_value

    def __bool__(self) -> bool:
        return self.is_done

    def __repr__(self) -> str:
        return f"PokeReturnValue(is_done={self.is_done}, xcom_value={self.xcom_value!r})"


def _unique_task_id(task_id: str, dag: Any) -> str:
    """``task_id``, or ``task_id__N`` with the next free N when the DAG has it already (as
    Airflow numbers a TaskFlow function called more than once)."""
    tasks: Mapping[str, Any] = getattr(dag, "tasks", None) or {}
    if task_id not in tasks:
        return task_id
    base = task_id
    match = _SUFFIX.match(task_id)
    if match:
        base = match.group("base")
    taken = [
        int(m.group("n"))
        for existing in tasks
        if (m := _SUFFIX.match(existing)) and m.group("base") == base
    ]
    return f"{base}__{max(taken, default=0) + 1}"


def _returns_dict(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is annotated to return a dict (then its keys are XComs of their own)."""
    try:
        hint = typing.get_type_hints(fn).get("return")
    except Exception:  # unresolvable annotations: read the text
        raw = getattr(fn, "__annotations__", {}).get("return")
        text = raw if isinstance(raw, str) else ""
        return bool(re.match(r"^(dict|Dict|typing\.Dict)\b", text.strip()))
    origin = typing.get_origin(hint) or hint
    return isinstance(origin, type) and issubclass(origin, dict)


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
        import asyncio

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


class TaskDecorator:
    """A function turned into a task factory: call it inside a DAG to add a task."""

    def __init__(
        self,
        fn: Callable[..., Any],
        operator_class: type[BaseOperator],
        kwargs: Mapping[str, Any],
        *,
        multiple_outputs: bool | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"@task decorates a function, got {fn!r}")
        if inspect.iscoroutinefunction(fn):
            raise TypeError(
                f"@task cannot decorate the async function {fn.__qualname__}: a TaskFlow "
                "function runs in a worker thread; write an operator with an async execute"
            )
        self.function = fn
        self.operator_class = operator_class
        self.kwargs = dict(kwargs)
        if multiple_outputs is None:
            multiple_outputs = _returns_dict(fn)
        self.multiple_outputs = multiple_outputs
        functools.update_wrapper(self, fn)

    def override(self, **kwargs: Any) -> TaskDecorator:
        """The same function with other operator arguments (``task_id``, ``retries``, ...)."""
        multiple_outputs = kwargs.pop("multiple_outputs", self.multiple_outputs)
        return TaskDecorator(
            self.function,
            self.operator_class,
            {**self.kwargs, **kwargs},
            multiple_outputs=multiple_outputs,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> XComArg:
        dag = self.kwargs.get("dag") or current_dag()
        if dag is None:
            raise RuntimeError(
                f"{self.function.__qualname__}() adds a task: call it inside a "
                "`with DAG(...):` block (or give the decorator dag=...)"
            )
        options = dict(self.kwargs)
        task_id = _unique_task_id(options.pop("task_id", self.function.__name__), dag)
        extra: dict[str, Any] = {}
        if self.operator_class is _PythonDecoratedOperator:
            extra["multiple_outputs"] = self.multiple_outputs
        make = cast(Callable[..., BaseOperator], self.operator_class)
        op = make(
            task_id=task_id,
            python_callable=self.function,
            op_args=list(args),
            op_kwargs=kwargs,
            **extra,
            **options,
        )
        for ref in find_refs([args, kwargs]):
            op.set_upstream(ref.operator)
        return XComArg(op)

    def __repr__(self) -> str:
        return f"<task {self.function.__qualname__}>"


def _decorator(
    operator_class: type[BaseOperator],
    fn: Callable[..., Any] | None,
    kwargs: dict[str, Any],
) -> Any:
    multiple_outputs = kwargs.pop("multiple_outputs", None)

    def wrap(f: Callable[..., Any]) -> TaskDecorator:
        return TaskDecorator(f, operator_class, kwargs, multiple_outputs=multiple_outputs)

    return wrap if fn is None else wrap(fn)


class _Task:
    """``task``: ``@task``, ``@task(...)``, ``@task.python``, ``@task.sensor``, ``@task.bash``."""

    def __call__(self, python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """``@task`` or ``@task(task_id=..., retries=..., multiple_outputs=..., ...)``."""
        return _decorator(_PythonDecoratedOperator, python_callable, kwargs)

    def python(self, python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """The same as ``@task``."""
        return _decorator(_PythonDecoratedOperator, python_callable, kwargs)

    def sensor(self, python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """A sensor of a function returning a bool or a :class:`PokeReturnValue`:
        ``poke_interval``, ``timeout``, ``mode`` (``poke``/``reschedule``), ``soft_fail``,
        ``exponential_backoff``; ``deferrable=True`` with ``async_check``, the import path of
        an ``async def`` the triggerer awaits with the call's keyword arguments."""
        if kwargs.get("multiple_outputs"):
            raise TypeError("@task.sensor does not take multiple_outputs")
        return _decorator(_DecoratedSensor, python_callable, kwargs)

    def bash(self, python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """A ``BashOperator`` whose command the function returns (``env``, ``cwd``,
        ``skip_on_exit_code``, ... as BashOperator's); its result is the output's last line."""
        if kwargs.get("multiple_outputs"):
            raise TypeError("@task.bash does not take multiple_outputs")
        return _decorator(_DecoratedBash, python_callable, kwargs)


#: The TaskFlow decorator (``from engine import task``).
task = cast(Any, _Task())
