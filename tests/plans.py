"""Reading query plans in tests: the plan tests of the hot statements (test_query_plans.py)
and of the admission query (test_admission_plan.py) share these."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from engine.store.queries import schema_sql

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


#: The parameters of the functions whose statement the plan tests EXPLAIN (deferral_fire_triggers,
#: migration 0029) as the ``$n`` of a statement, as the statement
#: was sent before it moved into its function (in parentheses: a parameter may be subscripted).
_PARAMETERS = {
    "deferral_fire_triggers": {
        "p_triggerer": "$1::bigint",
        "p_ids": "$2::bigint[]",
        "p_fences": "$3::bigint[]",
        "p_kinds": "$4::text[]",
        "p_payloads": "$5::bytea[]",
        "p_errors": "$6::text[]",
        "p_shown": "$7::text[]",
        # (its variables: the worker it hands resumes to and what it hands it, 0033)
        "v_worker": "$8::bigint",
        "v_handed": "$9::bigint[]",
        "v_host": "$10::text",
        "v_pid": "$11::integer",
    },
}

#: The statement of deferral_fire_triggers that chooses the resumes it hands a worker (0033),
#: with its parameters and the variables it reads as ``$n``.
_HANDS_PARAMETERS = {
    "p_triggerer": "$1::bigint",
    "p_ids": "$2::bigint[]",
    "p_fences": "$3::bigint[]",
    "p_kinds": "$4::text[]",
    "v_queues": "$5::text[]",
    "v_free": "$6::bigint",
}

#: The store's statements that run inside a function (queries.sql calls the function, whose
#: EXPLAIN shows only a Function Scan), by the name of the query that calls it (or, for a
#: statement of its own before the one it returns, a name of the plan tests').
FUNCTION_OF = {"fire_triggers": "deferral_fire_triggers", "fire_hands": "deferral_fire_triggers"}


def hands_statement() -> str:
    """The statement of deferral_fire_triggers that reads which resumes of the batch it hands
    a worker (``v_handed``; it runs under the admission's lock, before the fire itself)."""
    return function_statement(
        "deferral_fire_triggers",
        begin="v_handed := ARRAY(",
        end=");\n    END IF;",
        parameters=_HANDS_PARAMETERS,
    )


def function_statement(
    function: str,
    *,
    begin: str = "RETURN QUERY",
    end: str = ";\nEND;",
    parameters: dict[str, str] | None = None,
) -> str:
    """The statement that ``function`` runs (after its lock, for deferral_fire_triggers; or
    the one between ``begin`` and ``end``), taken from schema.sql (which test_store.py holds
    equal to the migrations) with the function's parameters (then its variables) as
    ``$1``.."""
    schema = schema_sql()
    start = schema.index(f"CREATE FUNCTION {function}(")
    body = schema[schema.index(begin, start) + len(begin) :]
    body = body[: body.index(end)]
    names = _PARAMETERS[function] if parameters is None else parameters
    return re.sub(r"\b[pv]_[a-z_]+\b", lambda m: f"({names[m.group(0)]})", body)


def fire_statement() -> str:
    """The fire of ``fire_triggers``: the statement that deferral_fire_triggers runs after
    its lock."""
    return function_statement("deferral_fire_triggers")


def function_settings(function: str) -> dict[str, str]:
    """The settings ``function`` plans its statements with (its ``SET`` clauses, from
    schema.sql), but plan_cache_mode: the plan tests choose custom or generic plans
    themselves."""
    schema = schema_sql()
    start = schema.index(f"CREATE FUNCTION {function}(")
    head = schema[start : schema.index("AS $$", start)]
    head = head[head.index("LANGUAGE") :]
    found = dict(re.findall(r"\bSET\s+(\w+)\s*=\s*(\w+)", head))
    found.pop("plan_cache_mode", None)
    return found
