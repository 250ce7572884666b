"""The schema: schema.sql is what the migrations build, and migrating is idempotent and safe to
run from several processes at once."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import asyncpg
import pytest

from engine import DAG
from engine.dags.dagbag import DagBag
from engine.store import ClaimedTask, Deferral, Store, TaskClaim, TaskOutcome
from engine.store.databases import create_database, drop_database
from engine.store.queries import load_queries, migrations, schema_sql
from engine.worker.recorder import _Queued
from engine.worker.worker import Worker
from operators.python import PythonOperator
from tests.helpers import wait_until
from tests.triggers_for_tests import NeverTrigger
from triggers.base import encode_value, validate_trigger

pytestmark = pytest.mark.anyio

MIGRATIONS_TABLE = "deferral_migrations"

#: Catalog queries, each returning rows that describe one aspect of the public schema.
_CATALOG: dict[str, str] = {
    "columns": """
        SELECT c.relname AS table, a.attnum AS position, a.attname AS column,
               format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull AS not_null,
               pg_get_expr(d.adbin, d.adrelid) AS default, a.attidentity AS identity,
               a.attgenerated AS generated
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm')
          AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY 1, 2""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'public' ORDER BY 1, 2""",
    "constraints": """
        SELECT c.relname AS table, k.conname, k.contype, pg_get_constraintdef(k.oid) AS def
        FROM pg_constraint k
        JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' ORDER BY 1, 2""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid) AS args,
               pg_get_functiondef(p.oid) AS def
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'public' ORDER BY 1, 2""",
    "sequences": """
        SELECT sequencename, data_type::text, start_value, increment_by, max_value, cycle
        FROM pg_sequences WHERE schemaname = 'public' ORDER BY 1""",
    "relations": """
        SELECT c.relname, c.relkind::text FROM pg_class c
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' ORDER BY 1""",
    "views": """
        SELECT viewname, definition FROM pg_views WHERE schemaname = 'public' ORDER BY 1""",
    "comments": """
        SELECT c.relname, obj_description(c.oid, 'pg_class') AS comment FROM pg_class c
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND obj_description(c.oid, 'pg_class') IS NOT NULL
        ORDER BY 1""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid) AS def
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'public' AND NOT t.tgisinternal ORDER BY 1, 2""",
}


async def catalog(url: str, *, without: str | None = None) -> dict[str, list[tuple[Any, ...]]]:
    """Describe the public schema of a database (leaving out the relations of table
    ``without`` and its sequences and indexes)."""
    conn = await asyncpg.connect(url)
    try:
        dump: dict[str, list[tuple[Any, ...]]] = {}
        for aspect, sql in _CATALOG.items():
            rows = [tuple(r) for r in await conn.fetch(sql)]
            if without is not None:
                rows = [r for r in rows if not str(r[0]).startswith(without)]
            dump[aspect] = rows
        return dump
    finally:
        await conn.close()


EmptyDb = Callable[[], Awaitable[str]]


@pytest.fixture
async def empty_db(admin_url: str) -> AsyncIterator[EmptyDb]:
    """Make empty databases (no schema) on the test server; dropped after the test."""
    names: list[str] = []

    async def make() -> str:
        name = f"t_empty_{uuid.uuid4().hex[:12]}"
        url = await create_database(admin_url, name)
        names.append(name)
        return url

    try:
        yield make
    finally:
        for name in names:
            await drop_database(admin_url, name)


