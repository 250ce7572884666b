"""Wait until an async Python check, given by import path, returns something truthy."""

from __future__ import annotations

import inspect
from typing import Any

from triggers.polling import DEFAULT_POLL_INTERVAL_S, PollingTrigger, import_callable

__all__ = ["PythonTrigger"]


class PythonTrigger(PollingTrigger):
    """Calls ``await check(**kwargs)`` every ``poll_interval`` seconds; the first truthy value
    (other than ``True``) is the payload. ``check`` is an import path to an ``async def`` that
    never blocks the loop; ``kwargs`` are plain data. ``check`` must match the engine's
    allow-list (setting ``trigger_allow``), which the runtime checks before building it."""

    import_path_kwargs = ("check",)

    def __init__(
        self,
        check: str,
        *,
        kwargs: dict[str, Any] | None = None,
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        end_from_trigger: bool = False,
    ) -> None:
        super().__init__(poll_interval=poll_interval, end_from_trigger=end_from_trigger)
        fn = import_callable(check, "check")
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"check {check!r} must be an async def (it runs on the loop)")
        self.check_path = check
        self.kwargs = dict(kwargs or {})

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.python.PythonTrigger",
            {"check": self.check_path, "kwargs": self.kwargs, **self._base_kwargs()},
        )

    async def check(self) -> Any:
        fn = import_callable(self.check_path, "check")
        result = await fn(**self.kwargs)
        return result if result else None
