"""A task instance's tries, from what the store keeps of each (:class:`engine.store.models.
TryRecord`): which tries there are, and each one's spans in time (queued, running,
deferred) for the Gantt view and its duration.

What is stored per try: when it became due (``queued_at``), first ran (``started_at``), last
deferred (``deferred_at``), when that deferral's trigger fired (``fired_at``), its latest claim
(``resumed_at``: a resume or a reschedule) and when it ended. So a try that deferred once
shows every span exactly; one that deferred several times shows its last deferral as such,
and what came before it as one running span; a sensor rescheduled between pokes shows its
pokes and the waits between them as one span ("rescheduled").
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

from engine.store.models import TryRecord

__all__ = ["SPAN_KINDS", "Span", "duration_s", "latest_tries", "spans", "waiting_span"]

#: The kinds of span, as the Gantt view's legend explains them.
SPAN_KINDS: dict[str, str] = {
    "queued": "due, waiting for a worker (or its pool)",
    "running": "running on a worker",
    "deferred": "deferred: waiting on its trigger, no worker slot held",
    "rescheduled": "poking, and waiting between pokes (a sensor in reschedule mode)",
}

#: States in which a task instance that has not run (yet, again) is due to.
_DUE = frozenset({"scheduled", "queued", "up_for_retry", "up_for_reschedule"})


@dataclass(frozen=True)
class Span:
    kind: str
    start: dt.datetime
    end: dt.datetime
    #: Still going (its end is now).
    open: bool = False


def latest_tries(records: Iterable[TryRecord]) -> list[TryRecord]:
    """One record per try number, oldest first: the current row where it holds the try (it
    ran since it was last cleared), else the kept copy."""
    chosen: dict[int, TryRecord] = {}
    for r in records:
        if r.try_number < 1 or (r.current and not r.started):
            continue
        if r.current or r.try_number not in chosen:
            chosen[r.try_number] = r
    return [chosen[n] for n in sorted(chosen)]


def duration_s(r: TryRecord) -> float | None:
    """From the try's start to its end (to now while it goes on); None if it never ran."""
    if r.started_at is None:
        return None
    end = r.ended_at or (r.db_now if r.current else None)
    return None if end is None else max(0.0, (end - r.started_at).total_seconds())


def spans(r: TryRecord) -> list[Span]:
    """The try's spans in time, in order (see the module's docstring for what is known)."""
    going = r.current and r.ended_at is None
    end_of_try = r.ended_at  # (None while it goes on: its last span ends now)
    out: list[Span] = []

    def add(kind: str, start: dt.datetime | None, end: dt.datetime | None) -> None:
        if start is None or (end is None and not going):
            return
        stop = r.db_now if end is None else end
        if stop >= start:
            out.append(Span(kind, start, stop, end is None))

    s = r.started_at
    if s is None:
        return out
    if r.queued_at is not None and r.queued_at < s:
        add("queued", r.queued_at, s)
    d, f, resumed = r.deferred_at, r.fired_at, r.resumed_at
    # Fired, not resumed yet: the claim that resumes it copies run_after (when it fired)
    # to fired_at.
    if (
        going
        and r.state == "scheduled"
        and d is not None
        and r.run_after is not None
        and r.run_after >= d
        and (f is None or f < d)
    ):
        f = r.run_after
    if d is not None and d >= s:
        add("running", s, d)
        if f is not None and f >= d:
            add("deferred", d, f)
            if resumed is not None and resumed >= f:
                add("queued", f, resumed)
                add("running", resumed, end_of_try)
            else:
                add("queued", f, end_of_try)
        else:
            add("deferred", d, end_of_try)
    elif r.state == "up_for_reschedule" and going:
        add("rescheduled", s, None)
    elif resumed is not None and resumed > s:
        add("rescheduled", s, resumed)
        add("running", resumed, end_of_try)
    else:
        add("running", s, end_of_try)
    return out


def waiting_span(r: TryRecord) -> Span | None:
    """For a current row that waits for its next try (due since ``run_after``): that wait."""
    if not r.current or r.state not in _DUE or r.run_after is None:
        return None
    if r.run_after > r.db_now:
        return None
    return Span("queued", r.run_after, r.db_now, True)
