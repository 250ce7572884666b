"""Run engine components in one process: uvloop, one task group, a two-stage stop.

The first SIGTERM or SIGINT asks every component to stop gracefully (finish or release
work); a second one cancels them.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import anyio
from anyio.abc import TaskStatus

__all__ = ["Component", "run_async", "serve"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Component(Protocol):
    async def run(self, *, task_status: TaskStatus[None] = ...) -> None: ...

    def stop(self) -> None: ...


async def serve(components: Sequence[Component]) -> None:
    """Run components until they all return; signals stop them."""
    async with anyio.create_task_group() as tg:

        async def watch_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                count = 0
                async for signum in signals:
                    count += 1
                    if count == 1:
                        log.info(
                            "%s: stopping gracefully (again to cancel)", signal.Signals(signum).name
                        )
                        for component in components:
                            component.stop()
                    else:
                        log.warning("%s again: cancelling", signal.Signals(signum).name)
                        tg.cancel_scope.cancel()
                        return

        tg.start_soon(watch_signals)
        async with anyio.create_task_group() as inner:
            for component in components:
                await inner.start(component.run)
        tg.cancel_scope.cancel()


def run_async(fn: Callable[..., Awaitable[T]], *args: Any, loop: str = "uvloop") -> T:
    """Run a coroutine function on uvloop (or plain asyncio with ``loop="asyncio"``)."""
    return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})
