"""The pages' query parameters, read and checked: a bad one is a 400 naming it, never a 500.

Text holds no NUL (no database text can); numbers are non-negative and fit the database;
a choice is one of its values; a date is ``YYYY-MM-DD`` or an ISO 8601 time (UTC unless it
says otherwise).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable
from typing import Any

from aiohttp import web

__all__ = ["MAX_AGE_S", "MAX_ID", "choice", "number", "required", "text", "when"]

#: The largest id a query parameter may name (PostgreSQL's bigint).
MAX_ID = 2**63 - 1
#: The largest age filter (a century): beyond it the database's timestamps overflow.
MAX_AGE_S = 100 * 365.25 * 86400


def text(request: web.Request, name: str) -> str | None:
    """A query parameter's text (None when absent or blank); a NUL, which no database text
    can hold, is a bad request."""
    value = request.query.get(name, "").strip()
    if "\x00" in value:
        raise web.HTTPBadRequest(text=f"query parameter {name!r} holds a NUL character")
    return value or None


def required(request: web.Request, name: str) -> str:
    if text(request, name) is None:
        raise web.HTTPBadRequest(text=f"missing query parameter {name!r}")
    return request.query[name]


def number(request: web.Request, name: str, kind: type[int] | type[float]) -> Any:
    """A numeric query parameter (None when absent): a non-negative number the database can
    hold, or a bad request naming it."""
    raw = text(request, name)
    if raw is None:
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be a number") from None
    top = MAX_ID if kind is int else MAX_AGE_S
    if not (math.isfinite(value) and 0 <= value <= top):
        raise web.HTTPBadRequest(text=f"{name} must be a number from 0 to {top:g}")
    return value


def choice(request: web.Request, name: str, allowed: Iterable[str]) -> str | None:
    """A query parameter that must be one of ``allowed`` (None when absent)."""
    value = text(request, name)
    options = sorted(allowed)
    if value is not None and value not in options:
        raise web.HTTPBadRequest(text=f"{name} must be one of {', '.join(options)}")
    return value


def when(request: web.Request, name: str, *, end_of_day: bool = False) -> dt.datetime | None:
    """A date (``2026-11-20``) or a time (``2026-11-20T07:00``, UTC unless an offset is
    given) as a UTC time; None when absent. A date alone with ``end_of_day`` is the start of
    the next day (an inclusive "until" date)."""
    raw = text(request, name)
    if raw is None:
        return None
    try:
        if len(raw) == 10:
            day = dt.date.fromisoformat(raw)
            at = dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)
            return at + dt.timedelta(days=1) if end_of_day else at
        at = dt.datetime.fromisoformat(raw)
        # Past the calendar's ends once in UTC (9999-12-31 to its next day, year 1 at +14:00):
        # as bad as a date that does not exist.
        return at.replace(tzinfo=dt.UTC) if at.tzinfo is None else at.astimezone(dt.UTC)
    except (ValueError, OverflowError):
        raise web.HTTPBadRequest(
            text=f"{name} must be a date (2026-11-20) or a time (2026-11-20T07:00) "
            "from year 1 to 9999"
        ) from None
