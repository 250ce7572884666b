"""A run's Gantt view: a row per try of each task, its spans (queued, running, deferred,
rescheduled) as bars on one time axis, laid out here for an SVG drawn on the server."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.store.models import TryRecord
from engine.web.render import _age, _when
from engine.web.views.tries import Span, latest_tries, spans, waiting_span

__all__ = ["AXIS_W", "LABEL_W", "ROW_H", "Gantt", "GanttBar", "GanttRow", "gantt"]

#: The time axis's width, the task labels' width and a row's height (pixels).
AXIS_W = 720
LABEL_W = 220
ROW_H = 20
#: Steps between the axis's ticks (seconds), the smallest giving at most MAX_TICKS ticks.
_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200)
MAX_TICKS = 8


@dataclass(frozen=True)
class GanttBar:
    kind: str
    x: float
    width: float
    title: str


@dataclass(frozen=True)
class GanttRow:
    task_id: str
    label: str
    href: str
    state: str
    y: int
    bars: list[GanttBar]


@dataclass(frozen=True)
class Gantt:
    rows: list[GanttRow]
    #: (x, label) of each tick of the axis, relative to its start.
    ticks: list[tuple[float, str]]
    start: dt.datetime | None
    end: dt.datetime | None
    width: int
    height: int
    label_w: int = LABEL_W
    axis_w: int = AXIS_W
    row_h: int = ROW_H


def _tick_label(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"+{s}s"
    if s < 3600:
        return f"+{s // 60}m" + (f"{s % 60}s" if s % 60 else "")
    return f"+{s // 3600}h" + (f"{s % 3600 // 60}m" if s % 3600 // 60 else "")


def _ticks(total_s: float, scale: Callable[[float], float]) -> list[tuple[float, str]]:
    step = next((s for s in _STEPS if total_s / s <= MAX_TICKS), None)
    if step is None:
        step = 86400 * max(1, int(total_s // (86400 * MAX_TICKS)) + 1)
    return [(scale(t), _tick_label(t)) for t in range(0, int(total_s) + 1, step)]


def _title(task_id: str, try_number: int, span: Span) -> str:
    length = _age((span.end - span.start).total_seconds())
    until = "now (going on)" if span.open else _when(span.end)
    return f"{task_id} try {try_number}: {span.kind} {length}, {_when(span.start)} to {until}"


@dataclass(frozen=True)
class _Line:
    task_id: str
    try_number: int
    label: str
    state: str
    href: str
    spans: list[Span]


def _lines(
    records: Sequence[TryRecord], href: Callable[[str, int | None], str], order: Sequence[str]
) -> list[_Line]:
    by_task: dict[str, list[TryRecord]] = {}
    for r in records:
        by_task.setdefault(r.task_id or "", []).append(r)
    lines = []
    for task_id in order:
        rows = by_task.get(task_id, [])
        tries = latest_tries(rows)
        for t in tries:
            link = href(task_id, t.try_number)
            label = f"{task_id} · try {t.try_number}"
            lines.append(_Line(task_id, t.try_number, label, t.state, link, spans(t)))
        current = next((r for r in rows if r.current), None)
        if current is None:
            continue
        wait = waiting_span(current)
        if wait is not None or not tries:
            # (due for its next try, or never run: a row that says so, with the wait)
            n = current.try_number + 1 if current.started else max(1, current.try_number)
            label = f"{task_id} · try {n} (not started)"
            found = [wait] if wait else []
            lines.append(_Line(task_id, n, label, current.state, href(task_id, None), found))
    return lines


def gantt(
    records: Sequence[TryRecord], href: Callable[[str, int | None], str], order: Sequence[str]
) -> Gantt:
    """The Gantt view of ``records`` (the tries of a run's task instances, as the store gives
    them), tasks in ``order`` (the DAG's), each row a link to its try (``href(task_id,
    try_number)``; None: the latest). A task that waits for its next try has a row for it."""
    lines = _lines(records, href, order)
    every = [s for line in lines for s in line.spans]
    start = min((s.start for s in every), default=None)
    end = max((s.end for s in every), default=None)
    total_s = max(1.0, (end - start).total_seconds()) if start and end else 1.0

    def scale(seconds: float) -> float:
        return round(seconds * AXIS_W / total_s, 1)

    rows = []
    for i, line in enumerate(lines):
        bars = [
            GanttBar(
                s.kind,
                scale((s.start - start).total_seconds()) if start else 0.0,
                max(1.0, scale((s.end - s.start).total_seconds())),
                _title(line.task_id, line.try_number, s),
            )
            for s in line.spans
        ]
        rows.append(GanttRow(line.task_id, line.label, line.href, line.state, i * ROW_H, bars))
    ticks = _ticks(total_s, scale) if start else []
    return Gantt(rows, ticks, start, end, LABEL_W + AXIS_W + 8, max(1, len(rows)) * ROW_H + 24)
