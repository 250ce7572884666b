"""What a database URL setting may be, in words that never quote it."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

__all__ = ["DATABASE_URL_SCHEMES", "database_url_problem"]

#: The schemes a database URL may have (asyncpg's).
DATABASE_URL_SCHEMES = ("postgresql", "postgres")

#: Schemes a database URL given by mistake often has (named in the error: safe to show).
_OTHER_SCHEMES = frozenset(
    {"mysql", "mariadb", "sqlite", "mssql", "oracle", "redis", "http", "https", "jdbc", "file"}
)


def database_url_problem(url: str) -> str | None:
    """What is wrong with a database URL, in words that never quote it (None: nothing)."""
    scheme, sep, _rest = url.partition("://")
    if not sep:
        return "it has no scheme"
    if scheme.lower() not in DATABASE_URL_SCHEMES:
        # The scheme is named only when it is a known one (not a password typed in its place).
        known = scheme.lower() in _OTHER_SCHEMES or re.fullmatch(r"postgres(ql)?\+\w+", scheme)
        named = f" {scheme!r}" if known else ""
        return f"its scheme{named} is not {' or '.join(DATABASE_URL_SCHEMES)}"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (parsing the port is the check)
    except ValueError:
        return "its host or port does not parse (a port is a number from 0 to 65535)"
    return None