async def _execute(url: str, *scripts: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for script in scripts:
            await conn.execute(script)
    finally:
        await conn.close()


async def test_the_schema_file_equals_the_migrations_applied_in_order(empty_db: EmptyDb) -> None:
    from_schema, from_migrations = await empty_db(), await empty_db()
    await _execute(from_schema, schema_sql())
    found = migrations()
    assert [version for version, _, _ in found] == list(range(1, len(found) + 1))
    await _execute(from_migrations, *(sql for _, _, sql in found))

    expected = await catalog(from_schema)
    got = await catalog(from_migrations)
    assert expected["columns"], "the catalog dump is empty: the comparison would prove nothing"
    assert {r[0] for r in expected["relations"]} >= {
        "deferral_dags",
        "deferral_dag_runs",
        "deferral_task_instances",
        "deferral_triggers",
        "deferral_triggerers",
        "deferral_workers",
    }
    for aspect in _CATALOG:
        assert got[aspect] == expected[aspect], f"schema.sql and the migrations differ in {aspect}"


async def test_the_catalog_comparison_notices_a_difference(empty_db: EmptyDb) -> None:
    """The dump is sensitive enough: a changed default, an extra index, a changed function."""
    base, changed = await empty_db(), await empty_db()
    await _execute(base, schema_sql())
    await _execute(changed, schema_sql())
    before = await catalog(changed)
    assert before == await catalog(base)
    await _execute(
        changed,
        "ALTER TABLE deferral_workers ALTER COLUMN slots SET DEFAULT 1",
        "CREATE INDEX extra ON deferral_workers (pid)",
        "CREATE OR REPLACE FUNCTION deferral_fail_state(try_number integer, retries integer) "
        "RETURNS text LANGUAGE sql IMMUTABLE AS $$ SELECT 'failed' $$",
    )
    after = await catalog(changed)
    assert after["columns"] != before["columns"]
    assert after["indexes"] != before["indexes"]
    assert after["functions"] != before["functions"]


async def test_migrate_builds_the_schema_and_a_second_migrate_is_a_no_op(
    empty_db: EmptyDb,
) -> None:
    url, reference = await empty_db(), await empty_db()
    await _execute(reference, schema_sql())
    versions = [version for version, _, _ in migrations()]
    store = await Store.connect(url, pool_size=2, migrate=False)
    try:
        assert await store.migrate() == versions
        first = await catalog(url)
        assert await store.migrate() == []
        assert await catalog(url) == first
    finally:
        await store.close()
    assert await catalog(url, without=MIGRATIONS_TABLE) == await catalog(reference)
    conn = await asyncpg.connect(url)
    try:
        ledger = [r["version"] for r in await conn.fetch(f"SELECT version FROM {MIGRATIONS_TABLE}")]
    finally:
        await conn.close()
    assert sorted(ledger) == versions


async def test_the_test_template_is_fully_migrated(store: Store) -> None:
    assert await store.migrate() == []


async def test_concurrent_migrations_apply_each_version_once(empty_db: EmptyDb) -> None:
    url, reference = await empty_db(), await empty_db()
    await _execute(reference, schema_sql())
    stores = [await Store.connect(url, pool_size=1, migrate=False) for _ in range(6)]
    applied: list[list[int]] = []

    async def migrate(store: Store) -> None:
        applied.append(await store.migrate())

    try:
        async with anyio.create_task_group() as tg:
            for store in stores:
                tg.start_soon(migrate, store)
    finally:
        for store in stores:
            await store.close()
    versions = [version for version, _, _ in migrations()]
    assert sorted(v for batch in applied for v in batch) == versions
    assert sum(1 for batch in applied if batch) == 1
    assert await catalog(url, without=MIGRATIONS_TABLE) == await catalog(reference)


async def test_concurrent_connects_with_migrate_succeed(empty_db: EmptyDb) -> None:
    """What several processes starting at once do: connect(migrate=True)."""
    url = await empty_db()
    stores: list[Store] = []

    async def connect() -> None:
        stores.append(await Store.connect(url, pool_size=1))

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(connect)
        assert len(stores) == 4
        assert await stores[0].migrate() == []
    finally:
        for store in stores:
            await store.close()


# -- races between joining a trigger and dropping it -------------------------------------------


def _noop() -> None:
    return None


async def _running(store: Store, dag: DAG) -> tuple[int, dict[str, ClaimedTask]]:
    """Record the DAG, start one run and claim all its tasks for a new worker."""
    await store.upsert_dag(dag.dag_id, f"{dag.dag_id}.py", dag.serialize_tasks(), None)
    await store.create_dag_run(dag.dag_id, "r1", logical_date=await store.now())
    worker = await store.register_worker("test", 1, len(dag.tasks))
    claimed = (await store.claim_tasks(worker, len(dag.tasks))).claimed
    return worker, {ti.task_id: ti for ti in claimed}


async def _two_running_tasks(store: Store) -> tuple[int, ClaimedTask, ClaimedTask]:
    with DAG(dag_id="race") as dag:
        PythonOperator(task_id="a", python_callable=_noop)
        PythonOperator(task_id="b", python_callable=_noop)
    worker, claimed = await _running(store, dag)
    return worker, claimed["a"], claimed["b"]


async def test_one_finish_statement_ends_each_try_by_its_own_outcome(store: Store) -> None:
    """A worker's batch: a success with its result, a failure that retries, a try the worker
    no longer holds and an outcome for an earlier try (both left as they are); then an empty
    claim says when the retry is due."""
    with DAG(dag_id="batch") as dag:
        PythonOperator(task_id="ok", python_callable=_noop)
        PythonOperator(task_id="flaky", python_callable=_noop, retries=1, retry_delay=600)
        PythonOperator(task_id="taken", python_callable=_noop)
        PythonOperator(task_id="earlier", python_callable=_noop)
    worker, claimed = await _running(store, dag)
    ids = {name: ti.id for name, ti in claimed.items()}
    assert len(ids) == 4
    assert {ti.try_number for ti in claimed.values()} == {1}

    def outcome(name: str, kind: str, **fields: Any) -> TaskOutcome:
        values: dict[str, Any] = {"worker_id": worker, "try_number": 1, **fields}
        return TaskOutcome(ti_id=ids[name], kind=kind, **values)

    states = await store.finish_tasks(
        [
            outcome("ok", "success", result=b"\x01"),
            outcome("flaky", "failed", error="boom"),
            outcome("taken", "success", worker_id=worker + 1),
            outcome("earlier", "success", try_number=0),
        ]
    )
    assert {(f.id, f.worker_id): f.state for f in states} == {
        (ids["ok"], worker): "success",
        (ids["flaky"], worker): "up_for_retry",
    }
    rows = {r.task_id: r for r in await store.list_task_instances(dag_id="batch")}
    assert (rows["ok"].result, rows["ok"].error) == (b"\x01", None)
    assert (rows["flaky"].state, rows["flaky"].error) == ("up_for_retry", "boom")
    assert rows["taken"].state == "running"
    assert rows["earlier"].state == "running"

    again = await store.claim_tasks(worker, 3)
    assert again.claimed == []
    assert again.next_in is not None
    assert 0 < again.next_in <= 600


async def test_an_outcome_the_database_refuses_fails_only_its_own_try(store: Store) -> None:
    """A worker's batch with one outcome the database refuses for good (here a state its
    CHECK constraint rejects): the others are written, and that try ends failed, without
    retries, saying why (the worker does not crash)."""
    with DAG(dag_id="refused") as dag:
        PythonOperator(task_id="ok", python_callable=_noop)
        PythonOperator(task_id="odd", python_callable=_noop, retries=3)
    worker = Worker(store, DagBag(None))
    worker.id, by_name = await _running(store, dag)
    queued = [
        _Queued(TaskOutcome(ti_id=by_name[name].id, worker_id=worker.id, try_number=1, kind=kind))
        for name, kind in (("ok", "success"), ("odd", "no-such-state"))
    ]
    await worker.recorder.write(queued)
    assert [q.state for q in queued] == ["success", "failed"]
    rows = {r.task_id: r for r in await store.list_task_instances(dag_id="refused")}
    assert rows["ok"].state == "success"
    assert rows["odd"].state == "failed"
    assert rows["odd"].error.startswith("the outcome of this try could not be stored:")
    assert "CheckViolationError" in rows["odd"].error


async def test_an_empty_claim_with_nothing_waiting_has_no_next_time(store: Store) -> None:
    worker = await store.register_worker("test", 1, 1)
    assert await store.claim_tasks(worker, 5) == TaskClaim(claimed=[], refused=[], next_in=None)


def _deferral(timeout_s: float | None) -> Deferral:
    trigger = validate_trigger(NeverTrigger("race"))
    return Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name="resume",
        method_kwargs=encode_value({}),
        timeout_s=timeout_s,
    )


