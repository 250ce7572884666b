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
from tests.helpers import wait_until
from tests.processes import Children

pytestmark = [pytest.mark.anyio]

POOL = 3
#: The processes' pool: more than an idle worker or triggerer uses at once (claims, heartbeats,
#: callbacks, log writes: an idle worker's pool grew to 3 on demand).
PROCESS_POOL = 8


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
