"""The throughput benchmark's run (see :mod:`benchmarks.throughput`); imported only when it
runs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import asyncpg
from rich.console import Console
from rich.table import Table

from benchmarks.fleet_run import _machine
from benchmarks.processes import Fleet
from benchmarks.throughput_dag import CYCLES_DAG_ID, TASKS_DAG_ID, dag_file_source
from benchmarks.waits_run import _cpu_by_pid, _journal_lines, percentiles
from engine.config import load_settings
from engine.dags.dagbag import DagBag
from engine.security.keys import child_key_env, keyring_from_settings
from engine.store import Store, database_url
from engine.store.databases import create_database, drop_database, with_database
from operators.defaults import DEFAULT_POOL
from triggers.sqlfiles import read_queries

__all__ = ["CHUNK", "plot_sweep", "print_table", "run_throughput"]

#: Task instances per DAG run (one run is created per chunk of the N tasks).
CHUNK = 1000
#: A part gives up when nothing ended for this long.
STALL_S = 60.0
console = Console(stderr=True)

Q = read_queries("benchmarks", "throughput.sql")


def _rate(count: int, first: float | None, last: float | None) -> float | None:
    if first is None or last is None or last <= first:
        return None
    return round(count / (last - first), 1)


def _per_item_ms(cpu: dict[str, float | None], n: int) -> dict[str, float | None]:
    """CPU milliseconds per item of each kind of process, and their total."""
    out: dict[str, float | None] = {
        name: None if s is None else round(s * 1000 / n, 3) for name, s in cpu.items()
    }
    known = [v for v in out.values() if v is not None]
    out["total"] = round(sum(known), 3) if known else None
    return out


class _Cpu:
    """CPU seconds of processes by group, between two snapshots; the server's share is read
    only for the embedded server (an external server's processes are not this machine's)."""

    def __init__(self, admin: str, databases: Sequence[str], local_server: bool) -> None:
        self.admin = admin
        self.databases = list(databases)
        self.local_server = local_server
        #: Backends of the benchmark's own connections, left out.
        self.exclude: set[int] = set()

    async def _postgres(self) -> list[int]:
        if not self.local_server:
            return []
        conn = await asyncpg.connect(self.admin)
        try:
            rows = await conn.fetch(Q["postgres_pids"], self.databases)
            own = conn.get_server_pid()
        finally:
            await conn.close()
        return [r["pid"] for r in rows if r["pid"] != own and r["pid"] not in self.exclude]

    async def snapshot(self, groups: Mapping[str, Sequence[int]]) -> dict[str, dict[int, float]]:
        snap = {name: _cpu_by_pid(pids) for name, pids in groups.items()}
        if self.local_server:
            snap["postgres"] = _cpu_by_pid(await self._postgres())
        return snap

    @staticmethod
    def spent(
        before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]
    ) -> dict[str, float | None]:
        """Seconds spent by each group: processes alive at the end, from the first snapshot
        or from their birth (a connection opened meanwhile)."""
        spent: dict[str, float | None] = {
            name: round(sum(cpu - before.get(name, {}).get(pid, 0.0) for pid, cpu in by.items()), 3)
            for name, by in after.items()
        }
        spent.setdefault("postgres", None)
        return spent


async def _fetch(url: str, name: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(Q[name], *args)
    finally:
        await conn.close()


async def _wait_until(check: Any, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench throughput: {what} did not happen within {timeout_s:g} s")
        await asyncio.sleep(0.05)


# -- the engine ----------------------------------------------------------------------------


async def _drain_part(
    store: Store,
    url: str,
    fleet: Fleet,
    cpu: _Cpu,
    *,
    dag_id: str,
    n: int,
    chunk: int,
    open_slots: int,
    conf: dict[str, Any] | None,
) -> tuple[dict[str, float | None], float, list[asyncpg.Record]]:
    """Create the N task instances of ``dag_id`` behind a closed default pool, open it, and
    wait until every one ended; returns the CPU by process, the wall time from opening the
    pool to the last end, and the task instances' times."""
    await store.set_pool(DEFAULT_POOL, 0)
    now = await store.now()
    for c in range(n // chunk):
        await store.create_dag_run(dag_id, f"{dag_id}_{c:05d}", logical_date=now, conf=conf)
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("ANALYZE")
    finally:
        await conn.close()
    await asyncio.sleep(0.3)  # the workers' empty claims of the closed pool are over
    # The progress poll has a connection of its own, whose backend's CPU is left out of the
    # server's share (the benchmark's reading is not the engine's cost).
    monitor = await asyncpg.connect(url)
    cpu.exclude = {monitor.get_server_pid()}
    try:
        before = await cpu.snapshot(_engine_groups(fleet))
        opened = time.monotonic()
        await store.set_pool(DEFAULT_POOL, open_slots)
        ended = moved = 0
        last_progress = time.monotonic()
        with console.status(f"{dag_id}: {n:,} tasks") as status:
            while ended < n:
                await asyncio.sleep(0.25)
                row = (await monitor.fetch(Q["count_progress"], dag_id))[0]
                if (row["ended"], row["moved"]) != (ended, moved):
                    ended, moved, last_progress = row["ended"], row["moved"], time.monotonic()
                    status.update(f"{dag_id}: {ended:,}/{n:,} ended")
                if time.monotonic() - last_progress > STALL_S:
                    break
        wall = time.monotonic() - opened
        after = await cpu.snapshot(_engine_groups(fleet))
    finally:
        await monitor.close()
    rows = await _fetch(url, "task_times", dag_id)
    return _Cpu.spent(before, after), wall, rows


def _engine_groups(fleet: Fleet) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {"workers": [], "triggerer": [], "scheduler": []}
    for name, proc in fleet.procs.items():
        if proc.poll() is None:
            groups[{"worker": "workers"}.get(name.split("-")[0], name.split("-")[0])].append(
                proc.pid
            )
    return groups


def _tasks_figures(
    n: int, rows: Sequence[asyncpg.Record], cpu: dict[str, float | None], wall: float
) -> dict[str, Any]:
    done = [r for r in rows if r["state"] == "success"]
    first = min((r["claimed"] for r in done if r["claimed"]), default=None)
    last = max((r["ended"] for r in done if r["ended"]), default=None)
    return {
        "tasks": n,
        "succeeded": len(done),
        "lost": n - len(done),
        "run_more_than_once": sum(1 for r in rows if r["try_number"] > 1),
        "duration_s": None if first is None or last is None else round(last - first, 3),
        "wall_s": round(wall, 3),
        "tasks_per_s": _rate(len(done), first, last),
        "claim_to_end_ms": percentiles(
            [(r["ended"] - r["claimed"]) * 1000 for r in done if r["ended"] and r["claimed"]]
        ),
        "cpu_s": cpu,
        "cpu_ms_per_task": _per_item_ms(cpu, max(1, len(done))),
    }


def _cycles_figures(
    n: int,
    rows: Sequence[asyncpg.Record],
    journal: Path,
    cpu: dict[str, float | None],
    wall: float,
) -> dict[str, Any]:
    resumed: dict[int, int] = {}
    due: list[float] = []
    fired: list[float] = []
    started: list[float] = []
    for line in _journal_lines(journal):
        ti, d, f, s = line.split()
        resumed[int(ti)] = resumed.get(int(ti), 0) + 1
        due.append(float(d))
        fired.append(float(f))
        started.append(float(s))
    done = [r for r in rows if r["state"] == "success"]
    first = min((r["first_try"] for r in done if r["first_try"]), default=None)
    last = max((r["ended"] for r in done if r["ended"]), default=None)
    return {
        "cycles": n,
        "succeeded": len(done),
        "resumed": len(resumed),
        "lost": n - len(resumed),
        "resumed_twice": sum(1 for c in resumed.values() if c > 1),
        "duration_s": None if first is None or last is None else round(last - first, 3),
        "wall_s": round(wall, 3),
        "cycles_per_s": _rate(len(done), first, last),
        # Tasks entering their waits (execute() deferring), over the span of those calls.
        "deferrals_per_s": _rate(len(due), min(due, default=None), max(due, default=None)),
        # Resumed methods starting, from the first fire to the last start.
        "resumes_per_s": _rate(len(started), min(fired, default=None), max(started, default=None)),
        "defer_to_resume_ms": _spans(due, started),
        "defer_to_fire_ms": _spans(due, fired),
        "fire_to_resume_ms": _spans(fired, started),
        "cpu_s": cpu,
        "cpu_ms_per_cycle": _per_item_ms(cpu, max(1, len(done))),
    }


def _spans(starts: Sequence[float], ends: Sequence[float]) -> dict[str, float | None]:
    """Percentiles of ``end - start`` (seconds in, milliseconds out)."""
    return percentiles([(e - s) * 1000 for s, e in zip(starts, ends, strict=True)])


async def _engine(
    admin: str,
    settings: Any,
    *,
    n: int,
    cycles: int,
    workers: int,
    slots: int,
    keep_db: bool,
    local_server: bool,
) -> dict[str, Any]:
    db_name = f"bench_tput_{uuid.uuid4().hex[:12]}"
    url = await create_database(admin, db_name)
    work = Path(tempfile.mkdtemp(prefix="deferral-bench-throughput-"))
    dags = work / "dags"
    journal = work / "journal"
    dags.mkdir()
    journal.mkdir()
    tasks_chunk, cycles_chunk = min(CHUNK, max(1, n)), min(CHUNK, max(1, cycles))
    (dags / "bench_throughput_dag.py").write_text(dag_file_source(tasks_chunk, cycles_chunk))
    env = {
        **os.environ,
        **child_key_env(settings),
        "DEFERRAL_DATABASE_URL": url,
        "DEFERRAL_DAGS_FOLDER": str(dags),
        "DEFERRAL_LOG_LEVEL": os.environ.get("DEFERRAL_BENCH_LOG_LEVEL", "WARNING"),
        "DEFERRAL_TRIGGER_ALLOW": "triggers.*,benchmarks.waits_dag.*",
    }
    fleet = Fleet(work, env)
    store = await Store.connect(url, pool_size=2, keyring=keyring_from_settings(settings))
    cpu = _Cpu(admin, [db_name], local_server)
    result: dict[str, Any] = {}
    try:
        bag = await asyncio.to_thread(DagBag(dags).collect)
        for dag_id in (TASKS_DAG_ID, CYCLES_DAG_ID):
            dag = bag[dag_id]
            await store.upsert_dag(dag_id, dag.fileloc, dag.serialize_tasks(), None)
        # Every process up and registered before anything is measured (their start-up is not
        # the engine's cost per task).
        await store.set_pool(DEFAULT_POOL, 0)
        fleet.spawn("scheduler", "scheduler")
        for i in range(workers):
            fleet.spawn(f"worker-{i}", "worker", "--slots", str(slots))
        if cycles:
            fleet.spawn("triggerer", "triggerer")

        async def registered() -> bool:
            for name, proc in fleet.procs.items():
                if proc.poll() is not None:
                    raise SystemExit(f"bench throughput: {name} exited (logs: {work})")
            rows = await _fetch(url, "workers_registered")
            up: bool = rows[0][0] >= workers
            if cycles:
                up = up and len(await store.list_triggerers()) >= 1
            return up

        with console.status("starting the engine's processes"):
            await _wait_until(registered, "the workers' registration")
        open_slots = max(128, workers * slots)
        if n:
            tcpu, twall, trows = await _drain_part(
                store, url, fleet, cpu, dag_id=TASKS_DAG_ID, n=n, chunk=tasks_chunk,
                open_slots=open_slots, conf=None,
            )  # fmt: skip
            result["tasks"] = _tasks_figures(n, trows, tcpu, twall)
            console.print(f"engine: {n:,} no-op tasks, {result['tasks']['tasks_per_s']} tasks/s")
        if cycles:
            ccpu, cwall, crows = await _drain_part(
                store, url, fleet, cpu, dag_id=CYCLES_DAG_ID, n=cycles, chunk=cycles_chunk,
                open_slots=open_slots, conf={"journal": str(journal)},
            )  # fmt: skip
            result["cycles"] = _cycles_figures(cycles, crows, journal, ccpu, cwall)
            console.print(
                f"engine: {cycles:,} defer -> fire -> resume cycles, "
                f"{result['cycles']['cycles_per_s']} cycles/s"
            )
    finally:
        await asyncio.to_thread(fleet.stop)
        await store.close()
        if not keep_db:
            await drop_database(admin, db_name)
            shutil.rmtree(work, ignore_errors=True)
    result["logs"] = None if not keep_db else str(work)
    return result


# -- the reference: pgqueuer ---------------------------------------------------------------


async def _pgqueuer(
    admin: str,
    db_name: str,
    cpu: _Cpu,
    *,
    n: int,
    workers: int,
    slots: int,
    batch: int,
) -> dict[str, Any]:
    from benchmarks.throughput_pgq import prepare, settings_of

    url = with_database(admin, db_name)
    with console.status(f"pgqueuer: installing and queueing {n:,} jobs"):
        await prepare(url, n)
    procs: list[asyncio.subprocess.Process] = []
    logs: list[IO[bytes]] = []
    try:
        for _ in range(workers):
            log = tempfile.TemporaryFile()  # noqa: SIM115 (closed below, with the others)
            logs.append(log)
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-c",
                    "from benchmarks.throughput_pgq import worker_main; worker_main()",
                    json.dumps({"url": url, "slots": slots, "batch": batch}),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log,
                    # (A terminal's Ctrl-C reaches the benchmark alone, which kills them below;
                    # a benchmark that dies closes their stdin, which ends them.)
                    start_new_session=True,
                )
            )

        async def line(proc: asyncio.subprocess.Process, expected: str) -> None:
            assert proc.stdout is not None
            got = (await proc.stdout.readline()).decode().strip()
            if got != expected:
                logs[procs.index(proc)].seek(0)
                err = logs[procs.index(proc)].read().decode(errors="replace")[-2000:]
                raise SystemExit(f"bench throughput: a pgqueuer worker said {got!r}:\n{err}")

        def send(text: str) -> None:
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(text.encode())

        await asyncio.wait_for(asyncio.gather(*(line(p, "ready") for p in procs)), 120)
        await asyncio.sleep(0.3)
        groups = {"workers": [p.pid for p in procs]}
        before = await cpu.snapshot(groups)
        opened = time.monotonic()
        send("go\n")
        with console.status(f"pgqueuer: {n:,} jobs"):
            await asyncio.wait_for(asyncio.gather(*(line(p, "done") for p in procs)), 3600)
        wall = time.monotonic() - opened
        spent = _Cpu.spent(before, await cpu.snapshot(groups))
        send("exit\n")
        for proc in procs:
            await proc.wait()
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        for each in logs:
            each.close()
    rows = await _fetch(url, "pgq_log_times")
    left = (await _fetch(url, "pgq_left"))[0][0]
    picked: dict[int, float] = {}
    ended: dict[int, float] = {}
    twice = 0
    for r in rows:
        if r["status"] == "picked":
            picked[r["job_id"]] = min(r["at"], picked.get(r["job_id"], r["at"]))
        else:
            twice += r["job_id"] in ended
            ended[r["job_id"]] = r["at"]
    first = min(picked.values(), default=None)
    last = max(ended.values(), default=None)
    return {
        "jobs": n,
        "succeeded": len(ended),
        "lost": n - len(ended),
        "left_in_queue": left,
        "run_more_than_once": twice,
        "duration_s": None if first is None or last is None else round(last - first, 3),
        "wall_s": round(wall, 3),
        "jobs_per_s": _rate(len(ended), first, last),
        "pick_to_end_ms": percentiles(
            [(ended[j] - picked[j]) * 1000 for j in ended if j in picked]
        ),
        "cpu_s": spent,
        "cpu_ms_per_job": _per_item_ms(spent, max(1, len(ended))),
        "settings": settings_of(slots, batch),
    }


