"""Load the named queries of ``queries.sql``: ``-- name: x`` blocks into a mapping."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

__all__ = ["load_queries", "migrations", "schema_sql"]

_NAME = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def parse_queries(text: str) -> dict[str, str]:
    """Split a file of ``-- name:`` blocks; each block's leading comment lines are dropped."""
    parts = _NAME.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = body.strip().splitlines()
        while lines and lines[0].startswith("--"):
            lines.pop(0)
        sql = "\n".join(lines).strip().rstrip(";")
        if not sql:
            raise ValueError(f"query {name!r} is empty")
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = sql
    return queries


@cache
def load_queries() -> dict[str, str]:
    return parse_queries(resources.files(__package__).joinpath("queries.sql").read_text())


def schema_sql() -> str:
    return resources.files(__package__).joinpath("schema.sql").read_text()


def migrations() -> list[tuple[int, str, str]]:
    """``(version, name, sql)`` of every migration, in order."""
    folder = resources.files(__package__).joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = re.match(r"^(\d{4})_([a-z0-9_]+)\.sql$", entry.name)
        if match:
            found.append((int(match.group(1)), match.group(2), entry.read_text()))
    found.sort()
    versions = [v for v, _, _ in found]
    if versions != list(range(1, len(versions) + 1)):
        raise RuntimeError(f"migrations must be numbered 1..n without gaps, found {versions}")
    return found
