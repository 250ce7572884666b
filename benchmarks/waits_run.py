"""The waits benchmark's run (see :mod:`benchmarks.waits`); imported only when it runs."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import psutil
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from benchmarks.processes import Fleet
from benchmarks.waits_dag import DAG_ID, SENSOR_POOL, dag_file_source
from engine.config import load_settings
from engine.dags.dagbag import DagBag
from engine.security.keys import child_key_env, keyring_from_settings
from engine.store import Store, database_url
from engine.store.databases import create_database, drop_database, with_database
from operators.defaults import DEFAULT_POOL

__all__ = ["floor_main", "percentiles", "run_waits"]

CHUNK = 1000
#: The run gives up when no task ended for this long.
STALL_S = 60.0
console = Console(stderr=True)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p99 / max (nearest rank), in the unit given."""
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))]

    return {"p50": round(rank(0.50), 3), "p99": round(rank(0.99), 3), "max": round(ordered[-1], 3)}


# -- the floor: bare coroutines on the same loop, in a process of their own ----------------


def floor_main() -> None:
    """``python -c 'from benchmarks.waits_run import floor_main; floor_main()' '<json>'``"""
    args = json.loads(sys.argv[1])
    n, window, loop = int(args["n"]), float(args["window"]), args["loop"]
    if loop == "uvloop":
        import uvloop

        runner: Any = uvloop.run
    else:
        runner = asyncio.run
    print(json.dumps(runner(_floor(n, window))), flush=True)


async def _floor(n: int, window: float) -> dict[str, Any]:
    proc = psutil.Process()
    late = [0.0] * n
    dues = [0.0] * n
    lead = 1.0 + n / 50_000

    async def wait(i: int) -> None:
        await asyncio.sleep(dues[i] - time.time())
        late[i] = time.time() - dues[i]

    gc.collect()
    rss_base = proc.memory_info().rss
    t0 = time.time() + lead
    for i in range(n):
        dues[i] = t0 + i / n * window
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(wait(i)) for i in range(n)]
    await asyncio.sleep(min(0.5, lead / 2))  # every coroutine has reached its sleep
    rss_held = proc.memory_info().rss
    await asyncio.gather(*tasks)
    lateness_ms = [x * 1000 for x in late]
    return {
        "rss_per_wait_bytes": round((rss_held - rss_base) / n, 1),
        "fire_lateness_ms": percentiles(lateness_ms),
    }


def _run_floor(n: int, window: float, loop: str) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from benchmarks.waits_run import floor_main; floor_main()",
            json.dumps({"n": n, "window": window, "loop": loop}),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# -- processes -----------------------------------------------------------------------------


def _cpu_s(pids: Sequence[int]) -> float:
    return sum(_cpu_by_pid(pids).values())


def _cpu_by_group(fleet: Fleet, pgdata: Path | None) -> dict[str, dict[int, float]]:
    """CPU seconds of each live process of the run, by kind: workers, triggerers, scheduler,
    postgres (the embedded server's processes)."""
    groups: dict[str, list[int]] = {"workers": [], "triggerers": [], "scheduler": []}
    kinds = {"worker": "workers", "triggerer": "triggerers", "scheduler": "scheduler"}
    for name, proc in fleet.procs.items():
        if proc.poll() is None:
            groups[kinds[name.split("-")[0]]].append(proc.pid)
    if pgdata is not None:
        groups["postgres"] = _postgres_pids(pgdata)
    return {name: _cpu_by_pid(pids) for name, pids in groups.items()}


def _cpu_by_pid(pids: Sequence[int]) -> dict[int, float]:
    cpu = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            cpu[pid] = t.user + t.system
    return cpu


def _rss(pid: int) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


def _postgres_pids(pgdata: Path | None) -> list[int]:
    """The embedded server's postmaster and backends (none for an external server)."""
    if pgdata is None:
        return []
    try:
        postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
        proc = psutil.Process(postmaster)
        return [postmaster, *(c.pid for c in proc.children(recursive=True))]
    except (OSError, ValueError, IndexError, psutil.Error):
        return []


