"""Named queries of the built-in triggers, kept in ``.sql`` files next to them.

The same ``-- name: <name>`` block format as the engine's store, parsed here again because
built-in triggers import contracts only, never the runtime (an import-linter contract).
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

__all__ = ["load_queries"]

_NAME = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


@cache
def load_queries(filename: str) -> dict[str, str]:
    """The named queries of ``triggers/<filename>``; leading comment lines are dropped."""
    text = resources.files(__package__).joinpath(filename).read_text()
    parts = _NAME.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [line for line in body.strip().splitlines()]
        while lines and lines[0].startswith("--"):
            lines.pop(0)
        sql = "\n".join(lines).strip().rstrip(";")
        if not sql or name in queries:
            raise ValueError(f"{filename}: query {name!r} is empty or defined twice")
        queries[name] = sql
    return queries
