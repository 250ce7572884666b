"""The claims benchmark's run (see :mod:`benchmarks.claims`); imported only when it runs."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

import asyncpg
from rich.console import Console
from rich.table import Table

from benchmarks.fleet_run import _machine
from benchmarks.schedule_run import _ms
from engine.config import load_settings
from engine.dags.dag import DAG
from engine.store import Store, database_url
from engine.store.databases import create_database, drop_database
from engine.store.models import TaskOutcome
from operators.python import PythonOperator

__all__ = ["CHUNK", "print_table", "run_claims"]

DAG_ID = "bench_claims"
#: Task instances per DAG run (one run is created per chunk of the backlog).
CHUNK = 1000
#: The run gives up when no claim took anything for this long.
STALL_S = 60.0
#: Distinct priority weights of the tasks (absolute), so the claim's order is not just age.
WEIGHTS = 4

console = Console(stderr=True)


def noop() -> None:
    """What the benchmark's tasks would run (they never run: they are ended at claim)."""


def pool_name(index: int) -> str:
    return f"bench_pool_{index:03d}"


def _claims_dag(tasks: int, pools: int) -> DAG:
    """One run's tasks: independent, task i in pool i % pools, weights cycling over WEIGHTS."""
    with DAG(dag_id=DAG_ID, fileloc=__file__) as dag:
        for i in range(tasks):
            PythonOperator(
                task_id=f"t{i:05d}",
                python_callable=noop,
                pool=pool_name(i % pools),
                priority_weight=1 + i % WEIGHTS,
                weight_rule="absolute",
            )
    return dag


