"""Triggers and an operator for the triggerer tests, importable by triggerer processes.

Nothing here waits on time: a :class:`FlagTrigger` fires when the test creates a file, and
journals every start of its ``run()`` (with the process id) so tests can see which triggerer
ran what, and how often.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from operators.base import BaseOperator, Context
from triggers.base import BaseTrigger, TriggerEvent

MODULE = "tests.triggerer_support"


def journal(path: str | None, line: str) -> None:
    """Append one line with one O_APPEND write: safe across processes."""
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def read_journal(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line]


class FlagTrigger(BaseTrigger):
    """Fires once the file ``flag`` exists; the event names the key and the process."""

    def __init__(self, flag: str, key: str, journal: str | None = None) -> None:
        self.flag = flag
        self.key = key
        self.journal = journal

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{MODULE}.FlagTrigger", {
            "flag": self.flag,
            "key": self.key,
            "journal": self.journal,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        journal(self.journal, f"start {self.key} {os.getpid()}")
        # Another process creates the file: polling is the only way to see it (a stat is cheap).
        while not os.path.exists(self.flag):  # noqa: ASYNC110, ASYNC240
            await asyncio.sleep(0.01)
        yield TriggerEvent({"key": self.key, "pid": os.getpid()})


class BlockingTrigger(BaseTrigger):
    """Blocks the event loop ``times`` times (forever with 0) for ``block_s``, then waits."""

    def __init__(self, block_s: float, times: int = 1) -> None:
        self.block_s = block_s
        self.times = times

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{MODULE}.BlockingTrigger", {"block_s": self.block_s, "times": self.times}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        done = 0
        while self.times == 0 or done < self.times:
            time.sleep(self.block_s)  # noqa: ASYNC251 - the bug this trigger stands for
            done += 1
            await asyncio.sleep(0.05)
        await asyncio.Event().wait()
        yield TriggerEvent(None)  # pragma: no cover - never reached


class RaisingTrigger(BaseTrigger):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{MODULE}.RaisingTrigger", {}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        raise RuntimeError("the remote service said no")
        yield TriggerEvent(None)  # pragma: no cover


class SilentTrigger(BaseTrigger):
    """Returns without yielding an event."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{MODULE}.SilentTrigger", {}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        return
        yield TriggerEvent(None)  # pragma: no cover


class HangingCleanupTrigger(BaseTrigger):
    """Fires at once, then hangs in ``cleanup()``."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{MODULE}.HangingCleanupTrigger", {}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent("fired before a hanging cleanup")

    async def cleanup(self) -> None:
        await asyncio.Event().wait()


class WaitOn(BaseOperator):
    """Defers on ``trigger`` (a class name here and its kwargs); the resumed method journals
    the task instance and returns the event."""

    def __init__(
        self,
        *,
        trigger: str,
        trigger_kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        soft_fail: bool = False,
        resumed_journal: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.trigger = trigger
        self.trigger_kwargs = trigger_kwargs or {}
        self.timeout = timeout
        self.soft_fail = soft_fail
        self.resumed_journal = resumed_journal

    async def execute(self, context: Context) -> None:
        cls = getattr(importlib.import_module(MODULE), self.trigger)
        self.defer(trigger=cls(**self.trigger_kwargs), method_name="resumed", timeout=self.timeout)

    async def resumed(self, context: Context, event: Any) -> Any:
        journal(self.resumed_journal, f"resumed {context['ti_id']} {os.getpid()}")
        return event