@pytest.mark.parametrize("dropper", ["triggerer", "scheduler"])
async def test_a_trigger_joined_while_it_is_dropped_survives(
    store: Store, db_url: str, dropper: str
) -> None:
    """A triggerer (or the scheduler's orphan sweep) drops a trigger nobody waits on while a
    task joins it (an identical deferral whose transaction commits while the drop waits for the
    row): the task must not be left deferred on a trigger that no longer exists, where nothing
    would ever fire it."""
    worker, a, b = await _two_running_tasks(store)
    assert await store.defer_task(a.id, worker, _deferral(0.0))
    me = await store.register_triggerer("test", 1, 10, 60.0)
    (claimed,) = (await store.claim_triggers(me, 10)).claimed
    assert len(await store.timeout_deferrals([claimed.id])) == 1  # a timed out: no waiter left

    queries = load_queries()
    join = await asyncpg.connect(db_url)
    watch = await asyncpg.connect(db_url)
    try:
        tx = join.transaction()
        await tx.start()
        joined = _deferral(None)
        row = await join.fetchrow(
            queries["defer_task"],
            b.id,
            worker,
            joined.classpath,
            store.keyring.encrypt(joined.kwargs),
            store.keyring.dedup_key(joined.classpath, joined.kwargs, joined.dedup_key),
            joined.timeout_s,
            joined.method_name,
            store.keyring.encrypt(joined.method_kwargs),
            joined.try_number,
            None,
        )
        assert row is not None
        assert row["trigger_id"] == claimed.id

        async def drop_waits_for_the_row() -> bool:
            n = await watch.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND wait_event_type = 'Lock' "
                "AND query LIKE '%deferral_triggers%'"
            )
            return bool(n)

        async with anyio.create_task_group() as tg:
            if dropper == "triggerer":
                tg.start_soon(store.delete_owned_triggers, me, [claimed.id])
            else:
                tg.start_soon(store.delete_orphan_triggers, 0.0)
            await wait_until(drop_waits_for_the_row, what="the drop to wait for the joiner")
            await tx.commit()
    finally:
        await join.close()
        await watch.close()

    (ti_b,) = await store.list_task_instances(dag_id="race", state="deferred")
    assert ti_b.task_id == "b"
    assert ti_b.trigger_id in {t.id for t in await store.list_triggers()}
