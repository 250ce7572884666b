"""What every page's view shares: tables as lists of :class:`Column` (a title and how to get a
cell from a row), the cells (text, a :class:`Link`, :class:`Squares`), the pages' addresses
and the states' legend.

A new field is one more ``Column`` in a page's list (and its column in the store's query): the
templates render whatever columns they are given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from engine.states import STATES

__all__ = [
    "LEGEND",
    "STALE_AFTER_S",
    "Column",
    "Link",
    "NotFound",
    "Square",
    "Squares",
    "Table",
    "dag_url",
    "process_name",
    "run_url",
    "stale",
    "state_square",
    "task_url",
    "url",
]

#: A heartbeat older than this shows the process as stale.
STALE_AFTER_S = 30.0

#: Every task state, in the order the legend shows them (and a cell of several task instances
#: shows the first of its states): what needs a look first, then what waits, then what ended.
LEGEND: tuple[str, ...] = (
    "failed",
    "upstream_failed",
    "up_for_retry",
    "running",
    "queued",
    "deferred",
    "up_for_reschedule",
    "scheduled",
    "pending",
    "success",
    "skipped",
)
assert set(LEGEND) == STATES, "the legend names every state once"


class NotFound(LookupError):
    """The page names something that does not exist (404)."""


@dataclass(frozen=True)
class Link:
    text: str
    href: str
    kind: str = "link"


@dataclass(frozen=True)
class Square:
    title: str
    state: str
    href: str


@dataclass(frozen=True)
class Squares:
    items: list[Square]
    kind: str = "squares"


@dataclass(frozen=True)
class Column:
    title: str
    cell: Callable[[Any], Any]
    #: Right-aligned (numbers).
    numeric: bool = False


@dataclass
class Table:
    columns: Sequence[Column]
    rows: Sequence[Any]
    #: CSS class of each row (e.g. stale), from the row.
    row_class: Callable[[Any], str] = field(default=lambda _row: "")

    def cells(self, row: Any) -> list[tuple[Column, Any]]:
        return [(c, c.cell(row)) for c in self.columns]


def url(path: str, **params: Any) -> str:
    """A page's address with its query parameters (None ones left out)."""
    query = urlencode({k: v for k, v in params.items() if v is not None})
    return f"{path}?{query}" if query else path


def dag_url(dag_id: str) -> str:
    return url("/dag", dag_id=dag_id)


def run_url(dag_id: str, run_id: str) -> str:
    return url("/run", dag_id=dag_id, run_id=run_id)


def task_url(dag_id: str, run_id: str, task_id: str, try_number: int | None = None) -> str:
    """A task instance's page: its latest try, or try ``try_number``."""
    return url("/task", dag_id=dag_id, run_id=run_id, task_id=task_id, **{"try": try_number})


def stale(row: Any) -> str:
    """A process row's CSS class: ``stale`` when its heartbeat is old."""
    return "stale" if row.heartbeat_age_s > STALE_AFTER_S else ""


def process_name(row: Any) -> str:
    return f"{row.hostname} [{row.pid}]"


def state_square(state: str, href: str = "", title: str | None = None) -> Squares:
    """One state as a colored square (a link when ``href``)."""
    return Squares([Square(title or state, state, href)])
