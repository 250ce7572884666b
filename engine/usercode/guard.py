"""User code on the engine's event loops: what it raises ends its own task, never the process.

asyncio re-raises a ``SystemExit`` or ``KeyboardInterrupt`` that escapes a task out of the
event loop itself. The engine catches both where it calls user code (a trigger's ``run()``,
an ``async def execute``), but user code may start tasks of its own (``asyncio.gather``,
``create_task``, a task group), and one of those raising ``SystemExit`` would end the worker or
the triggerer. :func:`install` sets a task factory on the loop that wraps the coroutine of
every task started *from user code* (marked by :func:`enter_user_code`, a context variable
that tasks inherit) so that such an exception becomes a ``RuntimeError`` of that task, which
the user code awaiting it then sees as an ordinary error. Tasks the engine starts itself are
not wrapped (no cost per trigger). A ``SystemExit`` raised by a plain callback
(``loop.call_soon``) is not covered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import Any, TypeVar

__all__ = ["enter_user_code", "install"]

T = TypeVar("T")

_in_user_code: ContextVar[bool] = ContextVar("deferral_in_user_code", default=False)


def enter_user_code() -> None:
    """Mark the current task (and every task it starts) as running user code."""
    _in_user_code.set(True)


async def _contained(coro: Awaitable[T]) -> T:
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as exc:
        raise RuntimeError(
            f"a task started by user code raised {type(exc).__name__}: {exc}"
        ) from exc


class _Factory:
    """The task factory: wraps user code's tasks, defers to any factory set before."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(
        self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any
    ) -> asyncio.Future[Any]:
        if _in_user_code.get():
            coro = _contained(coro)
        if self.previous is not None:
            return self.previous(loop, coro, **kwargs)  # type: ignore[no-any-return]
        return asyncio.Task(coro, loop=loop, **kwargs)


def install(loop: asyncio.AbstractEventLoop) -> None:
    """Set the factory on ``loop`` (once: components sharing a loop install it once)."""
    current = loop.get_task_factory()
    if not isinstance(current, _Factory):
        loop.set_task_factory(_Factory(current))
