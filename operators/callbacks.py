"""Callbacks of tasks and DAGs: what they may be, and what a failure's callback receives.

A callback is a callable taking one argument, the context (``def notify(context): ...``), or a
list of them, run in order. A task declares ``on_execute_callback``, ``on_success_callback``,
``on_failure_callback``, ``on_retry_callback`` and ``on_skipped_callback`` (its DAG's
``default_args`` may give them); a DAG ``on_success_callback`` and ``on_failure_callback``.
The engine runs them on a worker (engine/worker/callbacks.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "DAG_CALLBACK_KINDS",
    "TASK_CALLBACK_KINDS",
    "Callbacks",
    "TaskFailure",
    "callbacks_of",
    "check_callbacks",
    "declared_kinds",
]

#: A callback, or a list of them.
Callbacks = Callable[[Any], Any] | Sequence[Callable[[Any], Any]] | None

#: The outcome callbacks of a task, by the kind of outcome (the attribute is
#: ``on_<kind>_callback``); ``on_execute_callback`` runs before ``execute`` instead.
TASK_CALLBACK_KINDS = ("success", "failure", "retry", "skipped")
#: A DAG's callbacks, run when one of its runs ends.
DAG_CALLBACK_KINDS = ("success", "failure")


class TaskFailure(Exception):
    """``context["exception"]`` of a failure or retry callback: the error the try failed with.

    The callback runs after the outcome was written, maybe on another worker than the try (a
    timeout, a trigger's failure or a reaped zombie are decided outside any try), so the
    exception object the task raised is not at hand: this one carries what was recorded.
    ``str()`` is the error's last line (``ValueError: boom``); ``error`` the whole text (the
    traceback)."""

    def __init__(self, error: str) -> None:
        self.error = error
        lines = [line for line in error.strip().splitlines() if line.strip()]
        super().__init__(lines[-1].strip() if lines else error)


def check_callbacks(owner: str, name: str, value: object) -> None:
    """A clear error for a callback argument that is neither a callable nor a list of them."""
    if value is None or callable(value):
        return
    if isinstance(value, list | tuple) and all(callable(v) for v in value):
        return
    raise TypeError(f"{owner}: {name} must be a callable or a list of callables, got {value!r}")


def callbacks_of(value: object) -> list[Callable[[Any], Any]]:
    """The callables of a callback argument, in order."""
    if value is None:
        return []
    if callable(value):
        return [value]
    fns: list[Callable[[Any], Any]] = list(value)  # type: ignore[call-overload]
    return fns


def declared_kinds(owner: object, kinds: Sequence[str]) -> list[str]:
    """Of ``kinds``, those ``owner`` (a task or a DAG) has an ``on_<kind>_callback`` for."""
    return [k for k in kinds if callbacks_of(getattr(owner, f"on_{k}_callback", None))]
