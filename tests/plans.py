"""Reading query plans in tests: the plan tests of the hot statements (test_query_plans.py)
and of the admission query (test_admission_plan.py) share these."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

#: A function that EXPLAINs a statement's generic plan through PL/pgSQL's EXECUTE (the simple
#: protocol: the extended one would ask for the values a generic plan leaves open).
EXPLAIN_GENERIC = """
CREATE FUNCTION pg_temp.explain_generic(query text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE plan text;
BEGIN
    EXECUTE 'EXPLAIN (FORMAT JSON, GENERIC_PLAN) ' || query INTO plan;
    RETURN plan;
END $$"""


def plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node of a JSON plan, the root first."""
    yield plan
    for child in plan.get("Plans", []):
        yield from plan_nodes(child)


def plan_outline(plan: dict[str, Any], depth: int = 0) -> str:
    """The plan as an indented outline, for failure messages."""
    what = " ".join(
        str(plan[k])
        for k in ("Node Type", "Relation Name", "Index Name", "CTE Name", "Subplan Name")
        if k in plan
    )
    lines = ["  " * depth + what]
    for child in plan.get("Plans", []):
        lines.append(plan_outline(child, depth + 1))
    return "\n".join(lines)
