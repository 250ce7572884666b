"""A trigger and an operator that log, for tests/test_logs.py."""

from __future__ import annotations

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
