"""The schedule benchmark's run (see :mod:`benchmarks.schedule`); imported only when it runs."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from benchmarks.fleet_run import _machine
from benchmarks.processes import Fleet
from engine.config import load_settings
from engine.security.keys import child_key_env
from engine.store import Store, database_url
from engine.store.databases import create_database, drop_database

__all__ = ["print_table", "run_schedule"]

console = Console(stderr=True)

DAG_FILE = '''
"""{n} DAGs on "{cron}", one chain of {tasks} trivial task(s) each (the schedule benchmark)."""
import datetime as dt

from engine import DAG
from operators.python import PythonOperator


def noop():
    return None


START = dt.datetime.fromisoformat("{start}")
for i in range({n}):
    with DAG(f"sched_{{i:05d}}", schedule={cron!r}, start_date=START, catchup=False):
        previous = None
        for t in range({tasks}):
            task = PythonOperator(task_id=f"t{{t}}", python_callable=noop)
            if previous is not None:
                previous >> task
            previous = task
'''


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p99 (nearest rank) and max, in milliseconds rounded to 0.1."""
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))]

    return {
        "p50": round(rank(0.50) * 1000, 1),
        "p99": round(rank(0.99) * 1000, 1),
        "max": round(ordered[-1] * 1000, 1),
    }


def _boundaries(cron: str, since: dt.datetime, until: dt.datetime) -> int:
    """How many intervals of ``cron`` (UTC) end in ``[since, until)``."""
    from engine.dags.timetables import make_timetable

    timetable = make_timetable(cron)
    info = timetable.next_dagrun_info(
        last=None, earliest=since - dt.timedelta(days=400), latest=None, catchup=False, now=since
    )
    count = 0
    while info is not None and info.run_after < until:
        count += info.run_after >= since
        info = timetable.next_dagrun_info(
            last=info.data_interval, earliest=None, latest=None, catchup=True, now=since
        )
    return count


def _cpu_s(pid: int) -> float:
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return math.nan
    return float(times.user + times.system)


def run_schedule(**options: Any) -> dict[str, Any]:
    return asyncio.run(_run(**options))


async def _run(
    *, n: int, cron: str, duration_s: float, tasks: int, keep_db: bool
) -> dict[str, Any]:
    settings = load_settings()
    admin = await asyncio.to_thread(database_url, settings)
    db_name = f"bench_schedule_{uuid.uuid4().hex[:12]}"
    url = await create_database(admin, db_name)
    work = Path(tempfile.mkdtemp(prefix="deferral-bench-schedule-"))
    dags = work / "dags"
    dags.mkdir()
    store = await Store.connect(url, pool_size=2)
    fleet: Fleet | None = None
    try:
        start = (await store.now()).replace(second=0, microsecond=0)
        (dags / "bench_schedule_dags.py").write_text(
            DAG_FILE.format(n=n, cron=cron, tasks=tasks, start=start.isoformat())
        )
        env = {
            **os.environ,
            **child_key_env(settings),
            "DEFERRAL_DATABASE_URL": url,
            "DEFERRAL_DAGS_FOLDER": str(dags),
            "DEFERRAL_LOG_LEVEL": os.environ.get("DEFERRAL_BENCH_LOG_LEVEL", "WARNING"),
        }
        fleet = Fleet(work, env)
        console.print(f"[bold]bench schedule[/]: {n:,} DAGs on {cron!r}, {duration_s:g} s")
        scheduler = fleet.spawn("scheduler", "scheduler")
        worker = fleet.spawn("worker", "worker", "--slots", "16")
        deadline = time.monotonic() + 600
        while await store.count_dags() < n:
            if time.monotonic() > deadline or scheduler.poll() is not None:
                log = (work / "scheduler.log").read_text(errors="replace")[-3000:]
                raise SystemExit(f"the scheduler did not record the DAGs:\n{log}")
            await asyncio.sleep(0.2)
        begin = await store.now()
        cpu0 = {"scheduler": _cpu_s(scheduler.pid), "worker": _cpu_s(worker.pid)}
        t0 = time.monotonic()
        await asyncio.sleep(duration_s)
        elapsed = time.monotonic() - t0
        cpu1 = {"scheduler": _cpu_s(scheduler.pid), "worker": _cpu_s(worker.pid)}
        # Intervals that ended in the window, less its last seconds (their runs may still be
        # in the making when it closes).
        end = await store.now() - dt.timedelta(seconds=5)
        delays = await store.schedule_delays(begin, end)
        boundaries = _boundaries(cron, begin, end)
    finally:
        if fleet is not None:
            fleet.stop()
        await store.close()
        if not keep_db:
            await drop_database(admin, db_name)
        shutil.rmtree(work, ignore_errors=True)
    cpu = {
        name: {
            "cpu_s": round(cpu1[name] - cpu0[name], 3),
            "cpu_s_per_minute": round((cpu1[name] - cpu0[name]) * 60 / elapsed, 3),
            "percent_of_a_core": round((cpu1[name] - cpu0[name]) * 100 / elapsed, 2),
        }
        for name in cpu0
    }
    return {
        "dags": n,
        "schedule": cron,
        "tasks_per_dag": tasks,
        "duration_s": round(elapsed, 1),
        "runs_measured": len(delays),
        "runs_expected": n * boundaries,
        "schedule_delay_ms": _ms(delays),
        "cpu": cpu,
        "machine": _machine(),
    }


def print_table(result: dict[str, Any]) -> None:
    table = Table(
        title=f"{result['dags']:,} DAGs on {result['schedule']!r}, {result['duration_s']} s"
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    delay = result["schedule_delay_ms"]
    table.add_row(
        "runs created / expected", f"{result['runs_measured']:,} / {result['runs_expected']:,}"
    )
    for key in ("p50", "p99", "max"):
        table.add_row(f"schedule delay {key} (ms)", str(delay[key]))
    for name, figures in result["cpu"].items():
        table.add_row(f"{name} CPU (% of a core)", str(figures["percent_of_a_core"]))
        table.add_row(f"{name} CPU s per minute", str(figures["cpu_s_per_minute"]))
    console.print(table)
