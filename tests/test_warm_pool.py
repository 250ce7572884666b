"""Workers and triggerers open their whole connection pool when they start.

A pool that grows on demand grows in a burst: the first due events of a window, a fleet whose
condition came true. The statements that wait for a new connection then pay for a new backend,
its authentication and its cold caches; a worker whose pool stayed small until then (its
deferrals are written by one writer, on one connection) resumed a tail of its tasks some
250 ms late (docs/benchmarks.md). Other processes (the scheduler, the CLI) keep a pool that
grows on demand.
"""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest

from engine.store import Store
from engine.store.queries import load_queries
from tests.helpers import claimed_tasks, wait_until
from tests.processes import Children

pytestmark = [pytest.mark.anyio]

POOL = 3
#: The processes' pool: more than an idle worker or triggerer uses at once (claims, heartbeats,
#: callbacks, log writes: an idle worker's pool grew to 3 on demand).
PROCESS_POOL = 8


#: What a worker's and a triggerer's priming runs on every connection of its pool.
PRIMED = (
    "claim_tasks",
    "finish_tasks",
    "defer_tasks",
    "claim_callbacks",
    # (The lock of the triggers is a statement of deferral_fire_triggers, planned in the
    # backend by its first call, which the priming makes.)
    "fire_triggers",
    "claim_triggers",
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # (the processes run their own loops; the test only reads the database)


async def test_a_warm_pool_is_open_in_full_and_kept(db_url: str) -> None:
    warm = await Store.connect(db_url, pool_size=POOL, migrate=False, warm=True)
    cold = await Store.connect(db_url, pool_size=POOL, migrate=False)
    try:
        assert warm._pool.get_size() == POOL
        # (a floor connection is never closed for idling: asyncpg keeps min_size open)
        assert warm._pool.get_min_size() == POOL
        assert cold._pool.get_size() == 1
        assert cold._pool.get_min_size() == 1
    finally:
        await warm.close()
        await cold.close()


async def _backends(conn: asyncpg.Connection) -> int:
    """Sessions on the test database other than this one."""
    n: int = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    return n


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("kind", "registered"),
    [("worker", "deferral_workers"), ("triggerer", "deferral_triggerers")],
)
async def test_a_worker_or_triggerer_process_opens_its_pool_at_start(
    db_url: str, children: Children, kind: str, registered: str, tmp_path: Path
) -> None:
    children.env["DEFERRAL_POOL_SIZE"] = str(PROCESS_POOL)
    (tmp_path / "dags").mkdir()
    children.env["DEFERRAL_DAGS_FOLDER"] = str(tmp_path / "dags")
    conn = await asyncpg.connect(db_url)
    try:
        children.start(kind, name=kind)

        async def up() -> bool:
            return bool(await conn.fetchval(f"SELECT count(*) FROM {registered}"))

        await wait_until(up, what=f"the {kind} registered")

        # The pool was opened before the process registered: its connections, and its
        # notification listener one more (connected after the registration). Grown on demand,
        # an idle worker's pool reached 3 (claims, heartbeats, log writes at once).
        async def opened() -> bool:
            return await _backends(conn) >= PROCESS_POOL + 1

        await wait_until(opened, what=f"the {kind}'s pool of {PROCESS_POOL} and its listener")
    finally:
        await conn.close()


async def test_priming_prepares_the_hot_statements_on_every_connection_and_writes_nothing(
    store: Store, db_url: str
) -> None:
    """asyncpg hands out the connection released last: a pool opened in full but used by one
    writer at a time keeps backends that ran nothing until a burst reaches them, and the
    burst pays their first plans, catalog caches and prepares (docs/benchmarks.md)."""
    dag_id, worker, running = await claimed_tasks(store, 2, "primed")
    await store.set_pool(dag_id, 10)
    await store.create_dag_run(dag_id, "r2", logical_date=await store.now())
    before = await store.count_task_states()
    warm = await Store.connect(
        db_url, pool_size=POOL, migrate=False, warm=True, keyring=store.keyring
    )
    try:
        assert await warm.prime_worker_connections() == POOL
        assert await warm.prime_triggerer_connections() == POOL
        q = load_queries()
        texts = [q[name] for name in PRIMED]
        held = [await warm._pool.acquire() for _ in range(POOL)]  # every connection at once
        try:
            for conn in held:
                prepared = await conn.fetchval(
                    "SELECT count(DISTINCT statement) FROM pg_prepared_statements "
                    "WHERE statement = ANY ($1::text[])",
                    texts,
                )
                assert prepared == len(PRIMED)
        finally:
            for conn in held:
                await warm._pool.release(conn)
    finally:
        await warm.close()
    # A claim of none, empty batches: the runnable tasks wait, the running ones run on.
    assert await store.count_task_states() == before
    assert before.get("scheduled") == 2
    assert before.get("running", 0) >= len(running)
    again = await store.claim_tasks(worker, 10)
    assert {ti.dag_id for ti in again.claimed} == {dag_id}


@pytest.mark.subprocess
@pytest.mark.parametrize("kind", ["worker", "triggerer"])
async def test_a_worker_or_triggerer_process_primes_every_connection_of_its_pool(
    db_url: str, children: Children, kind: str, tmp_path: Path
) -> None:
    """Each backend of the process ran a statement of the engine's (the priming, or the
    process's work since), none is left with only the set-up of its connection done."""
    children.env["DEFERRAL_POOL_SIZE"] = str(PROCESS_POOL)
    (tmp_path / "dags").mkdir()
    children.env["DEFERRAL_DAGS_FOLDER"] = str(tmp_path / "dags")
    engine_statements = set(load_queries().values())
    conn = await asyncpg.connect(db_url)
    try:
        children.start(kind, name=kind)

        async def last_queries() -> list[str]:
            rows = await conn.fetch(
                "SELECT query FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
            )
            return [r["query"] for r in rows if not r["query"].startswith("LISTEN")]

        async def pool_open() -> bool:
            return len(await last_queries()) >= PROCESS_POOL

        await wait_until(pool_open, what=f"the {kind}'s pool of {PROCESS_POOL}")

        async def primed() -> bool:
            return all(query in engine_statements for query in await last_queries())

        await wait_until(primed, what=f"every connection of the {kind}'s pool primed")
    finally:
        await conn.close()
