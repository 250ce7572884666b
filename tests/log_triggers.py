"""Triggers and operators that log and print, for tests/test_logs.py and
tests/test_stored_logs.py (importable by triggerer processes)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from operators.base import BaseOperator, Context
from triggers.base import BaseTrigger, TriggerEvent


class ChattyTrigger(BaseTrigger):
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.log_triggers.ChattyTrigger", {"tag": self.tag})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        self.log.info("hello from the trigger %s", self.tag)
        yield TriggerEvent(self.tag)


class ChattyOperator(BaseOperator):
    def execute(self, context: Context) -> None:
        self.log.info("hello from execute")
        self.defer(trigger=ChattyTrigger(self.task_id), method_name="done")

    def done(self, context: Context, event: Any) -> Any:
        self.log.info("hello from the resumed method")
        return event


class TickingTrigger(BaseTrigger):
    """Logs a line every 50 ms while it waits for the file ``flag``; logs once more, then
    fires, once the file exists."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.log_triggers.TickingTrigger", {"flag": self.flag})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        tick = 0
        # Another process creates the file: polling is the only way to see it.
        while not os.path.exists(self.flag):  # noqa: ASYNC240
            tick += 1
            self.log.info("tick %d: still waiting", tick)
            await asyncio.sleep(0.05)
        self.log.warning("the flag is there after %d ticks: firing", tick)
        yield TriggerEvent(tick)


class LogOnceThenWait(BaseTrigger):
    """Logs one line, then waits forever (many of these fill a triggerer)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.log_triggers.LogOnceThenWait", {"index": self.index})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        self.log.info("waiting number %d", self.index)
        await asyncio.Event().wait()
        yield TriggerEvent(None)  # pragma: no cover - never reached


class WaitForFlag(BaseOperator):
    """Defers on a :class:`TickingTrigger`; returns the event when resumed."""

    def __init__(self, *, flag: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.flag = flag

    def execute(self, context: Context) -> None:
        self.defer(trigger=TickingTrigger(self.flag), method_name="done")

    def done(self, context: Context, event: Any) -> Any:
        return event


class FailsOnceThenSucceeds(BaseOperator):
    """Prints and logs, with the try number in each line; try 1 raises, later tries return.
    With ``flag``: the first try waits (in its thread) for that file first."""

    def __init__(self, *, flag: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.flag = flag

    def execute(self, context: Context) -> str:
        number = context["try_number"]
        print(f"printed on try {number}")
        print(f"to stderr on try {number}", file=sys.stderr)
        self.log.info("logged on try %d", number)
        if self.flag is not None:
            while not os.path.exists(self.flag):
                time.sleep(0.01)  # a task's own wait, in its worker thread
            self.log.info("the flag is there on try %d", number)
        if number == 1:
            raise RuntimeError("try 1 fails on purpose")
        return f"done on try {number}"


class KeyedTrigger(BaseTrigger):
    """Logs a line, then fires at once with an event that holds a secret under a key name."""

    def __init__(self, tag: str, password: str) -> None:
        self.tag = tag
        self.password = password

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.log_triggers.KeyedTrigger", {"tag": self.tag, "password": self.password})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        self.log.warning("checking %s", self.tag)
        yield TriggerEvent({"tag": self.tag, "api_key": self.password})


class KeyedOperator(BaseOperator):
    """Defers on a :class:`KeyedTrigger` with a timeout; returns the event's tag."""

    def execute(self, context: Context) -> None:
        self.defer(
            trigger=KeyedTrigger(self.task_id, "hunter2-s3cr3t"),
            method_name="done",
            timeout=600,
        )

    def done(self, context: Context, event: Any) -> Any:
        return event["tag"]
