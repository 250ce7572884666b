"""The plans of the hot queries, pinned at 100,000 waiting rows (as pgqueuer pins its own).

Comments in ``queries.sql`` record plans that went quadratic or picked the wrong index: a
generic plan that read every trigger a triggerer owns through the owner index for each batch,
a nested loop joining the two CTEs of ``fire_triggers``. These tests EXPLAIN each statement
on tables of realistic size and assert on the JSON plan: the intended indexes are used, no
big table is read whole, and the two CTEs of ``fire_triggers`` are never joined in a nested
loop. Each statement is planned four ways: with values (a custom plan) and as a generic plan
(``EXPLAIN (GENERIC_PLAN)``, what a prepared statement may switch to), each on a database
never analyzed (no statistics: the planner's defaults) and on an analyzed copy.

The data is built once per module with ``INSERT ... SELECT generate_series`` in two databases
copied from the test template: ``raw`` (autovacuum off, so no statistics appear mid-test) and
``analyzed`` (a copy of ``raw``, then ``ANALYZE``). Plans, not timings, are asserted.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from engine.store.databases import create_database, drop_database, with_database
from engine.store.queries import load_queries
from tests.plans import (
    EXPLAIN_GENERIC,
    FUNCTION_OF,
    function_settings,
    function_statement,
    hands_statement,
    plan_nodes,
    plan_outline,
)

#: Deferred task instances, each waiting on a trigger of its own (owned by a triggerer).
WAITING = 100_000
#: Finished task instances next to them (the bulk of an old table).
FINISHED = 50_000
#: Runnable, running and unowned rows: the few each hot statement is after.
RUNNABLE = 1_000
RUNNING = 1_000
UNOWNED = 1_000
#: Outcomes in one fire_triggers / finish_tasks batch, as the triggerer and worker send them.
BATCH = 1_000

#: Log lines of triggers and of task tries (their reads and the retention's deletes).
LOG_LINES = 100_000

#: Scheduled DAGs, each with finished runs and none queued (statistics taken between two
#: minutes of bench schedule), and how many of them start_queued_runs is given (a due batch).
SCHEDULED_DAGS = 1_000
RUNS_PER_DAG = 20
DUE = 500

BIG_TABLES = (
    "deferral_task_instances",
    "deferral_triggers",
    "deferral_trigger_logs",
    "deferral_task_logs",
)

# Test data only: the statements under test are the store's own, from queries.sql.
_SEED = [
    "INSERT INTO deferral_dag_runs (dag_id, run_id, logical_date) "
    "SELECT 'd', 'r' || g, now() + make_interval(days => g) FROM generate_series(1, 2000) g",
    "INSERT INTO deferral_triggerers (id, hostname, pid, capacity, lease_expires_at) "
    "VALUES (1, 'h', 1, 200000, now() + interval '1 day')",
    # Triggers 1..WAITING are owned by triggerer 1; the next UNOWNED wait for a claim.
    f"""INSERT INTO deferral_triggers (id, classpath, kwargs, dedup_key, triggerer_id, fence,
                                       timeout_at)
        SELECT g, 'tests.triggers_for_tests.NeverTrigger', '\\x80'::bytea, md5(g::text),
               CASE WHEN g <= {WAITING} THEN 1 END, 1, now() + interval '1 day'
        FROM generate_series(1, {WAITING + UNOWNED}) g""",
    "SELECT setval('deferral_triggers_id_seq', (SELECT max(id) FROM deferral_triggers))",
    # Task instances 1..WAITING wait on trigger g; then finished, runnable and running ones.
    f"""INSERT INTO deferral_task_instances (id, dag_run_id, dag_id, run_id, task_id, state,
            try_number, trigger_id, trigger_timeout_at, next_method, worker_id, run_after,
            heartbeat_at)
        SELECT g, 1 + g % 2000, 'd', 'r' || (1 + g % 2000), 't' || g,
               CASE WHEN g <= {WAITING} THEN 'deferred'
                    WHEN g <= {WAITING + FINISHED} THEN 'success'
                    WHEN g <= {WAITING + FINISHED + RUNNABLE} THEN 'scheduled'
                    ELSE 'running' END,
               1,
               CASE WHEN g <= {WAITING} THEN g END,
               CASE WHEN g <= {WAITING} THEN now() + interval '1 day' END,
               CASE WHEN g <= {WAITING} THEN 'resume' END,
               CASE WHEN g > {WAITING + FINISHED + RUNNABLE} THEN 1 END,
               now() - interval '1 second',
               now()
        FROM generate_series(1, {WAITING + FINISHED + RUNNABLE + RUNNING}) g""",
    "SELECT setval('deferral_task_instances_id_seq', "
    "(SELECT max(id) FROM deferral_task_instances))",
    "INSERT INTO deferral_workers (id, hostname, pid, slots) VALUES (1, 'h', 1, 16)",
    f"""INSERT INTO deferral_dags (dag_id, fileloc, tasks, timetable, schedule)
        SELECT 's' || g, '/dags/s.py',
               '[{{"task_id": "t0", "upstream": [], "trigger_rule": "all_success",
                   "retries": 0, "retry_delay_s": 300.0, "is_leaf": true, "priority": 1,
                   "pool": "default_pool", "pool_slots": 1}}]'::jsonb,
               '{{"kind": "cron", "expression": "* * * * *"}}'::jsonb, '* * * * *'
        FROM generate_series(1, {SCHEDULED_DAGS}) g""",
    f"""INSERT INTO deferral_dag_runs (dag_id, run_id, logical_date, data_interval_start,
                                       data_interval_end, run_type, state, started_at,
                                       ended_at)
        SELECT 's' || g, 'scheduled__' || n, now() - make_interval(mins => n),
               now() - make_interval(mins => n), now() - make_interval(mins => n - 1),
               'scheduled', 'success', now(), now()
        FROM generate_series(1, {SCHEDULED_DAGS}) g, generate_series(1, {RUNS_PER_DAG}) n""",
    # Log lines: 100 lines each for 1,000 triggers and 1,000 task tries, oldest first.
    f"""INSERT INTO deferral_trigger_logs (trigger_id, at, level, logger, message)
        SELECT 1 + g % 1000, now() - make_interval(secs => {LOG_LINES} - g), 'INFO', 'x',
               'line ' || g
        FROM generate_series(1, {LOG_LINES}) g""",
    f"""INSERT INTO deferral_task_logs (dag_id, run_id, task_id, try_number, at, level, stream,
                                        logger, message)
        SELECT 'd', 'r' || (1 + g % 2000), 't' || (g % 1000), 1,
               now() - make_interval(secs => {LOG_LINES} - g), 'INFO', 'log', 'x', 'line ' || g
        FROM generate_series(1, {LOG_LINES}) g""",
]

_FIRST_RUNNING = WAITING + FINISHED + RUNNABLE + 1


def _arguments() -> dict[str, tuple[Any, ...]]:
    """Values for a custom plan of each statement: a full batch where there is one."""
    fired = list(range(1, BATCH + 1))
    running = list(range(_FIRST_RUNNING, _FIRST_RUNNING + min(BATCH, RUNNING)))
    return {
        "claim_tasks": (1, 16, ["default"], 0),
        "claim_triggers": (1, BATCH),
        "lock_owned_triggers": (1, fired),
        "fire_triggers": (
            1,
            fired,
            [1] * len(fired),
            ["event"] * len(fired),
            [b"\x80"] * len(fired),
            [None] * len(fired),
            ['{"at":"2026-12-02T00:00:00Z"}'] * len(fired),
            1,  # (a worker the resumes are handed to, as a fleet's fires hand them)
            [ti for ti in fired if ti % 2],
            "host",
            7,
        ),
        # (a batch's resumes handed to a worker of 16 free slots, 0033)
        "fire_hands": (1, fired, [1] * len(fired), ["event"] * len(fired), ["default"], 16),
        "finish_tasks": (
            running,
            [1] * len(running),
            ["success"] * len(running),
            [b"\x80"] * len(running),
            [None] * len(running),
            [False] * len(running),
            [1] * len(running),
            None,
            [running[0]],  # (a branch's success skips a task of its run)
            ["t1"],
        ),
        # (timeout_deferrals is not in the list; pinned too, as the triggerer's timers
        # end deferrals with it by trigger id, and the scheduler's backstop by deadline.)
        "timeout_deferrals": (fired, 0.0),
        "timeout_deferrals_backstop": (None, 5.0),
        "trigger_logs": (7, 0, 1000),
        "task_logs": ("d", "r8", "t7", None, 0, 1000),
        "task_try": ("d", "r8", "t7"),
        "task_tries": ("d", "r8", "t7"),
        "task_map_indexes": ("d", "r8", "t7"),
        "xcom_of_task": ("d", "r8", "t7", -1),
        "insert_trigger_logs": ([7], [0.0], ["INFO"], ["x"], ["m"], [7]),
        "trigger_log_bytes": (list(range(1, BATCH + 1)),),
        "task_log_bytes": (["d"] * 2, ["r8", "r9"], ["t7", "t8"], [1, 1]),
        "start_queued_runs": ([f"s{g}" for g in range(1, DUE + 1)],),
        "delete_old_trigger_logs": (86400.0, 1000, 0),
        "delete_old_task_logs": (86400.0, 1000, 0),
        # (a batch of deferrals, every other one sharing its trigger with the one before)
        "defer_tasks": (
            running,
            1,
            ["tests.triggers_for_tests.NeverTrigger"] * len(running),
            [b"\x80"] * len(running),
            [hashlib.sha256(f"new{i // 2}".encode()).hexdigest() for i in range(len(running))],
            [3600.0] * len(running),
            ["resume"] * len(running),
            [b"\x80"] * len(running),
            [1] * len(running),
            ["deferred"] * len(running),
        ),
    }


#: A run's task instances: by the unique key (dag_run_id, task_id, map_index) or by
#: (dag_run_id, state), both led by the run.
_RUN_TASKS = {"deferral_task_instances_dag_run_id_task_id_map_index_key", "deferral_ti_run_state"}

#: For each statement, the indexes its plan must use: every group, by one index of the group.
INTENDED: dict[str, list[set[str]]] = {
    # (The admission inside deferral_claim_tasks is pinned by test_admission_plan.py.)
    "claim_tasks": [{"deferral_task_instances_pkey"}],
    "claim_triggers": [{"deferral_triggers_unowned"}, {"deferral_triggers_pkey"}],
    "lock_owned_triggers": [{"deferral_triggers_pkey"}],
    "fire_triggers": [{"deferral_triggers_pkey"}, {"deferral_ti_trigger"}],
    # The resumes a fire hands a worker: the batch's triggers and their tasks as the fire
    # reads them, each task's DAG by its key (deferral_dags is not read whole for a batch).
    "fire_hands": [
        {"deferral_triggers_pkey"},
        {"deferral_ti_trigger"},
        {"deferral_dags_pkey"},
    ],
    # By id, or by one read of the running tasks (the comment in finish_tasks): both are fine.
    # (deferral_ti_busy, of the running and queued tasks, is such a read too.)
    "finish_tasks": [{"deferral_task_instances_pkey", "deferral_ti_running", "deferral_ti_busy"}],
    "defer_tasks": [{"deferral_task_instances_pkey"}],
    "timeout_deferrals": [{"deferral_ti_trigger", "deferral_ti_deferral_deadline"}],
    "timeout_deferrals_backstop": [{"deferral_ti_deferral_deadline"}],
    # The logs: read by trigger or try (the CLI, the status page), deleted oldest first.
    "trigger_logs": [{"deferral_trigger_logs_trigger"}],
    "task_logs": [{"deferral_task_logs_try"}, _RUN_TASKS],
    # The statements that name a task instance by its DAG, run and task: the run by its
    # names, then its task instances (migration 0031 dropped deferral_ti_names).
    "task_try": [{"deferral_dag_runs_dag_id_run_id_key"}, _RUN_TASKS],
    "task_tries": [{"deferral_dag_runs_dag_id_run_id_key"}, _RUN_TASKS],
    "task_map_indexes": [{"deferral_dag_runs_dag_id_run_id_key"}, _RUN_TASKS],
    "xcom_of_task": [{"deferral_dag_runs_dag_id_run_id_key"}, _RUN_TASKS],
    "insert_trigger_logs": [{"deferral_ti_trigger"}],
    # What a trigger or try stored before (its total), read once per process that writes
    # its lines (engine/usercode/logsink.py): by trigger, by try.
    "trigger_log_bytes": [{"deferral_trigger_logs_trigger"}],
    "task_log_bytes": [{"deferral_task_logs_try"}],
    "delete_old_trigger_logs": [{"deferral_trigger_logs_pkey"}],
    "delete_old_task_logs": [{"deferral_task_logs_pkey"}],
    # A batch of due DAGs: the queued runs of each by the active runs' index, the ones to
    # start by id (test_start_queued_runs_picks_the_runs_once: picked once).
    "start_queued_runs": [{"deferral_dag_runs_active"}, {"deferral_dag_runs_pkey"}],
}

#: Plan variants: another set of values for a statement of another name.
_STATEMENT = {"timeout_deferrals_backstop": "timeout_deferrals"}

#: Indexes that must never be the inner side of a nested loop (looked up once per outcome):
#: the generic plan the comment in finish_tasks records.
NEVER_PER_ROW: dict[str, set[str]] = {
    "finish_tasks": {"deferral_ti_running", "deferral_ti_busy"},
    "fire_triggers": {"deferral_triggers_owner"},
    "lock_owned_triggers": {"deferral_triggers_owner"},
}


async def _build(admin_url: str, template: str, raw: str, analyzed: str) -> None:
    await create_database(admin_url, raw, template=template)
    conn = await asyncpg.connect(_url(admin_url, raw))
    try:
        # No statistics may appear behind the tests' backs: autovacuum off on every table
        # (a list of them missed the log tables, which autovacuum then analyzed mid-module).
        tables = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        for row in tables:
            await conn.execute(f"ALTER TABLE {row['tablename']} SET (autovacuum_enabled = false)")
        async with conn.transaction():
            for sql in _SEED:
                await conn.execute(sql)
    finally:
        await conn.close()
    await create_database(admin_url, analyzed, template=raw)
    conn = await asyncpg.connect(_url(admin_url, analyzed))
    try:
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


def _url(admin_url: str, name: str) -> str:
    return with_database(admin_url, name)


@pytest.fixture(scope="module")
def plan_dbs(admin_url: str, template_db: str) -> Iterator[dict[str, str]]:
    """``{"raw": url, "analyzed": url}``: the same 100,000 waiting rows, without and with
    statistics."""
    suffix = uuid.uuid4().hex[:12]
    names = {"raw": f"t_plans_raw_{suffix}", "analyzed": f"t_plans_stats_{suffix}"}
    try:
        asyncio.run(_build(admin_url, template_db, names["raw"], names["analyzed"]))
        yield {kind: _url(admin_url, name) for kind, name in names.items()}
    finally:
        for name in names.values():
            asyncio.run(drop_database(admin_url, name))


async def _explain(url: str, name: str, *, generic: bool) -> dict[str, Any]:
    function = FUNCTION_OF.get(name)
    if name == "fire_hands":
        sql = hands_statement()
    elif function:
        sql = function_statement(function)
    else:
        sql = load_queries()[_STATEMENT.get(name, name)]
    conn = await asyncpg.connect(url)
    try:
        stats = await conn.fetchval(
            "SELECT count(*) FROM pg_stats WHERE tablename = ANY ($1::text[])", list(BIG_TABLES)
        )
        if function:
            # (planned as its function plans it: with the settings of its SET clauses)
            for setting, value in function_settings(function).items():
                await conn.execute(f"SET {setting} = {value}")
        if generic:
            # Through the simple path of a PL/pgSQL EXECUTE: the extended protocol would ask
            # for values of the parameters that a generic plan leaves open.
            await conn.execute(EXPLAIN_GENERIC)
            text = await conn.fetchval("SELECT pg_temp.explain_generic($1)", sql)
        else:
            await conn.execute("SET plan_cache_mode = force_custom_plan")
            text = await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *_arguments()[name])
    finally:
        await conn.close()
    plan: dict[str, Any] = json.loads(text)[0]["Plan"]
    plan["_has_statistics"] = stats > 0
    return plan


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize("stats", ["raw", "analyzed"])
@pytest.mark.parametrize("name", sorted(INTENDED))
def test_hot_statements_use_their_index_at_100k_waiting_rows(
    plan_dbs: dict[str, str], name: str, stats: str, generic: bool
) -> None:
    plan = asyncio.run(_explain(plan_dbs[stats], name, generic=generic))
    assert plan.pop("_has_statistics") is (stats == "analyzed")
    outline = plan_outline(plan)
    nodes = list(plan_nodes(plan))
    used = {n["Index Name"] for n in nodes if "Index Name" in n}
    missing = [sorted(group) for group in INTENDED[name] if not group & used]
    assert not missing, f"{name} uses none of {missing}:\n{outline}"
    for node in nodes:
        if node["Node Type"] == "Nested Loop":
            inner = node["Plans"][1]
            looked_up = {n.get("Index Name") for n in plan_nodes(inner)}
            per_row = looked_up & NEVER_PER_ROW.get(name, set())
            assert not per_row, f"{name} looks up {per_row} once per row:\n{outline}"
    seq = [n["Relation Name"] for n in nodes if n["Node Type"] == "Seq Scan"]
    assert not set(seq) & set(BIG_TABLES), f"{name} reads a big table whole:\n{outline}"
    if name == "fire_hands":
        # (under the admission's lock, for every batch: a join read every DAG, 0033)
        assert "deferral_dags" not in seq, f"{name} reads every DAG:\n{outline}"


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize("stats", ["raw", "analyzed"])
def test_fire_triggers_never_joins_its_two_ctes_in_a_nested_loop(
    plan_dbs: dict[str, str], stats: str, generic: bool
) -> None:
    # The planner estimates one row for each CTE; a join of the two (rather than the UNION
    # ALL) ran as a nested loop, quadratic in the batch.
    plan = asyncio.run(_explain(plan_dbs[stats], "fire_triggers", generic=generic))
    plan.pop("_has_statistics")
    for node in plan_nodes(plan):
        children = node.get("Plans", [])
        ctes = [c for c in children if c["Node Type"] == "CTE Scan"]
        assert not (node["Node Type"] == "Nested Loop" and len(ctes) >= 2), (
            f"fire_triggers joins {[c['CTE Name'] for c in ctes]} in a nested loop:\n"
            + plan_outline(plan)
        )


#: Rows the first deferrals of a fleet bring, after statistics taken while none waited.
FIRST_WAITS = 1_000


async def _build_first_waits(admin_url: str, template: str, name: str) -> None:
    # Statistics of runnable and finished tasks alone (as a benchmark's ANALYZE sees them, or
    # a fleet's before its sensors first defer), then triggers and tasks waiting on them.
    await create_database(admin_url, name, template=template)
    conn = await asyncpg.connect(_url(admin_url, name))
    try:
        tables = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        for row in tables:
            await conn.execute(f"ALTER TABLE {row['tablename']} SET (autovacuum_enabled = false)")
        await conn.execute(
            "INSERT INTO deferral_dag_runs (id, dag_id, run_id, logical_date) "
            "VALUES (1, 'd', 'r1', now())"
        )
        await conn.execute(
            "INSERT INTO deferral_triggerers (id, hostname, pid, capacity, lease_expires_at) "
            "VALUES (1, 'h', 1, 200000, now() + interval '1 day')"
        )
        await conn.execute(
            """INSERT INTO deferral_task_instances (dag_run_id, dag_id, run_id, task_id, state,
                   try_number)
               SELECT 1, 'd', 'r1', 't' || g, CASE WHEN g % 2 = 0 THEN 'success'
                                                  ELSE 'scheduled' END, 1
               FROM generate_series(1, 10000) g"""
        )
        await conn.execute("ANALYZE")
        await conn.execute(
            f"""INSERT INTO deferral_triggers (id, classpath, kwargs, dedup_key, triggerer_id,
                                               fence)
                SELECT g, 'tests.triggers_for_tests.NeverTrigger', '\\x80'::bytea, md5(g::text),
                       1, 1
                FROM generate_series(1, {FIRST_WAITS}) g"""
        )
        await conn.execute(
            f"""INSERT INTO deferral_task_instances (dag_run_id, dag_id, run_id, task_id, state,
                   try_number, trigger_id, next_method)
                SELECT 1, 'd', 'r1', 'w' || g, 'deferred', 1, g, 'resume'
                FROM generate_series(1, {FIRST_WAITS}) g"""
        )
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def first_waits_db(admin_url: str, template_db: str) -> Iterator[str]:
    """A database whose statistics were taken before any task waited, with 1,000 tasks
    waiting now."""
    name = f"t_plans_first_{uuid.uuid4().hex[:12]}"
    try:
        asyncio.run(_build_first_waits(admin_url, template_db, name))
        yield _url(admin_url, name)
    finally:
        asyncio.run(drop_database(admin_url, name))


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_fire_triggers_is_linear_after_statistics_of_no_waiting_task(
    first_waits_db: str, generic: bool
) -> None:
    # Statistics taken while no task waited estimate one trigger and one waiting task: the
    # plan of the fire joined the outcomes with the triggers, and the fired triggers with
    # their tasks, in nested loops that scanned the outcomes (a function scan) and the fired
    # triggers (a CTE scan) again for each row: quadratic in the batch (migration 0031).
    plan = asyncio.run(_explain(first_waits_db, "fire_triggers", generic=generic))
    plan.pop("_has_statistics")
    rescanned = [
        node.get("CTE Name", node["Node Type"])
        for node, again in _per_row(plan)
        if again and node["Node Type"] in ("CTE Scan", "Function Scan", "Seq Scan", "Materialize")
    ]
    assert not rescanned, f"fire_triggers scans {rescanned} once per row:\n{plan_outline(plan)}"


def _per_row(plan: dict[str, Any], repeated: bool = False) -> Iterator[tuple[dict[str, Any], bool]]:
    """Each node, and whether it runs again for each row of a node above it: under the inner
    side of a nested loop or in a correlated subplan, and not under an InitPlan (run once)."""
    yield plan, repeated
    for child in plan.get("Plans", []):
        relationship = child.get("Parent Relationship")
        if relationship == "InitPlan":
            again = False
        elif relationship == "SubPlan":
            again = True
        else:
            again = repeated or (plan["Node Type"] == "Nested Loop" and relationship == "Inner")
        yield from _per_row(child, again)


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
@pytest.mark.parametrize("stats", ["raw", "analyzed"])
def test_start_queued_runs_picks_the_runs_once(
    plan_dbs: dict[str, str], stats: str, generic: bool
) -> None:
    # Statistics taken while no run was queued estimate one queued run: the runs to start were
    # joined to the queued runs in a nested loop that picked them again for each queued run
    # (the UNION ALL of picked under its inner side), quadratic in a batch of due DAGs.
    plan = asyncio.run(_explain(plan_dbs[stats], "start_queued_runs", generic=generic))
    plan.pop("_has_statistics")
    picks = [again for node, again in _per_row(plan) if node["Node Type"] == "Append"]
    assert picks == [False], f"start_queued_runs picks its runs per row:\n{plan_outline(plan)}"
