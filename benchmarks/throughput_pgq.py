"""The reference half of ``bench throughput``: the same N no-op jobs through pgqueuer, a
well-tuned PostgreSQL job queue, on the same server, in a database of its own.

Set up as pgqueuer's documentation recommends (tables installed by its own ``install``, its
autovacuum settings applied, the default durable tables, one dedicated asyncpg connection per
queue manager, uvloop); each of the W worker processes runs one ``QueueManager`` in drain mode
with a no-op async entrypoint, at most ``slots`` jobs at once (the engine's worker slots) and
a dequeue batch of ``batch`` (pgqueuer requires at most half its concurrency cap).

Imported only by this benchmark (pgqueuer is the ``bench`` extra).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import asyncpg
from pgqueuer.db import AsyncpgDriver
from pgqueuer.models import Job
from pgqueuer.qm import QueueManager
from pgqueuer.queries import Queries
from pgqueuer.types import QueueExecutionMode

__all__ = ["ENTRYPOINT", "prepare", "worker_main"]

ENTRYPOINT = "noop"
#: Jobs inserted per enqueue statement while the backlog is built.
ENQUEUE_BATCH = 10_000


async def prepare(url: str, n: int) -> None:
    """Install pgqueuer's tables in the (empty) database of ``url``, apply its recommended
    autovacuum settings and queue ``n`` no-op jobs."""
    conn = await asyncpg.connect(url)
    try:
        queries = Queries(AsyncpgDriver(conn))
        await queries.install()
        await queries.optimize_autovacuum()
        left = n
        while left:
            size = min(ENQUEUE_BATCH, left)
            await queries.enqueue([ENTRYPOINT] * size, [None] * size, [0] * size)
            left -= size
        # A database in service has statistics; a new one has none until autovacuum's nap.
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


def worker_main() -> None:
    """``python -c 'from benchmarks.throughput_pgq import worker_main; worker_main()' JSON``

    Prints ``ready`` once connected, waits for a line on stdin, drains the queue, prints
    ``done``, and waits for another line before it closes its connection (so that its
    database backend is still there when the benchmark reads the CPU it used). Its stdin
    closing (the benchmark died) ends it."""
    import uvloop

    args = json.loads(sys.argv[1])
    uvloop.run(_worker(args["url"], int(args["slots"]), int(args["batch"])))


async def _worker(url: str, slots: int, batch: int) -> None:
    conn = await asyncpg.connect(url)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))

    @qm.entrypoint(ENTRYPOINT)
    async def noop(job: Job) -> None:
        return None

    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    if not await loop.run_in_executor(None, sys.stdin.readline):
        await conn.close()  # its pipe closed: the benchmark is gone, nothing to run for
        return
    await qm.run(batch_size=batch, mode=QueueExecutionMode.drain, max_concurrent_tasks=slots)
    print("done", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    await conn.close()


def settings_of(slots: int, batch: int) -> dict[str, Any]:
    """What the result says of pgqueuer's set-up."""
    import importlib.metadata

    return {
        "version": importlib.metadata.version("pgqueuer"),
        "driver": "AsyncpgDriver (one connection per queue manager)",
        "mode": "drain",
        "batch_size": batch,
        "max_concurrent_tasks": slots,
        "durability": "durable",
        "autovacuum": "pgqueuer's recommended (optimize_autovacuum)",
    }
