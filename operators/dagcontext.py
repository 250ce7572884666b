"""The DAG an operator is declared in: the open ``with DAG(...)`` block (a context variable the
runtime's DAG class sets) and its ``default_args``, which fill in the arguments a task did not
pass. Part of the operator contract: imports no runtime (the DAG is read by attribute)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Protocol

__all__ = ["DagLike", "accepted_args", "current_dag", "dag_context", "with_default_args"]


class DagLike(Protocol):
    """What an operator needs of the DAG it is declared in (``engine.DAG`` provides it)."""

    dag_id: str

    def add_task(self, task: Any) -> None: ...


_current_dag: ContextVar[DagLike | None] = ContextVar("deferral_current_dag", default=None)


def current_dag() -> DagLike | None:
    """The DAG whose ``with`` block is open, if any."""
    return _current_dag.get()


def dag_context() -> ContextVar[DagLike | None]:
    """The context variable ``with DAG(...)`` sets; used by the runtime's DAG class."""
    return _current_dag


#: Arguments a DAG's ``default_args`` never set.
_NOT_DEFAULTED = frozenset({"task_id", "dag"})


@functools.lru_cache(maxsize=1024)
def _accepted_args(cls: type) -> frozenset[str]:
    """The keyword arguments an operator class's ``__init__`` chain accepts by name: each
    ``__init__`` up the class tree, for as long as they pass ``**kwargs`` on."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        params = inspect.signature(getattr(init, "__wrapped__", init)).parameters.values()
        names.update(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            break
    return frozenset(names - {"self"} - _NOT_DEFAULTED)


def accepted_args(cls: type) -> frozenset[str]:
    """The keyword arguments ``cls.__init__`` accepts by name, but ``task_id`` and ``dag``
    (what a DAG's ``default_args`` may set; what a mapped task may map)."""
    return _accepted_args(cls)


def with_default_args(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap an operator's ``__init__`` so the DAG's ``default_args`` fill in the arguments the
    caller did not pass (the outermost call only: a subclass calling ``super().__init__``
    passes them on). The DAG is the ``dag=`` argument or the open ``with DAG(...)``; it is
    read by attribute, so this contract imports no runtime."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        if "_passed_args" in self.__dict__:
            init(self, *args, **kwargs)
            return
        # The arguments the task was given itself (``default_args`` do not override them).
        self.__dict__["_passed_args"] = frozenset(kwargs)
        dag = kwargs.get("dag") or current_dag()
        defaults = getattr(dag, "default_args", None)
        if defaults:
            accepted = _accepted_args(type(self))  # type: ignore[arg-type]
            for name, value in defaults.items():
                if name not in kwargs and name in accepted:
                    kwargs[name] = value
        init(self, *args, **kwargs)

    return wrapper
