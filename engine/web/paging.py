"""Long tables shown a page at a time (a run's 5,000 tasks): which rows a page holds and the
links to the other pages. A page number past the last shows the last page."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PAGE_ROWS", "Pager", "shortened"]

#: Rows of a paged table.
PAGE_ROWS = 100
#: Ids a cell lists (a join task's upstream) before it counts the rest.
LISTED_IDS = 10


@dataclass(frozen=True)
class Pager:
    """Page ``page`` (from 1) of ``total`` rows, ``size`` a page; ``href(n)`` is page n's
    address."""

    page: int
    total: int
    href: Callable[[int], str]
    size: int = PAGE_ROWS
    #: What the rows are, for "tasks 101 to 200 of 5,000".
    noun: str = "tasks"

    @classmethod
    def of(
        cls,
        requested: int | None,
        total: int,
        href: Callable[[int], str],
        *,
        size: int = PAGE_ROWS,
        noun: str = "tasks",
    ) -> Pager:
        """The page ``requested`` (None: the first), within the pages there are."""
        pages = max(1, math.ceil(total / size))
        return cls(min(max(1, requested or 1), pages), total, href, size, noun)

    @property
    def pages(self) -> int:
        return max(1, math.ceil(self.total / self.size))

    @property
    def offset(self) -> int:
        return (self.page - 1) * self.size

    @property
    def first_row(self) -> int:
        return min(self.offset + 1, self.total)

    @property
    def last_row(self) -> int:
        return min(self.offset + self.size, self.total)

    @property
    def links(self) -> list[tuple[str, str]]:
        """(label, address) of the first, previous, next and last pages, those that differ
        from this one."""
        wanted = [
            ("first", 1),
            ("previous", self.page - 1),
            ("next", self.page + 1),
            (f"last ({self.pages})", self.pages),
        ]
        return [
            (label, self.href(n)) for label, n in wanted if 1 <= n <= self.pages and n != self.page
        ]


def shortened(ids: list[str], listed: int = LISTED_IDS) -> str:
    """``ids`` joined by commas, the first ``listed`` of them and a count of the others."""
    if len(ids) <= listed:
        return ", ".join(ids)
    return f"{', '.join(ids[:listed])} … ({len(ids)} in all)"
