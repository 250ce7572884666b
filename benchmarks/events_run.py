"""The events benchmark's run (see :mod:`benchmarks.events`); imported only when it runs."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
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
from engine.testing import run_engine
from operators.assets import Asset, AssetAny, AssetWatcher
from operators.python import PythonOperator
from triggers.base import BaseEventTrigger, Checkpoint, CursorEvent, TriggerEvent

__all__ = ["QueueEventTrigger", "print_table", "run_events"]

console = Console(stderr=True)

#: Each watcher's outside source: a queue of send times, by key (this process only).
SOURCES: dict[str, asyncio.Queue[tuple[int, float]]] = defaultdict(asyncio.Queue)
#: The reader looks for new asset events this often (s).
READ_EVERY_S = 0.005


class QueueEventTrigger(BaseEventTrigger):
    """An event trigger fed by the benchmark's driver through ``SOURCES[key]``; its cursor is
    the number of the last event it yielded."""

    def __init__(self, key: str) -> None:
        self.key = key

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("benchmarks.events_run.QueueEventTrigger", {"key": self.key})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        source = SOURCES[self.key]
        yield Checkpoint(cursor=self.cursor or 0)
        while True:
            n, sent = await source.get()
            yield CursorEvent({"n": n, "sent": sent}, cursor=n)


#: When the consumer DAG's task started, for each event of its run: (asset, n) -> perf_counter.
FIRST_TASK: dict[tuple[str, int], float] = {}


def first_task(**context: Any) -> None:
    """The consumer DAG's (first and only) task: notes when it started, for each of the
    events that triggered its run."""
    now = time.perf_counter()
    for asset, events in context["triggering_asset_events"].items():
        for event in events:
            FIRST_TASK.setdefault((asset.name, int(event.extra["n"])), now)


def run_events(**options: Any) -> dict[str, Any]:
    return asyncio.run(_run(**options))


async def _commits(url: str, db_name: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        n: int = await conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = $1", db_name
        )
    finally:
        await conn.close()
    return n


#: How long the engine idles, its fleet waiting and no event sent, to measure the background.
IDLE_S = 10.0


async def _background(url: str, db_name: str) -> float:
    """Transactions per second committed while the fleet waits and no event comes (heartbeats,
    leases, polls of empty queues): the part of each run's count that is not the events'."""
    before = await _commits(url, db_name)
    await asyncio.sleep(IDLE_S)
    # (Less the counts' own transactions.)
    return round((await _commits(url, db_name) - before - 1) / IDLE_S, 2)


async def _run(*, watchers: int, rate: float, duration: float, keep_db: bool) -> dict[str, Any]:
    settings = load_settings()
    admin = await asyncio.to_thread(database_url, settings)
    db_name = f"bench_events_{uuid.uuid4().hex[:12]}"
    url = await create_database(admin, db_name)
    store = await Store.connect(url, pool_size=4)
    try:
        assets = [
            Asset(f"a{i:05d}", watchers=[AssetWatcher("w", QueueEventTrigger(f"a{i:05d}"))])
            for i in range(watchers)
        ]
        with DAG("bench_events", schedule=AssetAny(*assets), fileloc=__file__) as dag:
            PythonOperator(task_id="first", python_callable=first_task)
        FIRST_TASK.clear()
        # A scheduler, a worker and a triggerer, each on this process's loop (the triggerer
        # with room for every watcher).
        async with run_engine(
            store, dags=[dag], capacity=watchers + 10, poll_interval_s=1.0, slots=16
        ) as engine:
            with console.status(f"declaring {watchers:,} watchers"):
                await engine.add_dag(dag)
            with console.status("waiting for every watcher to start"):
                while True:
                    states = await store.watcher_states()
                    if all(s.cursor is not None for s in states):
                        break
                    await asyncio.sleep(0.1)
            with console.status(f"{IDLE_S:g} s without events (background transactions)"):
                background = await _background(url, db_name)
            result = await _drive(store, url, db_name, watchers, rate, duration)
            result["background_transactions_per_s"] = background
            return result
    finally:
        await store.close()
        if not keep_db:
            await drop_database(admin, db_name)


async def _drive(
    store: Store, url: str, db_name: str, watchers: int, rate: float, duration: float
) -> dict[str, Any]:
    conn = await asyncpg.connect(url)
    sent: dict[tuple[str, int], float] = {}
    latencies: list[float] = []
    seen: dict[tuple[str, int], int] = defaultdict(int)
    last_id = 0
    reads = 0
    numbers: dict[str, int] = defaultdict(int)
    total = round(rate * duration)
    load_before = os.getloadavg()[0]
    commits_before = await _commits(url, db_name)
    started = time.perf_counter()

    async def read() -> None:
        nonlocal last_id, reads
        reads += 1
        rows = await conn.fetch(
            "SELECT id, asset, (extra->>'n')::bigint AS n FROM deferral_asset_events "
            "WHERE id > $1 ORDER BY id",
            last_id,
        )
        now = time.perf_counter()
        for r in rows:
            last_id = r["id"]
            key = (r["asset"], r["n"])
            seen[key] += 1
            if key in sent and seen[key] == 1:
                latencies.append(now - sent[key])

    with console.status(f"{total:,} events at {rate:g}/s to {watchers:,} watchers"):
        next_read = started
        for i in range(total):
            due = started + i / rate
            while True:
                now = time.perf_counter()
                if now >= next_read:
                    await read()
                    next_read = time.perf_counter() + READ_EVERY_S
                if now >= due:
                    break
                await asyncio.sleep(min(due, next_read) - now)
            key = f"a{random.randrange(watchers):05d}"
            numbers[key] += 1
            sent[(key, numbers[key])] = time.perf_counter()
            SOURCES[key].put_nowait((numbers[key], time.time()))
        deadline = time.perf_counter() + 60
        while (len(latencies) < total or len(FIRST_TASK) < total) and (
            time.perf_counter() < deadline
        ):
            await read()
            await asyncio.sleep(READ_EVERY_S)
    elapsed = time.perf_counter() - started
    # (Less the reader's own transactions and the count's.)
    commits = await _commits(url, db_name) - commits_before - reads - 1
    await conn.close()
    repeated = sum(1 for n in seen.values() if n > 1)
    downstream = [FIRST_TASK[key] - at for key, at in sent.items() if key in FIRST_TASK]
    runs = await store.list_runs(dag_id="bench_events")
    return {
        "scenario": "events",
        "watchers": watchers,
        "rate": rate,
        "duration_s": duration,
        "events_sent": total,
        "events_recorded": len(latencies),
        "events_repeated": repeated,
        "event_to_asset_event_ms": _ms(latencies),
        "events_reaching_a_run": len(downstream),
        "event_to_first_task_started_ms": _ms(downstream),
        "downstream_runs": len(runs),
        "transactions_per_event": round(commits / max(1, total), 3),
        "elapsed_s": round(elapsed, 2),
        "load_1m_before": load_before,
        "load_1m_after": os.getloadavg()[0],
        "machine": _machine(),
    }


def print_table(result: dict[str, Any]) -> None:
    """The watcher run, and each sensor run beside it (``--compare-sensors``)."""
    table = Table(
        title=f"bench events: {result['watchers']:,} sources, {result['rate']:g} events/s"
    )
    for col in (
        "fleet",
        "reached",
        "repeated",
        "asset event p50/p99 ms",
        "task p50/p99 ms",
        "runs",
        "xacts/ev",
        "load",
    ):
        table.add_column(col, justify="right")
    lat = result["event_to_asset_event_ms"]
    down = result["event_to_first_task_started_ms"]
    table.add_row(
        "watchers",
        f"{result['events_reaching_a_run']:,}/{result['events_sent']:,}",
        str(result["events_repeated"]),
        f"{lat['p50']} / {lat['p99']}",
        f"{down['p50']} / {down['p99']}",
        str(result["downstream_runs"]),
        f"{result['transactions_per_event']} (bg {result['background_transactions_per_s']:g}/s)",
        f"{result['load_1m_before']:.2f}",
    )
    for sensors in result.get("sensors", []):
        resumed = sensors["event_to_sensor_resumed_ms"]
        table.add_row(
            f"sensors {sensors['poke_interval_s']:g} s",
            f"{sensors['events_reaching_a_task']:,}/{sensors['events_sent']:,}",
            "-",
            "-",
            f"{resumed['p50']} / {resumed['p99']}",
            "1",
            f"{sensors['transactions_per_event']} "
            f"(bg {sensors['background_transactions_per_s']:g}/s)",
            f"{sensors['load_1m_before']:.2f}",
        )
    console.print(table)
    console.print(
        "task: event -> the run's first task started (watchers), -> the sensor's task resumed "
        "(sensors); xacts/ev: committed transactions per event (sensors: arming included), "
        "bg: the engine's transactions per second without events, fleet waiting (noisy)"
    )