def _journal_lines(folder: Path) -> Iterator[str]:
    for path in sorted(folder.glob("resumed-*.log")):
        yield from path.read_text().splitlines()


def _journal_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("resumed-*.log"))


async def _analyze(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("ANALYZE")
    finally:
        await conn.close()


async def _commit_rate(url: str, count: int = 200) -> float:
    """Sequential one-row commits per second: what the database's disk allows one session."""
    conn = await asyncpg.connect(url)
    try:
        # A logged table: a temporary one writes no WAL and would not wait for the disk.
        await conn.execute("CREATE TABLE bench_commit_probe (i int)")
        started = time.perf_counter()
        for i in range(count):
            await conn.execute("INSERT INTO bench_commit_probe VALUES ($1)", i)
        rate = round(count / (time.perf_counter() - started), 1)
        await conn.execute("DROP TABLE bench_commit_probe")
        return rate
    finally:
        await conn.close()


# -- the run -------------------------------------------------------------------------------


def run_waits(**options: Any) -> dict[str, Any]:
    return asyncio.run(_run(**options))


async def _run(
    *,
    n: int,
    k: int,
    capacity: int | None,
    window: float,
    loop: str,
    workers: int,
    slots: int,
    distinct: int | None,
    idle_s: float,
    lease_s: float | None,
    kill_one: bool,
    out: str | None,
    plot: str | None,
    keep_db: bool,
    synchronous_commit: bool,
    pg_settings: tuple[tuple[str, str], ...] = (),
    pools: bool = False,
    default_pool_slots: int | None = None,
) -> dict[str, Any]:
    settings = load_settings()
    if lease_s is not None:
        settings = settings.replace(triggerer_lease_s=lease_s)
    chunk = min(CHUNK, n)
    if n % chunk:
        raise SystemExit(f"--triggers must be a multiple of {CHUNK} above {CHUNK}")
    distinct = min(distinct or n, n)
    capacity = capacity or n
    pgdata = None if settings.database_url else settings.home_path / "pgdata"

    console.print(f"[bold]bench waits[/]: N={n:,} K={k} capacity={capacity:,} window={window}s")
    with console.status(f"floor: {n:,} bare asyncio.sleep coroutines on {loop}"):
        floor = _run_floor(n, window, loop)
    console.print(
        f"floor: {floor['rss_per_wait_bytes']:.0f} B/wait, lateness p99 "
        f"{floor['fire_lateness_ms']['p99']} ms"
    )

    admin = await asyncio.to_thread(database_url, settings)
    db_name = f"bench_waits_{uuid.uuid4().hex[:12]}"
    await create_database(admin, db_name)
    conn = await asyncpg.connect(admin)
    try:
        if not synchronous_commit:
            await conn.execute(f'ALTER DATABASE "{db_name}" SET synchronous_commit = off')
        for name, value in pg_settings:
            await conn.execute(f'ALTER DATABASE "{db_name}" SET {name} = {value}')
    finally:
        await conn.close()
    url = with_database(admin, db_name)
    commits_per_s = await _commit_rate(url)
    work = Path(tempfile.mkdtemp(prefix="deferral-bench-waits-"))
    dags = work / "dags"
    journal = work / "journal"
    dags.mkdir()
    journal.mkdir()
    (dags / "bench_waits_dag.py").write_text(
        dag_file_source(chunk, pool=SENSOR_POOL if pools else None)
    )
    keyring = keyring_from_settings(settings)
    env = {
        **os.environ,
        **child_key_env(settings),
        "DEFERRAL_DATABASE_URL": url,
        "DEFERRAL_DAGS_FOLDER": str(dags),
        "DEFERRAL_LOG_LEVEL": os.environ.get("DEFERRAL_BENCH_LOG_LEVEL", "WARNING"),
        "DEFERRAL_EVENT_LOOP": loop,
        "DEFERRAL_TRIGGERER_LEASE_S": str(settings.triggerer_lease_s),
        # The benchmark's trigger lives in this package, not in the DAGs folder.
        "DEFERRAL_TRIGGER_ALLOW": "triggers.*,benchmarks.waits_dag.*",
    }
    fleet = Fleet(work, env)
    store = await Store.connect(url, pool_size=2, keyring=keyring)
    try:
        if pools:
            # A slot for every waiting task, deferred ones counted: the pool holds none back.
            await store.set_pool(SENSOR_POOL, n, include_deferred=True)
        # The default pool as large as the workers' slots (as bench throughput opens it):
        # its 128 slots would otherwise cap what runs at once below what the workers can,
        # and at 5,000 resumes/s (each holding its slot from its fire to its end) the pool,
        # not the engine, would set the pace.
        default_pool_slots = default_pool_slots or max(128, workers * slots)
        await store.set_pool(DEFAULT_POOL, default_pool_slots)
        result = await _measure(
            store, fleet, work, journal, dags, pgdata,
            n=n, k=k, capacity=capacity, window=window, loop=loop, workers=workers,
            slots=slots, distinct=distinct, idle_s=idle_s, kill_one=kill_one,
            lease_s=settings.triggerer_lease_s, chunk=chunk,
        )  # fmt: skip
    finally:
        await asyncio.to_thread(fleet.stop)
        await store.close()
        if not keep_db:
            await drop_database(admin, db_name)
    result["floor_rss_per_wait_bytes"] = floor["rss_per_wait_bytes"]
    result["floor_fire_lateness_ms"] = floor["fire_lateness_ms"]
    result["rss_ratio_to_floor"] = (
        round(result["rss_per_wait_bytes"] / floor["rss_per_wait_bytes"], 2)
        if floor["rss_per_wait_bytes"] > 0
        else None
    )
    result["synchronous_commit"] = synchronous_commit
    result["pools"] = pools
    result["default_pool_slots"] = default_pool_slots
    result["pg_settings"] = dict(pg_settings)
    result["db_commits_per_s"] = commits_per_s
    result["logs"] = str(work)
    _table(result)
    if plot:
        _plot(plot, journal, result)
    if not keep_db:
        shutil.rmtree(journal, ignore_errors=True)
    return result


async def _measure(
    store: Store,
    fleet: Fleet,
    work: Path,
    journal: Path,
    dags: Path,
    pgdata: Path | None,
    *,
    n: int,
    k: int,
    capacity: int,
    window: float,
    loop: str,
    workers: int,
    slots: int,
    distinct: int,
    idle_s: float,
    kill_one: bool,
    lease_s: float,
    chunk: int,
) -> dict[str, Any]:
    bag = DagBag(dags)
    dag = (await asyncio.to_thread(bag.collect))[DAG_ID]
    await store.upsert_dag(DAG_ID, dag.fileloc, dag.serialize_tasks(), None)
    fleet.spawn("scheduler", "scheduler")
    for i in range(workers):
        fleet.spawn(f"worker-{i}", "worker", "--slots", str(slots))

    # Due times start after the deferrals, the claim and the idle measurement.
    lead = 6.0 + idle_s + n / 250 + n / 20_000
    t0 = time.time() + lead
    progress = Progress(
        TextColumn("{task.description:<28}"),
        BarColumn(),
        TextColumn("{task.completed:>9,.0f}/{task.total:,.0f}"),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        # -- defer: real workers run execute() of every task, which defers ------------------
        t_defer = time.time()
        bar = progress.add_task("defer (workers)", total=n)
        for c in range(n // chunk):
            conf = {
                "t0": t0, "window": window, "chunk": c, "chunk_size": chunk,
                "distinct": distinct, "journal": str(journal),
            }  # fmt: skip
            now = await store.now()
            await store.create_dag_run(DAG_ID, f"c{c:05d}", logical_date=now, conf=conf)
        deferred = 0
        while deferred < n:
            deferred = (await store.count_task_states()).get("deferred", 0)
            progress.update(bar, completed=deferred)
            if deferred < n:
                await asyncio.sleep(1.0)  # counting 100k rows is not free for the database
        defer_all_s = time.time() - t_defer
        trigger_rows = await store.count_unowned_triggers()
        # A database created a minute ago has no statistics for what was just written, and
        # autovacuum analyzes only after its next nap: the planner then takes the tables for
        # empty and nested-loops over sequential scans (seen: 5 s per 1,000 fired triggers).
        # A database in service has statistics; give this one what autovacuum would.
        await _analyze(store.url)

        # -- claim: K triggerers start on the backlog ---------------------------------------
        bar = progress.add_task("claim (triggerers)", total=trigger_rows)
        t_spawn = time.time()
        tpids: dict[int, int] = {}  # triggerer process pid -> index
        for i in range(k):
            proc = fleet.spawn(f"triggerer-{i}", "triggerer", "--capacity", str(capacity))
            tpids[proc.pid] = i
        registered_at: dict[int, float] = {}
        rss_base: dict[int, int] = {}
        held_max = 0
        t_all_held = None
        while t_all_held is None:
            rows = await store.list_triggerers()
            now_s = time.time()
            for row in rows:
                if row.pid in tpids and row.pid not in registered_at:
                    registered_at[row.pid] = now_s
                    rss_base[row.pid] = _rss(row.pid)
                held_max = max(held_max, row.held)
            held = sum(row.held for row in rows)
            progress.update(bar, completed=held)
            if held >= trigger_rows and len(registered_at) == k:
                t_all_held = now_s
            elif now_s - t_spawn > 600:
                raise SystemExit("the triggerers did not claim every trigger within 600s")
            else:
                await asyncio.sleep(0.02)
        claim_all_s = t_all_held - min(registered_at.values())
        start_to_all_held_s = t_all_held - t_spawn

        # -- idle: nothing due yet; every engine process just waits -------------------------
        idle_for = min(idle_s, t0 - time.time() - 1.0)
        idle_cpu = db_cpu = None
        await asyncio.sleep(0.5)
        if idle_for > 0.5:
            bar = progress.add_task("idle (CPU)", total=idle_for)
            engine_pids, db_pids = fleet.pids(), _postgres_pids(pgdata)
            c0, d0, w0 = _cpu_s(engine_pids), _cpu_s(db_pids), time.monotonic()
            end = w0 + idle_for
            while time.monotonic() < end:
                await asyncio.sleep(min(0.25, end - time.monotonic()))
                progress.update(bar, completed=time.monotonic() - w0)
            elapsed = time.monotonic() - w0
            idle_cpu = round((_cpu_s(engine_pids) - c0) / elapsed, 4)
            db_cpu = round((_cpu_s(db_pids) - d0) / elapsed, 4) if db_pids else None
        rss_held = {pid: _rss(pid) for pid in registered_at}
        rss_growth = sum(max(0, rss_held[p] - rss_base[p]) for p in registered_at)

        # -- window: timers fire, tasks resume ----------------------------------------------
        load_at_window = os.getloadavg()[0]
        cpu_before = _cpu_by_group(fleet, pgdata)
        late_start = t0 - time.time()
        bar = progress.add_task("fire + resume", total=n)
        failover_s = None
        killed = None
        kill_at = t0 + window / 2 if kill_one else None
        # The run ends when every task ended, or when nothing ended for STALL_S (what did not
        # resume by then counts as lost).
        done = 0
        last_progress = time.time()
        all_done_at = None
        while time.time() - last_progress < STALL_S + (3 * lease_s if kill_one else 0):
            if kill_at is not None and time.time() >= kill_at:
                kill_at = None
                killed = await _kill_one(store, tpids)
                failover_s = await _wait_failover(store, killed, progress)
            lines = _journal_bytes(journal) / 60
            progress.update(bar, completed=min(lines, n))
            if time.time() > t0 + window:
                states = await store.count_task_states()
                ended = sum(states.get(s, 0) for s in ("success", "failed", "skipped"))
                if ended > done:
                    done, last_progress = ended, time.time()
                if done >= n:
                    all_done_at = time.time()
                    break
                await asyncio.sleep(0.75)
            else:
                last_progress = time.time()
            await asyncio.sleep(0.25)
        progress.update(bar, completed=n if done >= n else _journal_bytes(journal) / 60)
        # CPU spent from the first due time until every task ended, per kind of process:
        # processes alive at the end, from the start or from their birth (a database
        # connection opened meanwhile); those that ended meanwhile (a killed triggerer, a
        # pooled connection closed when idle) drop out.
        cpu_after = _cpu_by_group(fleet, pgdata)
        window_cpu = {
            name: round(sum(cpu - cpu_before[name].get(pid, 0.0) for pid, cpu in by_pid.items()), 2)
            for name, by_pid in cpu_after.items()
        }

    states = await store.count_task_states()
    # When each resume was claimed by a worker (database clock: the same host's clock with
    # the embedded server) splits the resume latency into write + wake + claim, and run.
    tis = await store.list_task_instances(dag_id=DAG_ID, limit=n)
    claimed_at = {ti.id: ti.started_at.timestamp() for ti in tis if ti.started_at}
    # run_after is the time of the transaction that wrote the event (database clock).
    written_at = {ti.id: ti.run_after.timestamp() for ti in tis}
    fired: dict[int, int] = {}
    lateness: list[float] = []
    resume: list[float] = []
    to_write: list[float] = []
    to_claim: list[float] = []
    to_method: list[float] = []
    for line in _journal_lines(journal):
        ti, due, fire, started = line.split()
        fired[int(ti)] = fired.get(int(ti), 0) + 1
        lateness.append((float(fire) - float(due)) * 1000)
        resume.append((float(started) - float(due)) * 1000)
        if int(ti) in claimed_at:
            to_write.append((written_at[int(ti)] - float(fire)) * 1000)
            to_claim.append((claimed_at[int(ti)] - written_at[int(ti)]) * 1000)
            to_method.append((float(started) - claimed_at[int(ti)]) * 1000)
    return {
        "triggers": n,
        "triggerers": k,
        "capacity": capacity,
        "window_s": window,
        "loop": loop,
        "workers": workers,
        "worker_slots": slots,
        "trigger_rows": trigger_rows,
        "tasks_per_trigger_row": round(n / max(trigger_rows, 1), 2),
        "defer_all_s": round(defer_all_s, 2),
        "claim_all_s": round(claim_all_s, 3),
        "start_to_all_held_s": round(start_to_all_held_s, 3),
        "held_max": held_max,
        "rss_per_wait_bytes": round(rss_growth / n, 1),
        "rss_per_trigger_row_bytes": round(rss_growth / max(trigger_rows, 1), 1),
        "triggerer_rss_bytes": sum(rss_held.values()),
        "idle_cpu_fraction": idle_cpu,
        "idle_db_cpu_fraction": db_cpu,
        "idle_measured_s": round(idle_for, 2) if idle_for > 0.5 else None,
        "slack_before_first_due_s": round(late_start, 2),
        "fire_lateness_ms": percentiles(lateness),
        "resume_latency_ms": percentiles(resume),
        "fire_to_event_written_ms": percentiles(to_write),
        "event_written_to_worker_claim_ms": percentiles(to_claim),
        "worker_claim_to_method_ms": percentiles(to_method),
        "all_ended_after_first_due_s": None if all_done_at is None else round(all_done_at - t0, 1),
        "window_cpu_s": window_cpu,
        "events_lost": n - len(fired),
        "resumed_twice": sum(1 for c in fired.values() if c > 1),
        "failover_s": None if failover_s is None else round(failover_s, 3),
        "killed_triggerer_held": None if killed is None else killed[1],
        "task_states": states,
        # The machine is shared: the 1-minute load average when the timers started firing.
        "load_avg_1m_at_window": round(load_at_window, 2),
    }


async def _kill_one(store: Store, tpids: dict[int, int]) -> tuple[int, int]:
    """SIGKILL the triggerer holding the most; returns (its triggerer id, triggers it held)."""
    rows = [r for r in await store.list_triggerers() if r.pid in tpids]
    victim = max(rows, key=lambda r: r.held)
    os.kill(victim.pid, signal.SIGKILL)
    console.print(f"SIGKILL triggerer {victim.id} (pid {victim.pid}) holding {victim.held:,}")
    return int(victim.id), int(victim.held)


async def _wait_failover(store: Store, killed: tuple[int, int], progress: Progress) -> float:
    """Seconds from the kill until the dead triggerer was reaped (its session lock free, or
    its lease lapsed) and no trigger is left unowned."""
    t_kill = time.time()
    bar = progress.add_task("failover (waiting)", total=1)
    while True:
        rows = await store.list_triggerers()
        if all(r.id != killed[0] for r in rows) and await store.count_unowned_triggers() == 0:
            progress.update(bar, total=1, completed=1)
            return time.time() - t_kill
        await asyncio.sleep(0.05)


# -- output --------------------------------------------------------------------------------

TARGETS: dict[str, tuple[str, Callable[[dict[str, Any]], bool]]] = {
    "claim_all_s": ("< 10 s at 100k", lambda r: r["claim_all_s"] < 10),
    "rss_per_wait_bytes": (
        "<= 2x floor",
        lambda r: r["rss_ratio_to_floor"] is not None and r["rss_ratio_to_floor"] <= 2,
    ),
    "idle_cpu_fraction": (
        "< 0.02",
        lambda r: r["idle_cpu_fraction"] is not None and r["idle_cpu_fraction"] < 0.02,
    ),
    "fire_lateness_ms": ("p99 < 50", lambda r: (r["fire_lateness_ms"]["p99"] or 1e9) < 50),
    "resume_latency_ms": (
        "p50 < 10, p99 < 100",
        lambda r: (
            (r["resume_latency_ms"]["p50"] or 1e9) < 10
            and (r["resume_latency_ms"]["p99"] or 1e9) < 100
        ),
    ),
    "events_lost": ("0", lambda r: r["events_lost"] == 0),
    "resumed_twice": ("0", lambda r: r["resumed_twice"] == 0),
    "failover_s": ("< 1", lambda r: r["failover_s"] is None or r["failover_s"] < 1),
}


def _table(result: dict[str, Any]) -> None:
    table = Table("figure", "value", "target", "")
    for key in (
        "triggers", "triggerers", "pools", "default_pool_slots", "trigger_rows", "defer_all_s",
        "claim_all_s",
        "start_to_all_held_s", "held_max", "rss_per_wait_bytes", "floor_rss_per_wait_bytes",
        "rss_ratio_to_floor", "idle_cpu_fraction", "idle_db_cpu_fraction",
        "fire_lateness_ms", "floor_fire_lateness_ms", "resume_latency_ms",
        "fire_to_event_written_ms",
        "event_written_to_worker_claim_ms", "worker_claim_to_method_ms", "window_cpu_s",
        "events_lost",
        "resumed_twice", "failover_s",
    ):  # fmt: skip
        value = result.get(key)
        target, check = TARGETS.get(key, ("", None))
        mark = ""
        if check is not None:
            mark = "[green]ok[/]" if check(result) else "[red]miss[/]"
        table.add_row(key, json.dumps(value), target, mark)
    console.print(table)


def _plot(path: str, journal: Path, result: dict[str, Any]) -> None:
    import matplotlib  # checked before the run (benchmarks.plots.require_matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [line.split() for line in _journal_lines(journal)]
    if not rows:
        return
    due = [float(r[1]) for r in rows]
    t0 = min(due)
    fire = [(float(r[2]) - float(r[1])) * 1000 for r in rows]
    resume = [(float(r[3]) - float(r[1])) * 1000 for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for values, label in ((fire, "fire lateness"), (resume, "due -> resumed on a worker")):
        ordered = sorted(values)
        left.plot(ordered, [i / len(ordered) for i in range(len(ordered))], label=label)
    left.set_xscale("symlog", linthresh=1)
    left.set_xlabel("ms after due time")
    left.set_ylabel("fraction of waits")
    left.legend()
    left.grid(alpha=0.3)
    right.scatter([d - t0 for d in due], resume, s=1, alpha=0.4)
    right.set_yscale("symlog", linthresh=1)
    right.set_xlabel("due time (s into the window)")
    right.set_ylabel("due -> resumed (ms)")
    right.grid(alpha=0.3)
    fig.suptitle(
        f"bench waits: {result['triggers']:,} timers, {result['triggerers']} triggerer(s), "
        f"{result['loop']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
