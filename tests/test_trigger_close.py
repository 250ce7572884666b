"""Closing a trigger after its event (TriggerRunner._close): its generator is closed and its
cleanup runs to the end, whether or not they wait for something; one that waits past the
cleanup timeout is abandoned; a cancellation of the triggerer's own reaches the code that
waits. (Most triggers close without waiting: that path takes no timer, issue 21.)"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine.triggerer.held import Held
from engine.triggerer.running import TriggerRunner
from triggers.base import BaseTrigger, TriggerEvent

pytestmark = pytest.mark.anyio


class Recording(BaseTrigger):
    """Yields one event; its generator's ``finally`` and its cleanup wait ``waits`` times on
    ``gate`` (none: they wait for nothing) and record that they ran to the end."""

    def __init__(self, gate: asyncio.Event | None = None, waits: int = 0) -> None:
        self.gate = gate
        self.waits = waits
        self.done: list[str] = []

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_trigger_close.Recording", {})

    async def _wait(self) -> None:
        for _ in range(self.waits):
            assert self.gate is not None
            await self.gate.wait()
            await asyncio.sleep(0)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            yield TriggerEvent("go")
        finally:
            await self._wait()
            self.done.append("finally")

    async def cleanup(self) -> None:
        await self._wait()
        self.done.append("cleanup")


def _runner(timeout_s: float) -> TriggerRunner:
    return TriggerRunner(None, None, cleanup_timeout_s=timeout_s)  # type: ignore[arg-type]


async def _close(trigger: Recording, timeout_s: float = 30.0) -> None:
    agen = trigger.run()
    assert (await agen.__anext__()).payload == "go"
    await _runner(timeout_s)._close(trigger, agen, Held(1, "tests.test_trigger_close.Recording"))


async def test_a_trigger_that_waits_for_nothing_is_closed_and_cleaned_up() -> None:
    trigger = Recording()
    await _close(trigger)
    assert trigger.done == ["finally", "cleanup"]


async def test_a_trigger_that_waits_in_its_close_and_cleanup_runs_both_to_the_end() -> None:
    gate = asyncio.Event()
    trigger = Recording(gate, waits=3)
    closing = asyncio.ensure_future(_close(trigger))
    await asyncio.sleep(0)
    assert trigger.done == []
    assert not closing.done()
    gate.set()
    await closing
    assert trigger.done == ["finally", "cleanup"]


async def test_a_cleanup_that_waits_too_long_is_abandoned(caplog: pytest.LogCaptureFixture) -> None:
    trigger = Recording(asyncio.Event(), waits=1)  # never set
    with caplog.at_level(logging.WARNING, logger="engine.triggerer"):
        await _close(trigger, timeout_s=0.05)
    assert trigger.done == []
    assert "did not finish within 0.1s; abandoned" in caplog.text


async def test_the_triggerers_cancellation_reaches_a_waiting_cleanup() -> None:
    trigger = Recording(asyncio.Event(), waits=1)  # never set
    cancelled: list[bool] = []

    async def cleanup() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    trigger.cleanup = cleanup  # type: ignore[method-assign]
    trigger.waits = 0
    closing = asyncio.ensure_future(_close(trigger))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not closing.done()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert cancelled == [True]
    assert trigger.done == ["finally"]
