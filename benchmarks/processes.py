"""The processes a benchmark starts, and how they end when the benchmark ends, however it ends.

* :class:`Fleet` starts engine processes (``python -m engine <kind>``) supervised
  (``engine.launch.app.start_child``): each in a session of its own, so that a terminal's
  Ctrl-C reaches the benchmark alone, which then stops them in order; and each watching a
  pipe the benchmark holds, so that a benchmark that dies without stopping them (SIGKILL,
  the machine's OOM killer) still leaves none running: its end of the pipe closes, and each
  child stops gracefully by itself (releasing its triggers and its slot's tasks, which a
  SIGKILL sent to it would not). The pipe was chosen over Linux's ``PR_SET_PDEATHSIG``: it
  is the engine's own supervision (``deferral standalone``), works on every platform, stops
  the child gracefully, and does not fire when the thread that started the child ends.
* :func:`ended_with_children` wraps a whole ``deferral bench`` command (``benchmarks/cli.py``):
  SIGTERM is handled as Ctrl-C is (a ``KeyboardInterrupt``, or, in ``asyncio.run``, a cancel
  of the main task), so the benchmark's own ``finally`` blocks run (its engine processes
  stopped, its database dropped); then every child still alive is stopped (asked, given
  :data:`STOP_GRACE_S`, then killed), also when the benchmark fails with an exception. A
  stopped benchmark says so and exits with 128 + the signal's number.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import click

from engine.launch.app import Child, start_child, stop_children

__all__ = ["STOP_GRACE_S", "Fleet", "ended_with_children", "stop_all"]

#: How long a child gets to stop before it is killed.
STOP_GRACE_S = 20.0

#: Every child a benchmark of this process started (reaped ones included).
_started: list[Child] = []
#: The signals that asked this process to stop (SIGTERM is turned into SIGINT's handling).
_received: list[int] = []


class Fleet:
    """The engine's processes of one run, each logging to a file of its own."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder = folder
        self.env = env
        self.procs: dict[str, Child] = {}

    def spawn(self, name: str, *args: str) -> Child:
        with (self.folder / f"{name}.log").open("ab") as log:
            proc = start_child(args, self.env, stdout=log, stderr=log)
        _started.append(proc)
        self.procs[name] = proc
        return proc

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.poll() is None]

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Ask each process to stop, wait up to ``grace_s``, kill what is left."""
        stop_children(list(self.procs.values()), grace_s)


def stop_all(grace_s: float = STOP_GRACE_S) -> None:
    """Stop every child still alive that a benchmark of this process started."""
    stop_children([child for child in _started if child.poll() is None], grace_s)


def _as_sigint(signum: int, frame: FrameType | None) -> None:
    """SIGTERM does what SIGINT does at this moment: asyncio.run's handler cancels the main
    task (a second one raises KeyboardInterrupt), Python's default raises KeyboardInterrupt."""
    _received.append(signum)
    handler: Any = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt


def _kill_now(signum: int, frame: FrameType | None) -> None:
    """Another signal while the children stop: kill them at once (the stop goes on)."""
    for child in _started:
        if child.poll() is None:
            child.kill()


@contextlib.contextmanager
def ended_with_children(grace_s: float = STOP_GRACE_S) -> Iterator[None]:
    """Run a benchmark: see the module's docstring. (In a
    thread other than the main one, where no signal handler can be set, only the children
    still alive at the end are stopped.)"""
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    if main:
        signal.signal(signal.SIGTERM, _as_sigint)
    _received.clear()
    # (a benchmark run before in this process stopped all of its children as it ended)
    _started.clear()
    try:
        yield
    except KeyboardInterrupt:
        if main:
            signal.signal(signal.SIGINT, _kill_now)
            signal.signal(signal.SIGTERM, _kill_now)
        stop_all(grace_s)
        signum = _received[0] if _received else signal.SIGINT
        count = len(_started)
        click.echo(
            f"deferral bench: stopped by {signal.Signals(signum).name}; "
            + (
                f"the {count} engine process(es) it started have ended"
                if count
                else "it had started no engine process"
            ),
            err=True,
        )
        raise SystemExit(128 + signum) from None
    finally:
        stop_all(grace_s)
        if main:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