# -- one run, and the sweep ----------------------------------------------------------------


async def _one(
    admin: str,
    settings: Any,
    *,
    n: int,
    cycles: int,
    workers: int,
    slots: int,
    pgq_batch: int,
    pgqueuer: bool,
    keep_db: bool,
    local_server: bool,
) -> dict[str, Any]:
    pg_db = f"bench_pgq_{uuid.uuid4().hex[:12]}"
    load = os.getloadavg()
    result: dict[str, Any] = {
        "n": n,
        "load_avg_at_start": [round(x, 2) for x in load],
    }
    result["engine"] = await _engine(
        admin, settings, n=n, cycles=cycles, workers=workers, slots=slots, keep_db=keep_db,
        local_server=local_server,
    )  # fmt: skip
    if pgqueuer:
        await create_database(admin, pg_db)
        try:
            cpu = _Cpu(admin, [pg_db], local_server)
            result["pgqueuer"] = await _pgqueuer(
                admin, pg_db, cpu, n=n, workers=workers, slots=slots, batch=pgq_batch
            )
        finally:
            if not keep_db:
                await drop_database(admin, pg_db)
        console.print(f"pgqueuer: {n:,} no-op jobs, {result['pgqueuer']['jobs_per_s']} jobs/s")
        ours = result["engine"].get("tasks", {}).get("tasks_per_s")
        theirs = result["pgqueuer"]["jobs_per_s"]
        result["ratio_deferral_to_pgqueuer"] = round(ours / theirs, 3) if ours and theirs else None
        ours_cpu = result["engine"].get("tasks", {}).get("cpu_ms_per_task", {}).get("total")
        theirs_cpu = result["pgqueuer"]["cpu_ms_per_job"]["total"]
        result["cpu_per_item_ratio_deferral_to_pgqueuer"] = (
            round(ours_cpu / theirs_cpu, 3) if ours_cpu and theirs_cpu else None
        )
    result["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return result


def run_throughput(
    *,
    sizes: Sequence[int],
    cycles: int | None,
    workers: int,
    slots: int,
    pgq_batch: int,
    pgqueuer: bool,
    keep_db: bool,
    dsn: str | None,
) -> dict[str, Any]:
    """One run per size in ``sizes`` (one size: a single run; more: the sweep)."""
    settings = load_settings()
    if dsn:
        settings = settings.replace(database_url=dsn)
    local_server = not settings.database_url
    admin = database_url(settings)

    async def main() -> list[dict[str, Any]]:
        runs = []
        for size in sizes:
            runs.append(
                await _one(
                    admin,
                    settings,
                    n=size,
                    cycles=size if cycles is None else cycles,
                    workers=workers,
                    slots=slots,
                    pgq_batch=pgq_batch,
                    pgqueuer=pgqueuer,
                    keep_db=keep_db,
                    local_server=local_server,
                )
            )
        return runs

    runs = asyncio.run(main())
    head: dict[str, Any] = {
        "workers": workers,
        "slots": slots,
        "pgqueuer_batch_size": pgq_batch if pgqueuer else None,
        "server": "embedded" if local_server else "external (--dsn): no PostgreSQL CPU read",
        "machine": {**_machine(), "cpu_model": _cpu_model()},
    }
    if len(runs) == 1:
        return {**head, **runs[0]}
    return {**head, "sweep": runs}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


# -- output --------------------------------------------------------------------------------


def print_table(result: dict[str, Any]) -> None:
    for run in result.get("sweep", [result]):
        _table(run, result)


def _table(run: dict[str, Any], head: dict[str, Any]) -> None:
    table = Table(
        title=f"N={run['n']:,}, {head['workers']} workers x {head['slots']} slots "
        f"(load {run['load_avg_at_start'][0]} at start)"
    )
    table.add_column("figure")
    table.add_column("deferral", justify="right")
    table.add_column("pgqueuer", justify="right")
    tasks = run["engine"].get("tasks")
    pgq = run.get("pgqueuer")

    def cpu(part: dict[str, Any] | None, key: str, group: str) -> str:
        value = None if part is None else part[key].get(group)
        return "-" if value is None else f"{value:.3f}"

    if tasks:
        table.add_row(
            "no-op items / s", str(tasks["tasks_per_s"]), str(pgq["jobs_per_s"]) if pgq else "-"
        )
        table.add_row(
            "claim -> end p50 / p99 (ms)",
            f"{tasks['claim_to_end_ms']['p50']} / {tasks['claim_to_end_ms']['p99']}",
            f"{pgq['pick_to_end_ms']['p50']} / {pgq['pick_to_end_ms']['p99']}" if pgq else "-",
        )
        for group in ("workers", "scheduler", "triggerer", "postgres", "total"):
            table.add_row(
                f"CPU ms per item: {group}",
                cpu(tasks, "cpu_ms_per_task", group),
                cpu(pgq, "cpu_ms_per_job", group),
            )
        table.add_row(
            "lost / run twice",
            f"{tasks['lost']} / {tasks['run_more_than_once']}",
            f"{pgq['lost']} / {pgq['run_more_than_once']}" if pgq else "-",
        )
    if run.get("ratio_deferral_to_pgqueuer") is not None:
        ratio = str(run["ratio_deferral_to_pgqueuer"])
        table.add_row("throughput ratio deferral / pgqueuer", ratio, "")
    cycles = run["engine"].get("cycles")
    if cycles:
        table.add_row("defer -> fire -> resume cycles / s", str(cycles["cycles_per_s"]), "")
        table.add_row("deferrals / s", str(cycles["deferrals_per_s"]), "")
        table.add_row("resumes / s", str(cycles["resumes_per_s"]), "")
        lat = cycles["defer_to_resume_ms"]
        table.add_row("defer -> resumed p50 / p99 (ms)", f"{lat['p50']} / {lat['p99']}", "")
        for group in ("workers", "scheduler", "triggerer", "postgres", "total"):
            table.add_row(f"CPU ms per cycle: {group}", cpu(cycles, "cpu_ms_per_cycle", group), "")
        table.add_row("lost / resumed twice", f"{cycles['lost']} / {cycles['resumed_twice']}", "")
    console.print(table)


def plot_sweep(result: dict[str, Any], path: str) -> None:
    """Throughput against N, each engine's items per second (a small PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result.get("sweep", [result])
    sizes = [r["n"] for r in runs]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    series = [
        ("deferral: no-op tasks", [r["engine"].get("tasks", {}).get("tasks_per_s") for r in runs]),
        (
            "deferral: defer -> resume cycles",
            [r["engine"].get("cycles", {}).get("cycles_per_s") for r in runs],
        ),
        ("pgqueuer: no-op jobs", [r.get("pgqueuer", {}).get("jobs_per_s") for r in runs]),
    ]
    for label, values in series:
        points = [(s, v) for s, v in zip(sizes, values, strict=True) if v is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("N (items per run)")
    ax.set_ylabel("items / s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    machine = result["machine"]
    loads = ", ".join(f"{r['load_avg_at_start'][0]:g}" for r in runs)
    ax.set_title(
        f"bench throughput: {result['workers']} workers x {result['slots']} slots, "
        f"{machine['cpus']} CPUs\n1-min load average at the start of each N: {loads}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
