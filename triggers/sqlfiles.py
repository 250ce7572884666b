"""Named SQL files: the one parser of ``-- name: <name>`` blocks, for the engine and triggers.

A file holds blocks that each start with ``-- name: <name>``, then comment lines that say what
the statement does (dropped), then one statement. The engine's store (``queries.sql``) and the
built-in triggers (``triggers/*.sql``) both read their files through :func:`parse_queries`. It
lives here, with the contracts, because built-in triggers import contracts only, never the
runtime (an import-linter contract); the runtime may import it.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

__all__ = ["load_queries", "parse_queries", "read_queries"]

_NAME = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def parse_queries(text: str, source: str) -> dict[str, str]:
    """Split ``text`` (the contents of ``source``, named in errors) into ``{name: statement}``.

    Raises ``ValueError`` for a block with no statement or a name defined twice."""
    parts = _NAME.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = body.strip().splitlines()
        while lines and lines[0].startswith("--"):
            lines.pop(0)
        sql = "\n".join(lines).strip().rstrip(";")
        if not sql:
            raise ValueError(f"{source}: query {name!r} is empty")
        if name in queries:
            raise ValueError(f"{source}: query {name!r} is defined twice")
        queries[name] = sql
    return queries


@cache
def read_queries(package: str, filename: str) -> dict[str, str]:
    """The named queries of file ``filename`` of package ``package``."""
    text = resources.files(package).joinpath(filename).read_text()
    return parse_queries(text, f"{package}/{filename}")


def load_queries(filename: str) -> dict[str, str]:
    """The named queries of ``triggers/<filename>``."""
    return read_queries(__package__ or "triggers", filename)
