"""Run engine components in one process: uvloop, one task group, a two-stage stop.

The first SIGTERM or SIGINT asks every component to stop gracefully (finish or release
work); a second one cancels them. A component that holds no work to finish (the scheduler:
``stops_at_once``) stops at once on the first, and the log line says so.

A process started by a supervisor (``deferral standalone``, ``engine.launch.app.spawn``) is also
told to stop through a pipe the supervisor holds (its read end's number is in the environment
variable ``DEFERRAL_SUPERVISOR_FD``): one byte ``STOP`` or ``CANCEL`` names the *stage* to
reach. While it has a supervisor, a signal only asks a process to stop gracefully: the
supervisor counts the requests, so one that arrives twice, by signal and by pipe (systemd
signals every process of a unit, and the supervisor forwards its own), is one. The pipe
closing (the supervisor died) asks for a graceful stop, so no child outlives its supervisor
with work held; signals count again from then on.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, Protocol, TypeVar

import anyio
from anyio import CancelScope
from anyio.abc import TaskStatus

__all__ = [
    "CANCEL",
    "STOP",
    "SUPERVISOR_FD_ENV",
    "Component",
    "exit_without_threads",
    "run_async",
    "serve",
    "stops_at_once",
    "supervisor_fd",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The environment variable that names the supervisor's pipe (a file descriptor number).
SUPERVISOR_FD_ENV = "DEFERRAL_SUPERVISOR_FD"
#: Bytes a supervisor writes: reach the graceful stage, reach the cancelling stage.
STOP = b"1"
CANCEL = b"2"

_GRACEFUL = 1
_CANCELLING = 2


class Component(Protocol):
    async def run(self, *, task_status: TaskStatus[None] = ...) -> None: ...

    def stop(self) -> None: ...


def stops_at_once(component: Component) -> bool:
    """True when the component's ``stop()`` ends its work at once instead of letting it finish
    (it says so with a true ``stops_at_once`` attribute: the scheduler, which holds no work):
    a second request then has nothing left to cancel."""
    return bool(getattr(component, "stops_at_once", False))


def supervisor_fd() -> int | None:
    """The supervisor's pipe handed to this process, if any. Taken out of the environment and
    made non-inheritable, so that processes this one starts (tasks) neither see nor hold it."""
    raw = os.environ.pop(SUPERVISOR_FD_ENV, None)
    if not raw:
        return None
    try:
        fd = int(raw)
        os.set_inheritable(fd, False)
    except (ValueError, OSError) as exc:
        log.warning("ignoring %s=%r: %s", SUPERVISOR_FD_ENV, raw, exc)
        return None
    return fd


class _Stages:
    """The stop stages of one process: 0 running, 1 stopping gracefully, 2 cancelling. (Log
    lines name the process: engine.runtime.logs.)"""

    def __init__(self, components: Sequence[Component], scope: CancelScope) -> None:
        self.components = components
        self.scope = scope
        self.stage = 0

    def reach(self, stage: int, why: str) -> None:
        if stage <= self.stage:
            return
        if self.stage == 0:
            if all(map(stops_at_once, self.components)):
                log.info("%s: stopping at once (no work to let finish)", why)
            else:
                log.info("%s: stopping gracefully (again to cancel)", why)
            for component in self.components:
                component.stop()
        if stage >= _CANCELLING:
            log.warning("%s: cancelling", why)
            self.scope.cancel()
        self.stage = stage


async def serve(components: Sequence[Component], *, supervisor: int | None = None) -> bool:
    """Run components until they all return; signals (and the ``supervisor`` pipe, a file
    descriptor) stop them. True when they were cancelled (a second request)."""
    async with anyio.create_task_group() as tg:
        stages = _Stages(components, tg.cancel_scope)
        supervised = supervisor is not None

        async def watch_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if supervised:
                        # Its supervisor counts the requests (and forwards a cancel); a signal
                        # sent to the whole unit reaches this process as well as the supervisor.
                        if stages.stage:
                            log.info("%s: already stopping (its supervisor cancels)", name)
                        stages.reach(_GRACEFUL, name)
                    else:
                        again = f"{name} again" if stages.stage else name
                        stages.reach(stages.stage + 1, again)

        async def watch_supervisor(fd: int) -> None:
            nonlocal supervised
            parent = f"asked by its supervisor (pid {os.getppid()})"
            while True:
                await anyio.wait_readable(fd)
                try:
                    data = os.read(fd, 64)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    data = b""
                    log.warning("cannot read the supervisor's pipe: %s", exc)
                if not data:
                    supervised = False  # signals count from now on
                    stages.reach(_GRACEFUL, "its supervisor is gone")
                    return
                stages.reach(_CANCELLING if CANCEL in data else _GRACEFUL, parent)

        tg.start_soon(watch_signals)
        if supervisor is not None:
            tg.start_soon(watch_supervisor, supervisor)
        async with anyio.create_task_group() as inner:
            for component in components:
                await inner.start(component.run)
        tg.cancel_scope.cancel()
    return stages.stage >= _CANCELLING


def exit_without_threads(code: int = 0) -> NoReturn:
    """After a cancel: end the process now rather than when the threads of tasks still
    running end (Python waits for them at exit; those tasks are reaped and retried). Exit
    handlers run, and the log is flushed, as at a normal exit."""
    log.warning("cancelled: exiting without waiting for the threads of running tasks")
    atexit._run_exitfuncs()
    logging.shutdown()
    os._exit(code)


def run_async(fn: Callable[..., Awaitable[T]], *args: Any, loop: str = "uvloop") -> T:
    """Run a coroutine function on uvloop (or plain asyncio with ``loop="asyncio"``)."""
    return anyio.run(fn, *args, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})
