"""The authoring kit reports each way a trigger can go wrong, by name."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from engine.config import DEFAULT_BLOCKED_LOOP_S
from engine.testing import (
    DEFAULT_BLOCKING_THRESHOLD_S,
    TriggerBlockedLoop,
    TriggerRaised,
    TriggerReturnedWithoutEvent,
    TriggerTestError,
    TriggerTimedOut,
    assert_serializable,
    run_trigger,
    run_trigger_sync,
)
from triggers.base import BaseTrigger, TriggerEvent

pytestmark = pytest.mark.anyio


class Quick(BaseTrigger):
    def __init__(self, value: int = 1) -> None:
        self.value = value

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_testing_kit.Quick", {"value": self.value})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(0)
        yield TriggerEvent({"value": self.value})


class SleepsInRun(Quick):
    """The classic mistake: time.sleep inside run() freezes every trigger on the loop."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_testing_kit.SleepsInRun", {"value": self.value})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(0)
        time.sleep(0.5)  # noqa: ASYNC251 - the mistake under test
        yield TriggerEvent(None)


class ReadsSynchronously(Quick):
    """Sync I/O that takes long: here, a busy loop standing in for a slow blocking read."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_testing_kit.ReadsSynchronously", {"value": self.value})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        deadline = time.perf_counter() + 0.5
        while time.perf_counter() < deadline:
            pass
        yield TriggerEvent(None)


class BlocksBriefly(Quick):
    """One step of 0.1 s, half the triggerer's blocked_loop_s: a triggerer lets it be."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_testing_kit.BlocksBriefly", {"value": self.value})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        time.sleep(DEFAULT_BLOCKED_LOOP_S / 2)  # noqa: ASYNC251 - within the triggerer's limit
        yield TriggerEvent(self.value)


class NeverFires(Quick):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_testing_kit.NeverFires", {"value": self.value})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.Event().wait()
        yield TriggerEvent(None)


class Raises(Quick):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_testing_kit.Raises", {"value": self.value})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(0)
        raise ConnectionError("service down")
        yield TriggerEvent(None)  # pragma: no cover


class ReturnsEarly(Quick):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_testing_kit.ReturnsEarly", {"value": self.value})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(0)
        return
        yield TriggerEvent(None)  # pragma: no cover


class CleansUp(Quick):
    cleaned: list[int] = []

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_testing_kit.CleansUp", {"value": self.value})

    async def cleanup(self) -> None:
        CleansUp.cleaned.append(self.value)


class HoldsACallable(BaseTrigger):
    def __init__(self, fn: Callable[[], bool]) -> None:
        self.fn = fn

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_testing_kit.HoldsACallable", {"fn": self.fn})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(self.fn())


class ForgetsAKwarg(Quick):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_testing_kit.ForgetsAKwarg", {})


async def test_run_trigger_returns_the_first_event() -> None:
    event = await run_trigger(Quick(7))
    assert event.payload == {"value": 7}


def test_run_trigger_sync_works_without_a_loop() -> None:
    assert run_trigger_sync(Quick(3)).payload == {"value": 3}


@pytest.mark.parametrize("cls", [SleepsInRun, ReadsSynchronously])
async def test_a_blocking_call_in_run_is_reported_by_name(cls: type[Quick]) -> None:
    with pytest.raises(TriggerBlockedLoop) as caught:
        await run_trigger(cls(1))
    message = str(caught.value)
    assert f"{cls.__name__}(value=...) blocked the event loop" in message
    assert "test_testing_kit.py" in message  # the line that blocked


async def test_the_blocking_check_is_the_triggerers_watchdog() -> None:
    """The kit flags what a triggerer flags, with the triggerer's default threshold: a step
    well within blocked_loop_s is no block."""
    assert DEFAULT_BLOCKING_THRESHOLD_S == DEFAULT_BLOCKED_LOOP_S
    assert (await run_trigger(BlocksBriefly(2))).payload == 2


async def test_the_blocking_check_can_be_turned_off() -> None:
    await run_trigger(SleepsInRun(1), blocking_threshold=None)


async def test_no_event_in_time_is_a_timeout() -> None:
    with pytest.raises(
        TriggerTimedOut, match=r"NeverFires\(value=\.\.\.\) yielded no event within"
    ):
        await run_trigger(NeverFires(1), timeout=0.05)


async def test_an_exception_is_reported_with_its_cause() -> None:
    with pytest.raises(TriggerRaised, match="raised ConnectionError: service down") as caught:
        await run_trigger(Raises(1))
    assert isinstance(caught.value.__cause__, ConnectionError)


async def test_returning_without_an_event_is_reported() -> None:
    with pytest.raises(TriggerReturnedWithoutEvent, match="returned without yielding"):
        await run_trigger(ReturnsEarly(1))


async def test_cleanup_runs_after_the_event() -> None:
    await run_trigger(CleansUp(42))
    assert 42 in CleansUp.cleaned


def test_assert_serializable_rejects_live_objects_and_lossy_kwargs() -> None:
    with pytest.raises(TriggerTestError, match="cannot be serialized"):
        assert_serializable(HoldsACallable(lambda: True))
    with pytest.raises(TriggerTestError, match="round trip"):
        assert_serializable(ForgetsAKwarg(5))
    assert isinstance(assert_serializable(Quick(2)), Quick)
