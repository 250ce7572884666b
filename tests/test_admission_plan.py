"""The admission query's plan, pinned at 100,000 runnable rows, and what its pool-by-pool read
must keep doing.

The admission is the one query inside the PL/pgSQL function ``deferral_claim_tasks``
(migration 0012), which ``claim_tasks`` calls: EXPLAIN of ``claim_tasks`` shows only a
Function Scan. Its text is taken from the function as the database has it
(``pg_get_functiondef``), the function's parameters replaced by values (a custom plan) or by
``$n`` (``EXPLAIN (GENERIC_PLAN)``: the function runs with ``plan_cache_mode =
force_generic_plan``, so this is the plan it uses), and EXPLAINed on a database never
analyzed (the planner's defaults) and on an analyzed copy, as tests/test_query_plans.py does
for the statements of queries.sql.

What the plan must do: read the candidates pool by pool through
``deferral_ti_runnable_pool``, in its order, under a LIMIT (no sort of the runnable rows);
never read ``deferral_task_instances`` whole; count the deferred tasks of an
``include_deferred`` pool through ``deferral_ti_deferred_pool``.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from engine.dags.dag import DAG
from engine.scheduler.dagrecord import record_dags
from engine.store import Store
from engine.store.databases import create_database, drop_database, with_database
from operators.python import PythonOperator
from tests.plans import EXPLAIN_GENERIC, plan_nodes, plan_outline

#: Runnable task instances, spread over POOLS pools: what the admission picks from.
RUNNABLE = 100_000
POOLS = 10
#: Running ones (they fill the pools' slots), deferred ones (counted by an include_deferred
#: pool) and finished ones (the bulk of an old table).
RUNNING = 1_000
DEFERRED = 20_000
FINISHED = 50_000

CANDIDATE_INDEX = "deferral_ti_runnable_pool"
DEFERRED_INDEX = "deferral_ti_deferred_pool"

#: The function's parameters: a value for a custom plan, a type for a generic one.
PARAMETERS = {
    "p_worker": ("1", "bigint"),
    "p_limit": ("16", "integer"),
    "p_queues": ("ARRAY['default']::text[]", "text[]"),
    "p_parallelism": ("0", "integer"),
}

_TABLES = ("deferral_dag_runs", "deferral_task_instances", "deferral_pools")

# Test data only: the query under test is the function's own, from the migration.
_SEED = [
    "INSERT INTO deferral_dag_runs (dag_id, run_id, logical_date) "
    "SELECT 'd', 'r' || g, now() + make_interval(days => g) FROM generate_series(1, 2000) g",
    # Pools p0..p9, 100 slots each; p0 also counts its deferred tasks.
    f"""INSERT INTO deferral_pools (name, slots, include_deferred)
        SELECT 'p' || g, 100, g = 0 FROM generate_series(0, {POOLS - 1}) g""",
    f"""INSERT INTO deferral_task_instances (id, dag_run_id, dag_id, run_id, task_id, state,
            try_number, pool, priority, worker_id, run_after, heartbeat_at)
        SELECT g, 1 + g % 2000, 'd', 'r' || (1 + g % 2000), 't' || g,
               CASE WHEN g <= {RUNNABLE} THEN 'scheduled'
                    WHEN g <= {RUNNABLE + RUNNING} THEN 'running'
                    WHEN g <= {RUNNABLE + RUNNING + DEFERRED} THEN 'deferred'
                    ELSE 'success' END,
               1, 'p' || g % {POOLS}, g % 7,
               CASE WHEN g > {RUNNABLE} AND g <= {RUNNABLE + RUNNING} THEN 1 END,
               now() - interval '1 second', now()
        FROM generate_series(1, {RUNNABLE + RUNNING + DEFERRED + FINISHED}) g""",
    "SELECT setval('deferral_task_instances_id_seq', "
    "(SELECT max(id) FROM deferral_task_instances))",
    "INSERT INTO deferral_workers (id, hostname, pid, slots) VALUES (1, 'h', 1, 16)",
]


async def _build(admin_url: str, template: str, raw: str, analyzed: str) -> None:
    await create_database(admin_url, raw, template=template)
    conn = await asyncpg.connect(with_database(admin_url, raw))
    try:
        for table in _TABLES:  # no statistics may appear behind the tests' backs
            await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        async with conn.transaction():
            for sql in _SEED:
                await conn.execute(sql)
    finally:
        await conn.close()
    await create_database(admin_url, analyzed, template=raw)
    conn = await asyncpg.connect(with_database(admin_url, analyzed))
    try:
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def plan_dbs(admin_url: str, template_db: str) -> Iterator[dict[str, str]]:
    """``{"raw": url, "analyzed": url}``: the same 100,000 runnable rows, without and with
    statistics."""
    suffix = uuid.uuid4().hex[:12]
    names = {"raw": f"t_adm_raw_{suffix}", "analyzed": f"t_adm_stats_{suffix}"}
    try:
        asyncio.run(_build(admin_url, template_db, names["raw"], names["analyzed"]))
        yield {kind: with_database(admin_url, name) for kind, name in names.items()}
    finally:
        for name in names.values():
            asyncio.run(drop_database(admin_url, name))


def admission_query(function_sql: str, *, generic: bool) -> str:
    """The query of ``RETURN QUERY`` in the function's definition, its parameters replaced by
    values, or (``generic``) by ``$1``, ``$2``... numbered as they first appear."""
    found = re.search(r"RETURN QUERY\s+(.*?);\s*END;?\s*\$", function_sql, re.S)
    assert found, f"no RETURN QUERY in deferral_claim_tasks:\n{function_sql}"
    query = found.group(1)
    numbers: dict[str, int] = {}

    def replace(match: re.Match[str]) -> str:
        name = match.group(0)
        value, type_ = PARAMETERS[name]
        if not generic:
            return f"({value})"
        number = numbers.setdefault(name, len(numbers) + 1)
        return f"${number}::{type_}"

    query = re.sub(r"\b(" + "|".join(PARAMETERS) + r")\b", replace, query)
    return query


async def _explain(url: str, *, generic: bool) -> dict[str, Any]:
    conn = await asyncpg.connect(url)
    try:
        stats = await conn.fetchval(
            "SELECT count(*) FROM pg_stats WHERE tablename = 'deferral_task_instances'"
        )
        definition = await conn.fetchval(
            "SELECT pg_get_functiondef('deferral_claim_tasks'::regproc)"
        )
        query = admission_query(definition, generic=generic)
        # The function's own settings (SET clauses) hold while its query is planned.
        for setting in (
            await conn.fetchval(
                "SELECT proconfig FROM pg_proc WHERE proname = 'deferral_claim_tasks'"
            )
            or []
        ):
            name, value = setting.split("=", 1)
            if name != "plan_cache_mode":
                await conn.execute(f"SET {name} = {value}")
        if generic:
            # Through the simple path of a PL/pgSQL EXECUTE: the extended protocol would ask
            # for values of the parameters that a generic plan leaves open.
            await conn.execute(EXPLAIN_GENERIC)
            text = await conn.fetchval("SELECT pg_temp.explain_generic($1)", query)
        else:
            await conn.execute("SET plan_cache_mode = force_custom_plan")
            text = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {query}")
    finally:
        await conn.close()
    plan: dict[str, Any] = json.loads(text)[0]["Plan"]
    plan["_has_statistics"] = stats > 0
    return plan


def _candidate_reads(plan: dict[str, Any]) -> list[list[str]]:
    """For each read of the candidates (the scan of ``deferral_task_instances ti``), the node
    types from the closest LIMIT above it down to it; empty if no LIMIT is above it."""
    reads: list[list[str]] = []

    def walk(node: dict[str, Any], above: list[str]) -> None:
        path = [*above, node["Node Type"]]
        if node.get("Relation Name") == "deferral_task_instances" and node.get("Alias") == "ti":
            limits = [i for i, kind in enumerate(path) if kind == "Limit"]
            reads.append(path[limits[-1] :] if limits else [])
        for child in node.get("Plans", []):
            walk(child, path)

    walk(plan, [])
    return reads


#: What may stand between the LIMIT and the ordered index scan of the candidates.
_PASS_THROUGH = {"LockRows", "Subquery Scan"}


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize("stats", ["raw", "analyzed"])
def test_admission_reads_candidates_by_pool_in_index_order_at_100k_runnable_rows(
    plan_dbs: dict[str, str], stats: str, generic: bool
) -> None:
    plan = asyncio.run(_explain(plan_dbs[stats], generic=generic))
    assert plan.pop("_has_statistics") is (stats == "analyzed")
    outline = plan_outline(plan)
    nodes = list(plan_nodes(plan))
    reads = _candidate_reads(plan)
    assert reads, f"no read of the candidates:\n{outline}"
    for path in reads:
        # LIMIT -> (LockRows) -> Index Scan: in the index's order, stopping at the limit; a
        # Sort or a join in between reads every runnable row of the pool.
        ordered = len(path) >= 2 and path[-1] == "Index Scan" and set(path[1:-1]) <= _PASS_THROUGH
        assert ordered, f"the candidates are not read in index order under a LIMIT:\n{outline}"
    scans = [n for n in nodes if n.get("Alias") == "ti"]
    assert {n.get("Index Name") for n in scans} == {CANDIDATE_INDEX}, outline
    seq = [n["Relation Name"] for n in nodes if n["Node Type"] == "Seq Scan"]
    assert "deferral_task_instances" not in seq, f"a big table is read whole:\n{outline}"
    used = {n["Index Name"] for n in nodes if "Index Name" in n}
    assert DEFERRED_INDEX in used, f"the deferred count does not use {DEFERRED_INDEX}:\n{outline}"


def test_the_function_runs_its_query_with_a_generic_plan(plan_dbs: dict[str, str]) -> None:
    # The plan the generic case pins is the one the function uses: a custom plan per call was
    # measured (bench claims) to cost more than the query it plans, under the admission lock.
    async def config() -> list[str] | None:
        conn = await asyncpg.connect(plan_dbs["raw"])
        try:
            value: list[str] | None = await conn.fetchval(
                "SELECT proconfig FROM pg_proc WHERE proname = 'deferral_claim_tasks'"
            )
            return value
        finally:
            await conn.close()

    assert "plan_cache_mode=force_generic_plan" in (asyncio.run(config()) or [])


# -- what the read pool by pool must keep doing ----------------------------------------------


def _noop() -> None:
    """Never runs: the tasks are only claimed."""


async def _claim_ids(store: Store, worker_id: int, limit: int) -> set[str]:
    """Claim as a worker does: what the claim refuses is written as failed."""
    claim = await store.claim_tasks(worker_id, limit)
    if claim.refused:
        await store.finish_tasks(claim.refused)
    return {c.task_id for c in claim.claimed}


@pytest.mark.anyio
async def test_a_full_pool_ahead_holds_back_only_its_own_tasks(store: Store) -> None:
    # Ten high-priority tasks in a pool of one slot, three of low priority in a pool of two,
    # and one naming a pool that does not exist: one claim admits the first task of the full
    # pool, the first two of the other (behind every task of the full pool in claim order),
    # and the task of the missing pool, which the claim refuses (failed, naming it).
    await store.set_pool("narrow", 1)
    await store.set_pool("wide", 2)
    with DAG(dag_id="adm", fileloc=__file__) as dag:
        for i in range(10):
            PythonOperator(
                task_id=f"n{i}", python_callable=_noop, pool="narrow",
                priority_weight=100 - i, weight_rule="absolute",
            )  # fmt: skip
        for i in range(3):
            PythonOperator(
                task_id=f"w{i}", python_callable=_noop, pool="wide",
                priority_weight=10 - i, weight_rule="absolute",
            )  # fmt: skip
        PythonOperator(task_id="lost", python_callable=_noop, pool="nowhere")
    await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
    await store.create_dag_run("adm", "r1", logical_date=dt.datetime.now(dt.UTC))
    worker = await store.register_worker("h", 1, 16)

    assert await _claim_ids(store, worker, 16) == {"n0", "w0", "w1"}
    # Every pool full now: nothing more, whatever the limit.
    assert await _claim_ids(store, worker, 16) == set()
    tis = {ti.task_id: ti for ti in await store.list_task_instances(dag_id="adm")}
    assert tis["lost"].state == "failed"
    assert "nowhere" in (tis["lost"].error or "")
    assert sorted(t for t, ti in tis.items() if ti.state == "scheduled") == [
        *(f"n{i}" for i in range(1, 10)),
        "w2",
    ]
    # A slot more in the narrow pool admits its next task, in priority order.
    await store.set_pool("narrow", 2)
    assert await _claim_ids(store, worker, 16) == {"n1"}


@pytest.mark.anyio
async def test_one_claim_holds_each_dag_and_task_to_its_own_limit_counting_what_runs(
    store: Store,
) -> None:
    # One claim sees candidates of a DAG with a max_active_tasks, of a task with a
    # max_active_tis_per_dag and of neither, with tries of the limited ones already running
    # (claimed before): each limit admits exactly its room, counting what runs, and what has
    # no limit is all admitted. (The admission counts the running tries once per claim, by
    # DAG and by task, for the limited ones only.)
    with DAG(dag_id="capped", fileloc=__file__, max_active_tasks=3) as capped:
        for i in range(5):
            PythonOperator(
                task_id=f"c{i}", python_callable=_noop,
                priority_weight=100 - i, weight_rule="absolute",
            )  # fmt: skip
    with DAG(dag_id="pertask", fileloc=__file__) as pertask:
        PythonOperator(
            task_id="two", python_callable=_noop, max_active_tis_per_dag=2,
            priority_weight=50, weight_rule="absolute",
        )  # fmt: skip
        PythonOperator(task_id="free", python_callable=_noop, weight_rule="absolute")
    with DAG(dag_id="open", fileloc=__file__) as open_dag:
        for i in range(4):
            PythonOperator(task_id=f"o{i}", python_callable=_noop, weight_rule="absolute")
    await record_dags(store, [capped, pertask, open_dag])
    for dag in (capped, pertask, open_dag):
        for run in ("r1", "r2", "r3"):
            await store.create_dag_run(dag.dag_id, run, logical_date=await store.now())
    worker = await store.register_worker("h", 1, 64)

    async def claim(limit: int) -> collections.Counter[tuple[str, str]]:
        got = (await store.claim_tasks(worker, limit)).claimed
        return collections.Counter((c.dag_id, c.task_id.rstrip("0123456789")) for c in got)

    # The two highest priorities first: two tries of the capped DAG now run.
    assert await claim(2) == {("capped", "c"): 2}
    # Room left: one of the capped DAG, two of the limited task, all of the rest.
    assert await claim(64) == {
        ("capped", "c"): 1,
        ("pertask", "two"): 2,
        ("pertask", "free"): 3,
        ("open", "o"): 12,
    }
    assert await claim(64) == {}
    states = collections.Counter(
        (ti.dag_id, ti.state) for ti in await store.list_task_instances(limit=100)
    )
    assert states[("capped", "running")] == 3
    assert states[("capped", "scheduled")] == 12
