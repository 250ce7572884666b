"""A trigger that checks a condition every ``poll_interval`` seconds.

Subclasses write one ``async def check()``: ``None`` or ``False`` means "not yet", anything
else is the event's payload (or a :class:`~triggers.base.TriggerEvent` to yield as is, such as
a ``TaskFailedEvent``). The same ``check()`` serves a sensor's poke on the worker, so the
condition is written once for all three sensor modes.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator
from typing import Any

from triggers.base import (
    BaseTrigger,
    ImportPathError,
    TaskSuccessEvent,
    TriggerEvent,
    import_object,
)

__all__ = ["DEFAULT_POLL_INTERVAL_S", "PollingTrigger", "import_callable", "is_met"]

DEFAULT_POLL_INTERVAL_S = 5.0


def is_met(result: Any) -> bool:
    """Whether a ``check()`` result ends the wait."""
    return result is not None and result is not False


class PollingTrigger(BaseTrigger):
    """Base of the built-in polling triggers; see the module docstring."""

    def __init__(
        self, *, poll_interval: float = DEFAULT_POLL_INTERVAL_S, end_from_trigger: bool = False
    ) -> None:
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, int | float):
            raise TypeError(f"poll_interval must be a number of seconds, got {poll_interval!r}")
        if poll_interval < 0:
            raise ValueError(f"poll_interval must not be negative, got {poll_interval!r}")
        self.poll_interval = float(poll_interval)
        self.end_from_trigger = bool(end_from_trigger)

    def _base_kwargs(self) -> dict[str, Any]:
        return {"poll_interval": self.poll_interval, "end_from_trigger": self.end_from_trigger}

    @abc.abstractmethod
    async def check(self) -> Any:
        """Check the condition once, without blocking the loop."""

    def event(self, result: Any) -> TriggerEvent:
        """The event a met condition yields: the task ends here with ``end_from_trigger``."""
        if isinstance(result, TriggerEvent):
            return result
        payload = None if result is True else result
        return TaskSuccessEvent(payload) if self.end_from_trigger else TriggerEvent(payload)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            result = await self.check()
            if is_met(result):
                yield self.event(result)
                return
            await asyncio.sleep(self.poll_interval)


def import_callable(path: str, what: str = "callable") -> Any:
    """Import ``package.module.name`` and check it is callable (a check passed by path);
    :func:`triggers.base.import_object` with more checks, raising its ``ImportPathError``.

    The callable must be *defined* in the module the path names, not merely imported there:
    the runtime's allow-list matches the path, and ``orders.run`` must not reach
    ``asyncio.create_subprocess_shell`` because ``orders`` imported it under that name."""
    obj = import_object(path, what, accept=callable, wanted="callable")
    module_name = path.rpartition(".")[0]
    defined_in = getattr(obj, "__module__", None)
    if defined_in != module_name:
        raise ImportPathError(
            f"{what} {path!r} is defined in module {defined_in!r}, not {module_name!r}: name a "
            "callable by the module that defines it"
        )
    return obj
