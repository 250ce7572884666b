"""Settings every pooled connection of the engine runs with."""

from __future__ import annotations

import pytest

from engine.store import Store

pytestmark = pytest.mark.anyio


async def test_every_pooled_connection_runs_without_jit(store: Store) -> None:
    # The claim's function prices a sequential read at 1e10 (enable_seqscan = off); on a
    # server built with JIT that cost made PostgreSQL compile every claim (seconds a call).
    held = [await store._pool.acquire() for _ in range(store._pool.get_max_size())]
    try:
        for conn in held:
            assert await conn.fetchval("SHOW jit") == "off"
    finally:
        for conn in held:
            await store._pool.release(conn)


async def test_the_workers_heartbeat_connection_runs_without_jit(store: Store) -> None:
    # A heartbeat with a deadline runs on a connection of its own, opened outside the pool.
    worker_id = await store.register_worker("host", 1, 4)
    beat = await store.heartbeat_worker(worker_id, [], timeout_s=30.0)
    assert beat.alive
    conn = store._heartbeat_conn
    assert conn is not None
    assert await conn.fetchval("SHOW jit") == "off"
