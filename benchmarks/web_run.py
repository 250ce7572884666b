"""The web benchmark's run (see :mod:`benchmarks.web`); imported only when it runs."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import socket
import time
import uuid
from typing import Any
from urllib.parse import quote

import aiohttp
import asyncpg
from aiohttp import web as aioweb
from rich.console import Console
from rich.table import Table

from benchmarks.fleet_run import _machine
from benchmarks.schedule_run import _ms
from engine.config import load_settings
from engine.dags.dag import DAG
from engine.store import Store, database_url
from engine.store.databases import create_database, drop_database
from engine.web.app import make_app
from engine.web.views.dag import GRID_RUNS
from operators.python import PythonOperator

__all__ = ["TARGET_MS", "print_table", "run_web"]

DAG_ID = "bench_web"
#: The issue's target: a page over 10,000 runs and 100,000 task instances in under 300 ms.
TARGET_MS = 300.0
#: Runs created at once (each its own statement; the store's pool runs them side by side).
BATCH = 50
START = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
HOUR = dt.timedelta(hours=1)

console = Console(stderr=True)

#: Runs at the history's newest end whose tasks are still going (the older ones ended).
ACTIVE_RUNS = 100

#: The history's task states, set by the benchmark's own statement, by the task instance's id
#: modulo 100: the runs that ended mostly success, some failed or upstream_failed; the newest
#: ACTIVE_RUNS runs a few of each waiting and running state too (running, deferred, queued,
#: scheduled, up_for_retry) as a busy engine has.
STATES_SQL = f"""
UPDATE deferral_task_instances SET
    state = CASE
        WHEN id % 100 < 85 THEN 'success'
        WHEN id % 100 < 89 THEN 'failed'
        WHEN id % 100 < 91 THEN 'upstream_failed'
        WHEN dag_run_id <= (SELECT max(id) - {ACTIVE_RUNS} FROM deferral_dag_runs)
            THEN 'success'
        WHEN id % 100 < 93 THEN 'up_for_retry'
        WHEN id % 100 < 95 THEN 'running'
        WHEN id % 100 < 97 THEN 'deferred'
        WHEN id % 100 < 98 THEN 'queued'
        ELSE 'scheduled' END,
    try_number = 1,
    first_try_at = run_after,
    try_queued_at = run_after,
    try_started_at = run_after + interval '2 seconds',
    started_at = run_after + interval '2 seconds',
    deferred_at = NULL,
    ended_at = run_after + interval '40 seconds'
"""
#: A task that has not ended has no end; a deferred one deferred 3 seconds into its try.
UNENDED_SQL = """
UPDATE deferral_task_instances SET
    ended_at = NULL,
    deferred_at = CASE WHEN state = 'deferred' THEN run_after + interval '5 seconds' END
WHERE state NOT IN ('success', 'failed', 'upstream_failed')
"""
#: A second try for one task instance in 20 (the first archived by the engine's trigger).
RETRIED_SQL = "UPDATE deferral_task_instances SET try_number = 2 WHERE id % 20 = 0"
RUNS_SQL = """
UPDATE deferral_dag_runs r SET
    state = CASE WHEN EXISTS (SELECT 1 FROM deferral_task_instances t
                              WHERE t.dag_run_id = r.id AND t.state = 'failed') THEN 'failed'
                 WHEN EXISTS (SELECT 1 FROM deferral_task_instances t
                              WHERE t.dag_run_id = r.id AND t.ended_at IS NULL) THEN 'running'
                 ELSE 'success' END,
    started_at = logical_date,
    ended_at = logical_date + interval '1 minute'
