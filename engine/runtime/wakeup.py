"""A resettable wake-up signal for one waiting loop (notifications, freed slots, stops)."""

from __future__ import annotations

import asyncio

__all__ = ["Wakeup"]


class Wakeup:
    """``set()`` from anywhere on the loop; ``wait(timeout)`` returns True if it was set."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self, timeout_s: float | None) -> bool:
        """Wait until set or ``timeout_s`` passes; clears the signal before returning."""
        if not self._event.is_set():
            if timeout_s is not None and timeout_s <= 0:
                return False
            try:
                await asyncio.wait_for(self._event.wait(), timeout_s)
            except TimeoutError:
                return False
        self._event.clear()
        return True
