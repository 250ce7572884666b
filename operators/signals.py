"""The control-flow signals a task raises to end its try other than by returning: defer,
reschedule, skip, fail without retries; and the value a branching task returns to skip others
(:class:`SkipTasks`). The worker (and a task's child process) classify a
try by them; :mod:`operators.base` re-exports them for DAG files. Imports no authoring API.

``TaskDeferred`` and ``RescheduleRequested`` derive from ``BaseException`` so that a user's
``except Exception`` cannot swallow them; ``SkipTask`` and ``FailTask`` are raised by users
and derive from ``Exception``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from triggers.base import SerializedTrigger

__all__ = ["FailTask", "RescheduleRequested", "SkipTask", "SkipTasks", "TaskDeferred"]


class TaskDeferred(BaseException):
    """Raised by :meth:`BaseOperator.defer`; the worker stores the deferral and frees the slot.

    ``encoded_kwargs`` is ``kwargs`` as stored (``encode_value``): ``defer()`` encodes them
    once, to check them, and the worker stores those bytes. (A TaskDeferred built by hand
    without them has its kwargs encoded by the worker.) ``timeout_s`` is the trigger's own
    timeout; the task's execution_timeout, if earlier, bounds the deferral too.
    """

    def __init__(
        self,
        *,
        trigger: SerializedTrigger,
        method_name: str,
        kwargs: dict[str, Any],
        timeout_s: float | None,
        encoded_kwargs: bytes | None = None,
    ) -> None:
        super().__init__(f"deferred to {trigger.classpath}, resume at {method_name}")
        self.trigger = trigger
        self.method_name = method_name
        self.kwargs = kwargs
        self.timeout_s = timeout_s
        self.encoded_kwargs = encoded_kwargs


class RescheduleRequested(BaseException):
    """Raised by a sensor in reschedule mode: free the slot, run again at ``reschedule_at``."""

    def __init__(self, reschedule_at: dt.datetime) -> None:
        super().__init__(f"reschedule at {reschedule_at.isoformat()}")
        self.reschedule_at = reschedule_at


class SkipTask(Exception):
    """Raise from a task to end it as ``skipped``."""


class FailTask(Exception):
    """Raise from a task to end it as ``failed`` without using its remaining retries."""


class SkipTasks:
    """What a branching task's method returns instead of a plain value: ``value`` is its return
    value (its ``return_value`` XCom) and ``task_ids`` are the tasks of its run to skip.

    The worker skips those still pending (their upstreams had not all ended: none of them ran)
    in the statement that writes the try's success, then resolves their downstreams by their trigger
    rules. The branching operators (``operators.python``) return one; a task of your own may
    too."""

    __slots__ = ("task_ids", "value")

    def __init__(self, value: Any, task_ids: Iterable[str]) -> None:
        self.value = value
        self.task_ids = tuple(sorted(set(task_ids)))
        if not all(isinstance(t, str) for t in self.task_ids):
            raise TypeError(f"task ids to skip must be str, got {self.task_ids!r}")

    def __repr__(self) -> str:
        return f"SkipTasks({self.value!r}, skip={list(self.task_ids)!r})"