class _Tally:
    """What the workers saw, shared by them (one event loop: no lock needed)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.claimed = 0
        self.statements = 0
        self.empty = 0
        self.short = 0
        self.latency_s: list[float] = []
        self.first_at: float | None = None
        self.last_at = 0.0
        self.last_progress = time.monotonic()


async def _worker(
    store: Store, worker_id: int, tally: _Tally, batch: int, parallelism: int
) -> None:
    """Claim, end at once what was claimed, again, until every task was claimed."""
    while tally.claimed < tally.n:
        if time.monotonic() - tally.last_progress > STALL_S:
            raise SystemExit(f"no task was claimed for {STALL_S:g} s: is a pool at 0 slots?")
        started = time.perf_counter()
        if tally.first_at is None:
            tally.first_at = started
        claimed = (await store.claim_tasks(worker_id, batch, parallelism=parallelism)).claimed
        ended = time.perf_counter()
        tally.latency_s.append(ended - started)
        tally.statements += 1
        tally.claimed += len(claimed)
        if not claimed:
            # Every waiting task is held back by a full pool (the other workers hold its
            # slots until their next statement): ask again, as a worker woken by a free slot.
            tally.empty += tally.claimed < tally.n
            await asyncio.sleep(0)
            continue
        tally.last_at = ended
        tally.last_progress = time.monotonic()
        # Fewer than asked while tasks were left: the limits held the rest back.
        tally.short += len(claimed) < batch and tally.claimed < tally.n
        await store.finish_tasks(
            [
                TaskOutcome(
                    ti_id=c.id, worker_id=worker_id, try_number=c.try_number, kind="success"
                )
                for c in claimed
            ]
        )


async def _sql(url: str, *statements: str) -> list[asyncpg.Record]:
    """Run the benchmark's own statements (set-up and read-out; the engine's are its own)."""
    conn = await asyncpg.connect(url)
    try:
        rows: list[asyncpg.Record] = []
        for sql in statements:
            rows = await conn.fetch(sql)
        return rows
    finally:
        await conn.close()


async def _function_time(url: str, calls: int) -> dict[str, Any]:
    """Calls and mean time of deferral_claim_tasks inside the database (track_functions):
    the admission decision without the round trip, the wait for the admission lock included
    (with one worker: the decision alone). The workers' backends report their counts as they
    exit, just after their connections closed: waited for a moment."""
    rows: list[asyncpg.Record] = []
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        rows = await _sql(
            url,
            "SELECT calls, total_time, self_time FROM pg_stat_user_functions "
            "WHERE funcname = 'deferral_claim_tasks'",
        )
        if rows and rows[0]["calls"] >= calls:
            break
        await asyncio.sleep(0.1)
    if not rows or not rows[0]["calls"]:
        return {"calls": 0, "mean_ms": None}
    row = rows[0]
    return {"calls": int(row["calls"]), "mean_ms": round(row["total_time"] / row["calls"], 3)}


def run_claims(**options: Any) -> dict[str, Any]:
    return asyncio.run(_run(**options))


async def _run(
    *,
    n: int,
    pools: int,
    workers: int,
    slots: int,
    batch: int,
    parallelism: int,
    keep_db: bool,
) -> dict[str, Any]:
    settings = load_settings()
    admin = await asyncio.to_thread(database_url, settings)
    db_name = f"bench_claims_{uuid.uuid4().hex[:12]}"
    url = await create_database(admin, db_name)
    store = await Store.connect(url, pool_size=2)
    stores: list[Store] = []
    try:
        # The time spent inside the claim function, apart from the round trip.
        tracked = True
        try:
            await _sql(url, f"ALTER DATABASE \"{db_name}\" SET track_functions = 'pl'")
        except asyncpg.InsufficientPrivilegeError:
            tracked = False  # a superuser's setting: an external server's user may not be one
        for i in range(pools):
            await store.set_pool(pool_name(i), slots)
        per_run = min(CHUNK, n)
        dag = _claims_dag(per_run, pools)
        await store.upsert_dag(DAG_ID, dag.fileloc, dag.serialize_tasks(), None)
        with console.status(f"creating {n:,} runnable task instances"):
            now = await store.now()
            for run in range(n // per_run):
                await store.create_dag_run(DAG_ID, f"r{run:05d}", logical_date=now)
            # A database in service has statistics; a new one has none until autovacuum's
            # next nap (the plan without them is pinned by tests/test_admission_plan.py).
            await _sql(url, "ANALYZE")
        # Each worker: its own registration and its own connection, as a worker process has.
        for _ in range(workers):
            one = await Store.connect(url, pool_size=1, migrate=False)
            stores.append(one)
        ids = [await s.register_worker("bench", os.getpid(), batch) for s in stores]
        tally = _Tally(n)
        load_before = os.getloadavg()[0]
        console.print(
            f"[bold]bench claims[/]: {n:,} tasks in {pools} pools of {slots} slots, "
            f"{workers} workers claiming up to {batch}"
        )
        with console.status("claiming"):
            await asyncio.gather(
                *(
                    _worker(s, w, tally, batch, parallelism)
                    for s, w in zip(stores, ids, strict=True)
                )
            )
        for one in stores:
            await one.close()
        stores = []
        in_database = (
            await _function_time(url, tally.statements)
            if tracked
            else {"calls": None, "mean_ms": None}
        )
        states = await store.count_task_states()
    finally:
        for one in stores:
            await one.close()
        await store.close()
        if not keep_db:
            await drop_database(admin, db_name)
    elapsed = tally.last_at - (tally.first_at or tally.last_at)
    return {
        "tasks": n,
        "pools": pools,
        "slots_per_pool": slots,
        "workers": workers,
        "batch": batch,
        "parallelism": parallelism,
        "duration_s": round(elapsed, 3),
        "admissions_per_s": round(tally.claimed / elapsed, 1) if elapsed > 0 else None,
        "claim_statements": tally.statements,
        "claims_empty": tally.empty,
        "claims_short": tally.short,
        "tasks_per_claim": round(tally.claimed / max(1, tally.statements - tally.empty), 2),
        "claim_latency_ms": _ms(tally.latency_s),
        "claim_function_in_database": in_database,
        "task_states": states,
        # The machine may be shared: the 1-minute load average when the claims started.
        "load_avg_1m_at_start": round(load_before, 2),
        "machine": _machine(),
    }


def print_table(result: dict[str, Any]) -> None:
    table = Table(
        title=f"{result['tasks']:,} tasks, {result['pools']} pools x {result['slots_per_pool']} "
        f"slots, {result['workers']} workers x batch {result['batch']}"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target")
    rate = result["admissions_per_s"]
    table.add_row("admissions / s", f"{rate:,}" if rate is not None else "-", ">= 5,000")
    latency = result["claim_latency_ms"]
    for key in ("p50", "p99", "max"):
        table.add_row(f"claim statement {key} (ms)", str(latency[key]), "")
    table.add_row(
        "claim function in the database, mean (ms; its lock's wait included)",
        str(result["claim_function_in_database"]["mean_ms"]),
        "",
    )
    table.add_row("claim statements", f"{result['claim_statements']:,}", "")
    table.add_row("  empty (every pool full)", f"{result['claims_empty']:,}", "")
    table.add_row("  short of the batch (limits)", f"{result['claims_short']:,}", "")
    table.add_row("tasks per non-empty claim", str(result["tasks_per_claim"]), "")
    table.add_row("1-min load average at start", str(result["load_avg_1m_at_start"]), "")
    console.print(table)