"""


def _dag(tasks: int) -> DAG:
    """Independent tasks t000, t001, ... (the grid's rows)."""
    with DAG(dag_id=DAG_ID, fileloc=__file__) as dag:
        for i in range(tasks):
            PythonOperator(task_id=f"t{i:03d}", python_callable=print)
    return dag


def _run_type(n: int) -> str:
    return "manual" if n % 50 == 0 else "backfill" if n % 7 == 0 else "scheduled"


async def _fill(store: Store, url: str, runs: int, tasks: int) -> None:
    dag = _dag(tasks)
    await store.upsert_dag(DAG_ID, dag.fileloc, dag.serialize_tasks(), None)
    await store.upsert_dag("bench_web_other", dag.fileloc, dag.serialize_tasks(), None)

    async def one(n: int) -> None:
        at = START + n * HOUR
        await store.create_dag_run(
            DAG_ID,
            f"{_run_type(n)}__{at.isoformat()}",
            logical_date=at,
            run_type=_run_type(n),
            data_interval=(at, at + HOUR),
        )

    for first in range(0, runs, BATCH):
        await asyncio.gather(*(one(n) for n in range(first, min(runs, first + BATCH))))
    conn = await asyncpg.connect(url)
    try:
        for sql in (STATES_SQL, UNENDED_SQL, RETRIED_SQL, RUNS_SQL, "ANALYZE"):
            await conn.execute(sql)
    finally:
        await conn.close()


def _pages(runs: int) -> list[tuple[str, str]]:
    """(label, path and query) of each page requested."""
    newest = START + (runs - 1) * HOUR
    run_id = f"{_run_type(runs - 1)}__{newest.isoformat()}"
    last_page = (runs + GRID_RUNS - 1) // GRID_RUNS
    run = f"dag_id={DAG_ID}&run_id={quote(run_id, safe='')}"
    return [
        ("fleet", "/fleet"),
        ("DAGs", "/dags"),
        ("DAGs, searched", "/dags?name=web&state=failed"),
        ("grid, newest runs", f"/dag?dag_id={DAG_ID}"),
        ("grid, oldest runs", f"/dag?dag_id={DAG_ID}&run_page={last_page}"),
        ("grid, filtered", f"/dag?dag_id={DAG_ID}&state=failed&run_type=backfill"),
        ("runs", "/runs"),
        ("runs, filtered", "/runs?state=failed&since=2025-03-01&until=2025-06-30"),
        ("run", f"/run?{run}"),
        ("Gantt", f"/gantt?{run}"),
        ("task", f"/task?{run}&task_id=t000"),
        ("task, try 1", f"/task?{run}&task_id=t000&try=1"),
        ("triggers", "/triggers"),
        ("pools", "/pools"),
        ("pool's tasks", "/pool?name=default_pool&tasks=running"),
    ]


def run_web(**options: Any) -> dict[str, Any]:
    return asyncio.run(_run(**options))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _run(*, runs: int, tasks: int, repeat: int, keep_db: bool) -> dict[str, Any]:
    settings = load_settings()
    admin = await asyncio.to_thread(database_url, settings)
    db_name = f"bench_web_{uuid.uuid4().hex[:12]}"
    url = await create_database(admin, db_name)
    store = await Store.connect(url, pool_size=4)
    runner: aioweb.AppRunner | None = None
    figures: list[dict[str, Any]] = []
    try:
        started = time.perf_counter()
        with console.status(f"creating {runs:,} runs of {tasks} tasks"):
            await _fill(store, url, runs, tasks)
        fill_s = time.perf_counter() - started
        runner = aioweb.AppRunner(make_app(store))
        await runner.setup()
        port = _free_port()
        await aioweb.TCPSite(runner, "127.0.0.1", port).start()
        base = f"http://127.0.0.1:{port}"
        load_before = os.getloadavg()[0]
        pages = _pages(runs)
        times: dict[str, list[float]] = {label: [] for label, _ in pages}
        sizes: dict[str, int] = {}
        with console.status("requesting the pages"):
            async with aiohttp.ClientSession() as client:
                for _, path in pages:  # one request each first: warm the plans and caches
                    async with client.get(base + path) as response:
                        if response.status != 200:
                            raise SystemExit(f"{path} answered {response.status}")
                        await response.read()
                for _ in range(repeat):
                    for label, path in pages:
                        t0 = time.perf_counter()
                        async with client.get(base + path) as response:
                            body = await response.read()
                        times[label].append(time.perf_counter() - t0)
                        sizes[label] = len(body)
        figures = [
            {"page": label, "path": path, "ms": _ms(times[label]), "bytes": sizes[label]}
            for label, path in pages
        ]
        counts = await store.count_task_states()
    finally:
        if runner is not None:
            await runner.cleanup()
        await store.close()
        if not keep_db:
            await drop_database(admin, db_name)
    return {
        "runs": runs,
        "tasks_per_run": tasks,
        "task_instances": runs * tasks,
        "repeat": repeat,
        "fill_s": round(fill_s, 1),
        "pages": figures,
        "task_states": counts,
        "target_ms": TARGET_MS,
        # The machine may be shared: the 1-minute load average when the requests started.
        "load_avg_1m_at_start": round(load_before, 2),
        "machine": _machine(),
    }


def print_table(result: dict[str, Any]) -> None:
    table = Table(
        title=f"status page over {result['runs']:,} runs, "
        f"{result['task_instances']:,} task instances ({result['repeat']} requests a page)"
    )
    table.add_column("page")
    table.add_column("p50 ms", justify="right")
    table.add_column("p99 ms", justify="right")
    table.add_column("max ms", justify="right")
    table.add_column("KB", justify="right")
    for row in result["pages"]:
        ms = row["ms"]
        table.add_row(
            row["page"],
            str(ms["p50"]),
            str(ms["p99"]),
            str(ms["max"]),
            f"{row['bytes'] / 1024:.0f}",
        )
    table.caption = (
        f"target: under {result['target_ms']:g} ms; "
        f"1-min load average at start {result['load_avg_1m_at_start']}"
    )
    console.print(table)
