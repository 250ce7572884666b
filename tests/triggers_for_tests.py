"""Triggers the tests defer to. They live in a module so that the triggerer (in-process or a
child process with the repository on PYTHONPATH) can import them by classpath.

Module-level counters let tests check how often a trigger's ``run()`` and ``cleanup()`` ran in
this process; each test keys them by something unique to it (a file path, a tag).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from triggers.base import (
    BaseEventTrigger,
    BaseTrigger,
    CursorEvent,
    TaskFailedEvent,
    TaskSkippedEvent,
    TaskSuccessEvent,
    TriggerEvent,
)

#: How many times run() started, by key.
RUNS: Counter[str] = Counter()
#: How many times cleanup() ran, by key.
CLEANUPS: Counter[str] = Counter()

_HERE = __name__


class WaitTrigger(BaseTrigger):
    """Sleeps ``delay_s`` (the thing under test), then fires with ``payload``."""

    def __init__(self, delay_s: float, payload: Any = None) -> None:
        self.delay_s = delay_s
        self.payload = payload

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{_HERE}.WaitTrigger", {"delay_s": self.delay_s, "payload": self.payload})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.delay_s)
        yield TriggerEvent(self.payload)


def release_file(path: str | os.PathLike[str], text: str) -> None:
    """Create the file a FileTrigger waits for, atomically: the trigger never sees it half
    written."""
    tmp = Path(f"{os.fspath(path)}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_if_exists(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return None


class FileTrigger(BaseTrigger):
    """Fires once ``path`` exists, with its text: a wait the test ends when it chooses."""

    def __init__(self, path: str, poll_s: float = 0.01) -> None:
        self.path = path
        self.poll_s = poll_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{_HERE}.FileTrigger", {"path": self.path, "poll_s": self.poll_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        RUNS[self.path] += 1
        while (text := _read_if_exists(self.path)) is None:  # noqa: ASYNC110 - polling is its job
            await asyncio.sleep(self.poll_s)
        yield TriggerEvent({"path": self.path, "text": text})

    async def cleanup(self) -> None:
        CLEANUPS[self.path] += 1


class NeverTrigger(BaseTrigger):
    """Never fires; counts its cleanups under ``tag``."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{_HERE}.NeverTrigger", {"tag": self.tag})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        RUNS[self.tag] += 1
        await asyncio.Event().wait()
        yield TriggerEvent(None)  # pragma: no cover - never reached

    async def cleanup(self) -> None:
        CLEANUPS[self.tag] += 1


class RaisingTrigger(BaseTrigger):
    """Raises ``RuntimeError(message)`` instead of firing."""

    def __init__(self, message: str) -> None:
        self.message = message

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{_HERE}.RaisingTrigger", {"message": self.message})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(0)
        raise RuntimeError(self.message)
        yield TriggerEvent(None)  # pragma: no cover - makes run() an async generator


class SilentTrigger(BaseTrigger):
    """Returns without yielding any event."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{_HERE}.SilentTrigger", {"tag": self.tag})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(0)
        return
        yield TriggerEvent(None)  # pragma: no cover - makes run() an async generator


_END_EVENTS: dict[str, type[TriggerEvent]] = {
    "success": TaskSuccessEvent,
    "failed": TaskFailedEvent,
    "skipped": TaskSkippedEvent,
}


class EndTrigger(BaseTrigger):
    """Ends the waiting task itself with a task-end event of ``kind``."""

    def __init__(self, kind: str, payload: Any = None) -> None:
        self.kind = kind
        self.payload = payload

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{_HERE}.EndTrigger", {"kind": self.kind, "payload": self.payload})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(0.01)
        yield _END_EVENTS[self.kind](self.payload)


# -- triggers that must not pass validate_trigger ---------------------------------------------


class HoldsTrigger(BaseTrigger):
    """Serializes whatever it holds, live objects included."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{_HERE}.HoldsTrigger", {"value": self.value})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(None)


class ClasspathTrigger(BaseTrigger):
    """Claims to be stored under any classpath it is given."""

    def __init__(self, classpath: str) -> None:
        self.classpath = classpath

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (self.classpath, {"classpath": self.classpath})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(None)


class DriftTrigger(BaseTrigger):
    """Changes its argument on the way in, so it never rebuilds equal."""

    def __init__(self, n: int) -> None:
        self.n = n + 1

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{_HERE}.DriftTrigger", {"n": self.n})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(None)


class EchoTrigger(BaseTrigger):
    """Holds arbitrary plain data (the property test's subject)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{_HERE}.EchoTrigger", {"data": self.data})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(self.data)


class NotATrigger:
    """A class that is no BaseTrigger."""


class FailingEventTrigger(BaseEventTrigger):
    """An event trigger whose ``run()`` raises ``message`` at once, every time it starts (an
    asset watcher's fault: recorded, restarted with backoff)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{_HERE}.FailingEventTrigger", {"message": self.message})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        raise RuntimeError(self.message)
        yield  # pragma: no cover - an async generator


class NulEventTrigger(BaseEventTrigger):
    """An event trigger that yields one event whose payload holds NUL characters (in a key,
    a value, a nested list) with its cursor, then waits (an outside body with a NUL byte)."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{_HERE}.NulEventTrigger", {})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        if self.cursor is None:
            yield CursorEvent({"body": "a\x00b", "k\x00": ["x\x00", 1]}, cursor=1)
        await asyncio.Event().wait()
