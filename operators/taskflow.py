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
command; ``@task.branch`` and ``@task.short_circuit`` the branching operators of
:mod:`operators.python`. This module imports contracts only; the operators the decorators make
(:mod:`operators.decorated`, built on the built-in ones) are imported when one is used, so
``from engine import task`` costs no sensor's imports.
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any, cast

from operators.base import BaseOperator, OperatorPartial, current_dag
from operators.xcom import PokeReturnValue, XComArg, find_refs

__all__ = ["PokeReturnValue", "TaskDecorator", "TaskFlowPartial", "task"]

_SUFFIX = re.compile(r"^(?P<base>.+?)__(?P<n>\d+)$")


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


class TaskDecorator:
    """A function turned into a task factory: call it inside a DAG to add a task."""

    def __init__(
        self,
        fn: Callable[..., Any],
        kind: str,
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
        #: Which operator a call makes: a key of operators.decorated.OPERATORS.
        self.kind = kind
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
            self.kind,
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
        from operators.decorated import OPERATORS

        extra: dict[str, Any] = {}
        if self.kind == "python":
            extra["multiple_outputs"] = self.multiple_outputs
        make = cast(Callable[..., BaseOperator], OPERATORS[self.kind])
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

    # -- dynamic mapping -------------------------------------------------------------------

    def partial(self, **kwargs: Any) -> TaskFlowPartial:
        """Arguments every instance of the mapped task gets: ``.expand(x=...)`` then maps the
        others."""
        return TaskFlowPartial(self, kwargs)

    def expand(self, **mapped: Any) -> XComArg:
        """One task instance per value of each argument (per combination, for several):
        ``fn.expand(x=upstream())``. Its reference is the list of the instances' values."""
        return TaskFlowPartial(self, {}).expand(**mapped)

    def expand_kwargs(self, value: Any) -> XComArg:
        """One task instance per dict of arguments (a list, or a reference to one)."""
        return TaskFlowPartial(self, {}).expand_kwargs(value)

    def __repr__(self) -> str:
        return f"<task {self.function.__qualname__}>"


class TaskFlowPartial:
    """``fn.partial(**fixed)``: a TaskFlow function's shared arguments, waiting for
    ``.expand(...)`` or ``.expand_kwargs(...)``."""

    def __init__(self, decorator: TaskDecorator, fixed: Mapping[str, Any]) -> None:
        self.decorator = decorator
        self.fixed = dict(fixed)

    def _partial(self, names: list[str]) -> Any:
        from operators.decorated import OPERATORS

        deco = self.decorator
        dag = deco.kwargs.get("dag") or current_dag()
        if dag is None:
            raise RuntimeError(
                f"{deco.function.__qualname__}.expand() adds a task: call it inside a "
                "`with DAG(...):` block (or give the decorator dag=...)"
            )
        _check_params(deco.function, [*self.fixed, *names])
        both = sorted(set(self.fixed) & set(names))
        if both:
            raise TypeError(
                f"{deco.function.__qualname__}: {', '.join(both)} given to both partial() and "
                "expand()"
            )
        options = dict(deco.kwargs)
        task_id = _unique_task_id(options.pop("task_id", deco.function.__name__), dag)
        extra: dict[str, Any] = {}
        if deco.kind == "python":
            extra["multiple_outputs"] = deco.multiple_outputs
        kwargs = {
            "task_id": task_id,
            "python_callable": deco.function,
            "op_args": [],
            "op_kwargs": self.fixed,
            **extra,
            **options,
        }
        return OperatorPartial(OPERATORS[deco.kind], kwargs, mapped_into="op_kwargs")

    def expand(self, **mapped: Any) -> XComArg:
        """One task instance per value (per combination, for several arguments)."""
        return XComArg(self._partial(list(mapped)).expand(**mapped))

    def expand_kwargs(self, value: Any) -> XComArg:
        """One task instance per dict of arguments."""
        names = (
            [k for item in value if isinstance(item, dict) for k in item]
            if isinstance(value, list | tuple)
            else []
        )
        return XComArg(self._partial(names).expand_kwargs(value))


def _check_params(fn: Callable[..., Any], names: list[str]) -> None:
    """Each of ``names`` is a parameter of ``fn`` (or ``fn`` takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [n for n in names if n not in params]
    if unknown:
        raise TypeError(
            f"{fn.__qualname__}() has no parameter {', '.join(map(repr, unknown))} to give "
            "to partial() or expand()"
        )


def _decorator(
    kind: str,
    fn: Callable[..., Any] | None,
    kwargs: dict[str, Any],
) -> Any:
    multiple_outputs = kwargs.pop("multiple_outputs", None)

    def wrap(f: Callable[..., Any]) -> TaskDecorator:
        return TaskDecorator(f, kind, kwargs, multiple_outputs=multiple_outputs)

    return wrap if fn is None else wrap(fn)


class _Task:
    """``task``: ``@task``, ``@task(...)``, ``@task.python``, ``@task.sensor``, ``@task.bash``,
    ``@task.branch``, ``@task.short_circuit``."""

    def __call__(self, python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """``@task`` or ``@task(task_id=..., retries=..., multiple_outputs=..., ...)``."""
        return _decorator("python", python_callable, kwargs)

    def python(self, python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """The same as ``@task``."""
        return _decorator("python", python_callable, kwargs)

    def sensor(self, python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """A sensor of a function returning a bool or a :class:`PokeReturnValue`:
        ``poke_interval``, ``timeout``, ``mode`` (``poke``/``reschedule``), ``soft_fail``,
        ``exponential_backoff``; ``deferrable=True`` with ``async_check``, the import path of
        an ``async def`` the triggerer awaits with the call's keyword arguments."""
        if kwargs.get("multiple_outputs"):
            raise TypeError("@task.sensor does not take multiple_outputs")
        return _decorator("sensor", python_callable, kwargs)

    def bash(self, python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """A ``BashOperator`` whose command the function returns (``env``, ``cwd``,
        ``skip_on_exit_code``, ... as BashOperator's); its result is the output's last line."""
        if kwargs.get("multiple_outputs"):
            raise TypeError("@task.bash does not take multiple_outputs")
        return _decorator("bash", python_callable, kwargs)

    def branch(self, python_callable: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """A ``BranchPythonOperator``: the function returns the task id (or list of task ids)
        to follow, or None; the other tasks directly downstream are skipped."""
        if kwargs.get("multiple_outputs"):
            raise TypeError("@task.branch does not take multiple_outputs")
        return _decorator("branch", python_callable, kwargs)

    def short_circuit(
        self, python_callable: Callable[..., Any] | None = None, **kwargs: Any
    ) -> Any:
        """A ``ShortCircuitOperator``: a falsy return value skips the downstream tasks
        (``ignore_downstream_trigger_rules``, default True: all of them; False: the direct
        ones, the others by their trigger rules)."""
        if kwargs.get("multiple_outputs"):
            raise TypeError("@task.short_circuit does not take multiple_outputs")
        return _decorator("short_circuit", python_callable, kwargs)


#: The TaskFlow decorator (``from engine import task``).
task = cast(Any, _Task())
