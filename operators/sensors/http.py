"""The sensor that waits until a URL answers as expected."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from operators.base import Context
from operators.sensors.base import BaseSensorOperator
from triggers.base import BaseTrigger, ImportPathError, import_object
from triggers.http import HttpResponse, HttpTrigger

__all__ = ["HttpSensor"]


class HttpSensor(BaseSensorOperator):
    """Waits until ``endpoint`` answers with one of ``expected_status`` and ``response_check``
    accepts the :class:`~triggers.http.HttpResponse`. ``endpoint`` is a URL, or a path
    relative to the URL of the connection ``conn_id``; ``url`` is another name for it.
    ``endpoint``, ``headers`` and ``data`` are templated. ``response_check`` is an import path
    (or a module-level function, turned into one); a lambda or closure works in poke and
    reschedule mode only, since a triggerer cannot import it."""

    template_fields = ("endpoint", "headers", "data")

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        url: str | None = None,
        method: str = "GET",
        headers: dict[str, str] | None = None,
        data: str | None = None,
        expected_status: Sequence[int] = (200,),
        response_check: str | Callable[[HttpResponse], Any] | None = None,
        conn_id: str | None = None,
        request_timeout: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if (endpoint is None) == (url is None):
            raise ValueError(
                f"task {self.task_id}: give HttpSensor one endpoint (or url, its other name)"
            )
        self.endpoint: str = endpoint if endpoint is not None else url  # type: ignore[assignment]
        self.method = method
        self.headers = dict(headers or {})
        self.data = data
        self.expected_status = list(expected_status)
        self.conn_id = conn_id
        self.request_timeout = request_timeout
        self.check_fn: Callable[[HttpResponse], Any] | None = None
        self.check_path: str | None = None
        if isinstance(response_check, str) or response_check is None:
            self.check_path = response_check
        else:
            self.check_path = _import_path_of(response_check)
            self.check_fn = response_check
            if self.check_path is None and self.deferrable:
                raise ValueError(
                    f"task {self.task_id}: a deferrable HttpSensor needs response_check as an "
                    "import path ('module.function'); a lambda or closure cannot reach a triggerer"
                )

    def can_defer(self) -> bool:
        return self.check_fn is None or self.check_path is not None

    def _trigger(self) -> HttpTrigger:
        return HttpTrigger(
            url=self.endpoint,
            method=self.method,
            headers=self.headers,
            data=self.data,
            expected_status=self.expected_status,
            conn_id=self.conn_id,
            request_timeout=self.request_timeout,
            response_check=self.check_path,
            **self.trigger_kwargs(),
        )

    def poke(self, context: Context) -> Any:
        trigger = self._trigger()
        trigger.response_check_fn = self.check_fn
        return asyncio.run(trigger.check())

    def trigger(self, context: Context) -> BaseTrigger:
        return self._trigger()


def _import_path_of(fn: Callable[..., Any]) -> str | None:
    """``module.qualname`` of a function importable under that name, else None."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in name or "." in name:
        return None
    path = f"{module}.{name}"
    try:
        found = import_object(path, "function")
    except ImportPathError:
        return None
    return path if found is fn else None
