"""The store's SQL files: the named queries of ``queries.sql`` (``-- name: x`` blocks, parsed
by :mod:`triggers.sqlfiles`, the one parser the built-in triggers share), the schema and the
numbered migrations."""

from __future__ import annotations

import re
from importlib import resources

from triggers.sqlfiles import read_queries

__all__ = ["load_queries", "migrations", "schema_sql"]


def load_queries() -> dict[str, str]:
    """The store's named queries (parsed by the one parser of named SQL files): those of
    ``queries.sql``, of ``assets.sql`` (assets and their events) and of ``watchers.sql`` (asset
    watchers on the triggerer), one set of names."""
    package = __package__ or "engine.store"
    queries = dict(read_queries(package, "queries.sql"))
    for extra in ("assets.sql", "watchers.sql"):
        for name, sql in read_queries(package, extra).items():
            if name in queries:
                raise RuntimeError(f"query {name!r} is named in queries.sql and in {extra}")
            queries[name] = sql
    return queries


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
