"""References to XComs while a DAG is declared, and the running task's context.

:class:`XComArg` is what a TaskFlow call returns and what ``op.output`` is: a reference to a
task's XCom (its return value unless a key is given) that the worker replaces by the value
when a task that holds it runs. Passing one to a TaskFlow call, or setting it in a classic
operator's templated field, makes the task that holds it downstream of the one it refers to.
``>>`` and ``<<`` work on references as on their tasks.

:func:`get_current_context` returns the context of the task running in this thread or task
(the worker sets it around every call of ``execute`` and of a resumed method).

This module imports contracts only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

__all__ = [
    "RETURN_KEY",
    "PokeReturnValue",
    "XComArg",
    "XComError",
    "current_context",
    "find_refs",
    "get_current_context",
    "replace_refs",
]

#: The key of a task's return value.
RETURN_KEY = "return_value"


class XComError(Exception):
    """A value a task returned or pushed cannot be stored as an XCom (its type, or its size
    past the setting ``xcom_max_bytes``): it fails the task without retries (the same value
    would be refused again)."""


# (Typed loosely: this module imports nothing of operators.base, which imports it.)
_current: ContextVar[Any] = ContextVar("deferral_current_context", default=None)


def get_current_context() -> Any:
    """The context of the task running here: the same mapping ``execute`` receives. Outside a
    running task, a RuntimeError."""
    context = _current.get()
    if context is None:
        raise RuntimeError(
            "get_current_context() was called outside a running task: call it from inside a "
            "task's function (or execute), while it runs on a worker"
        )
    return context


@contextmanager
def current_context(context: Any) -> Iterator[Any]:
    """Make ``context`` what :func:`get_current_context` returns while the block runs (and in
    the threads the block starts with the context copied, as anyio's do)."""
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


class XComArg:
    """A reference to ``operator``'s XCom under ``key``; resolved to the value at run time."""

    __slots__ = ("key", "operator")

    def __init__(self, operator: Any, key: str = RETURN_KEY) -> None:
        self.operator = operator
        self.key = key

    @property
    def task_id(self) -> str:
        return str(self.operator.task_id)

    def __getitem__(self, key: str) -> XComArg:
        """The XCom ``key`` of the same task (a ``multiple_outputs`` task stores each key of
        its returned dict as an XCom of its own)."""
        if not isinstance(key, str):
            raise TypeError(f"an XCom key is a str, got {key!r}")
        return XComArg(self.operator, key)

    # (References are immutable: an operator's copy shares them.)
    def __copy__(self) -> XComArg:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> XComArg:
        return self

    def __iter__(self) -> Iterator[Any]:
        raise TypeError(
            f"the XCom of task {self.task_id} is known only when it runs: it cannot be iterated "
            "while the DAG is declared (pass it to a task instead)"
        )

    def __bool__(self) -> bool:
        return True

    # -- the graph: as the task it refers to ----------------------------------------------

    def set_downstream(self, other: Any) -> None:
        self.operator.set_downstream(other)

    def set_upstream(self, other: Any) -> None:
        self.operator.set_upstream(other)

    def __rshift__(self, other: Any) -> Any:
        self.operator.set_downstream(other)
        return other

    def __lshift__(self, other: Any) -> Any:
        self.operator.set_upstream(other)
        return other

    def __rrshift__(self, other: Any) -> XComArg:
        self.operator.set_upstream(other)
        return self

    def __rlshift__(self, other: Any) -> XComArg:
        self.operator.set_downstream(other)
        return self

    def __repr__(self) -> str:
        if self.key == RETURN_KEY:
            return f"XComArg({self.task_id})"
        return f"XComArg({self.task_id}, {self.key!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, XComArg) and other.operator is self.operator and other.key == self.key
        )

    def __hash__(self) -> int:
        return hash((id(self.operator), self.key))


def find_refs(value: Any) -> list[XComArg]:
    """The references ``value`` holds, nested in lists, tuples, sets and dict values too."""
    found: list[XComArg] = []
    _walk(value, found)
    return found


def _walk(value: Any, found: list[XComArg]) -> None:
    if isinstance(value, XComArg):
        found.append(value)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            _walk(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _walk(item, found)


def replace_refs(value: Any, values: dict[tuple[str, str], Any]) -> Any:
    """``value`` with each reference replaced by ``values[(task_id, key)]``."""
    if isinstance(value, XComArg):
        return values[(value.task_id, value.key)]
    if isinstance(value, list):
        return [replace_refs(v, values) for v in value]
    if isinstance(value, tuple):
        items = [replace_refs(v, values) for v in value]
        return type(value)._make(items) if hasattr(value, "_make") else tuple(items)
    if isinstance(value, set | frozenset):
        return type(value)(replace_refs(v, values) for v in value)
    if isinstance(value, dict):
        return {k: replace_refs(v, values) for k, v in value.items()}
    return value


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
