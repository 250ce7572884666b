"""Deadline alerts: ``DAG(deadline=DeadlineAlert(...))`` calls back when a run has not ended
by a time computed from the run (its logical date, or when it was queued) plus an interval.

The store keeps each alert's reference and interval with the DAG (``deferral_dags.alerts``);
creating a run starts one timer trigger per alert, run by a triggerer like any trigger, and a
run that ends first removes it. When the timer fires, a worker runs the callback
(engine/worker/callbacks.py): once, with ``kwargs`` and the ``context`` keyword.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Callable, Mapping
from typing import Any

from operators.base import to_seconds
from triggers.base import import_object

__all__ = ["DeadlineAlert", "DeadlineReference"]


class DeadlineReference(enum.Enum):
    """What a deadline counts from."""

    #: The run's logical date (a scheduled run's: the end of its data interval's schedule).
    DAGRUN_LOGICAL_DATE = "logical_date"
    #: When the run was created (queued, before it may have waited for max_active_runs).
    DAGRUN_QUEUED_AT = "queued_at"


class DeadlineAlert:
    """Call ``callback`` (a callable, or its import path ``"package.module.name"``) once for a
    run that has not ended ``interval`` after its ``reference``; ``kwargs`` are passed to it
    with ``context=`` (the run's context, with ``deadline``: when it was due)."""

    def __init__(
        self,
        *,
        reference: DeadlineReference,
        interval: dt.timedelta | float,
        callback: Callable[..., Any] | str,
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(reference, DeadlineReference):
            raise TypeError(
                "DeadlineAlert: reference must be DeadlineReference.DAGRUN_LOGICAL_DATE or "
                f"DeadlineReference.DAGRUN_QUEUED_AT, got {reference!r}"
            )
        if isinstance(interval, dt.timedelta):
            seconds = interval.total_seconds()  # (a negative interval: before the reference)
        else:
            seconds = to_seconds(interval, "DeadlineAlert: interval") or 0.0
        if isinstance(callback, str):
            # (Imported when it is called, on a worker: the path may name a function of the
            # DAG file being imported right now.)
            if "." not in callback.strip(".") or callback != callback.strip():
                raise ValueError(
                    f"DeadlineAlert: callback {callback!r} must be a callable or a dotted "
                    "import path 'module.name'"
                )
        elif not callable(callback):
            raise TypeError(
                f"DeadlineAlert: callback must be a callable or an import path, got {callback!r}"
            )
        self.reference = reference
        self.interval = dt.timedelta(seconds=seconds)
        self.callback = callback
        self.kwargs: dict[str, Any] = dict(kwargs or {})

    def resolve(self) -> Callable[..., Any]:
        """The callable to call (imported when given by path)."""
        if isinstance(self.callback, str):
            found: Callable[..., Any] = import_object(
                self.callback, "deadline callback", accept=callable, wanted="a callable"
            )
            return found
        return self.callback

    def serialize(self) -> dict[str, Any]:
        """What the store keeps to time it (the callback stays in the DAG file)."""
        return {"reference": self.reference.value, "interval_s": self.interval.total_seconds()}

    def __repr__(self) -> str:
        name = (
            self.callback
            if isinstance(self.callback, str)
            else getattr(self.callback, "__qualname__", repr(self.callback))
        )
        return f"DeadlineAlert({self.reference.name} + {self.interval}, {name})"
