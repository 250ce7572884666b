"""The sensor-fleet benchmark's run (see :mod:`benchmarks.fleet`); imported only when it runs."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import platform
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import asyncpg
import psutil
from rich.console import Console
from rich.table import Table

from engine.config import load_settings
from engine.dags.dag import DAG
from engine.dags.dagbag import DagBag
from engine.scheduler.scheduler import Scheduler
from engine.store import Store, database_url
from engine.store.databases import create_database, drop_database
from engine.store.queries import load_queries
from engine.triggerer import Triggerer
from engine.worker.worker import Worker
from operators.base import Context
from operators.python import PythonOperator
from operators.sensors import FileSensor

__all__ = ["plot_slots", "print_table", "run_fleet"]

DAG_ID = "sensor_fleet"
#: The pools of ``bench fleet --pools``: the sensors' (counting deferred ones) and the
#: compute tasks'.
SENSOR_POOL = "sensors"
COMPUTE_POOL = "compute"
#: Resolution of the slots-held timeline kept in the JSON (seconds).
TIMELINE_STEP_S = 0.5
FINISHED = ("success", "failed", "skipped", "upstream_failed")

console = Console(stderr=True)


# -- what the fleet's tasks record, in this process ---------------------------------------


class _Recorder:
    """Slot use of sensors and compute tasks, on the process's monotonic clock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.sensors_holding = 0
            self.peak_sensors = 0
            self.computes_running = 0
            self.sensor_calls = 0
            self.sensor_busy_s = 0.0
            self.compute_started: dict[str, float] = {}

    def sensor_started(self) -> float:
        with self.lock:
            self.sensors_holding += 1
            self.sensor_calls += 1
            self.peak_sensors = max(self.peak_sensors, self.sensors_holding)
        return time.monotonic()

    def sensor_ended(self, started: float) -> None:
        with self.lock:
            self.sensors_holding -= 1
            self.sensor_busy_s += time.monotonic() - started

    def compute_begins(self, run_id: str) -> None:
        with self.lock:
            self.compute_started.setdefault(run_id, time.monotonic())
            self.computes_running += 1

    def compute_ends(self) -> None:
        with self.lock:
            self.computes_running -= 1


RECORDER = _Recorder()


class FleetSensor(FileSensor):
    """Waits for ``<folder>/<run_id>.ready``; records how long it holds a worker slot."""

    def __init__(self, *, folder: str, **kwargs: Any) -> None:
        super().__init__(filepath=folder, **kwargs)
        self.folder = folder

    def execute(self, context: Context) -> Any:
        self.filepath = os.path.join(self.folder, f"{context['run_id']}.ready")
        started = RECORDER.sensor_started()
        try:
            return super().execute(context)
        finally:
            RECORDER.sensor_ended(started)


def compute(run_id: str, compute_s: float) -> None:
    """The short downstream task: holds its slot for ``compute_s`` seconds."""
    RECORDER.compute_begins(run_id)
    try:
        time.sleep(compute_s)
    finally:
        RECORDER.compute_ends()


def _fleet_dag(
    mode: str, folder: str, poke_interval_s: float, compute_s: float, *, pools: bool = False
) -> DAG:
    ways: dict[str, dict[str, Any]] = {
        "poke": {"mode": "poke", "deferrable": False},
        "reschedule": {"mode": "reschedule", "deferrable": False},
        "deferrable": {"deferrable": True},
    }
    how = ways[mode]
    sensor_pool: dict[str, Any] = {"pool": SENSOR_POOL} if pools else {}
    compute_pool: dict[str, Any] = {"pool": COMPUTE_POOL} if pools else {}
    with DAG(dag_id=DAG_ID) as dag:
        sensor = FleetSensor(
            task_id="sense",
            folder=folder,
            poke_interval=poke_interval_s,
            timeout=24 * 3600,
            **how,
            **sensor_pool,
        )
        sensor >> PythonOperator(
            task_id="compute",
            python_callable=compute,
            op_kwargs={"compute_s": compute_s},
            **compute_pool,
        )
    return dag


# -- numbers ------------------------------------------------------------------------------


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p99 (nearest rank), rounded to 0.1."""
    if not values:
        return {"p50": None, "p99": None}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p * len(ordered)) - 1))]

    return {"p50": round(rank(0.50), 1), "p99": round(rank(0.99), 1)}


def _machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


# -- one mode against its own database ----------------------------------------------------


class _Statements:
    """Counts every statement the engine's pool runs (asyncpg query logger), by query name."""

    def __init__(self) -> None:
        self.count = 0
        self.pool_resets = 0
        self.by_name: dict[str, int] = {}
        self._names = {sql: name for name, sql in load_queries().items()}

    def reset(self) -> None:
        self.count = 0
        self.pool_resets = 0
        self.by_name = {}

    def __call__(self, record: Any) -> None:
        query = record.query.strip()
        if query.startswith("SELECT pg_advisory_unlock_all()"):
            # asyncpg's reset of a connection on its release to the pool (the store turns it
            # off; counted apart should it come back).
            self.pool_resets += 1
            return
        self.count += 1
        name = self._names.get(record.query) or query.split()[0].upper()
        self.by_name[name] = self.by_name.get(name, 0) + 1

    def attach(self, conn: asyncpg.Connection) -> None:
        conn.add_query_logger(self)


async def _run_mode(
    admin_url: str,
    mode: str,
    *,
    n: int,
    slots: int,
    window_s: float,
    poke_interval_s: float,
    compute_ms: float,
    seed: int,
    keep_db: bool,
    pools: bool = False,
) -> dict[str, Any]:
    db_name = f"deferral_fleet_{mode}_{uuid.uuid4().hex[:8]}"
    url = await create_database(admin_url, db_name)
    folder = tempfile.mkdtemp(prefix=f"fleet-{mode}-")
    statements = _Statements()
    # The engine's own pool (as every process opens it), with a query logger on each connection.
    store = await Store.connect(url, pool_size=8, on_connect=statements.attach)
    monitor = await Store.connect(url, pool_size=2, migrate=False)
    try:
        if pools:
            # A slot for every task of each kind, the sensors' deferrals counted: the pools
            # hold none back; what they cost is what is measured.
            await store.set_pool(SENSOR_POOL, n, include_deferred=True)
            await store.set_pool(COMPUTE_POOL, n)
        dag = _fleet_dag(mode, folder, poke_interval_s, compute_ms / 1000, pools=pools)
        dagbag = DagBag(None)
        dagbag.add_dag(dag)
        await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
        return await _measure(
            store,
            monitor,
            dagbag,
            statements,
            mode,
            folder,
            n=n,
            slots=slots,
            window_s=window_s,
            seed=seed,
        )
    finally:
        await monitor.close()
        await store.close()
        shutil.rmtree(folder, ignore_errors=True)
        if not keep_db:
            await drop_database(admin_url, db_name)


async def _measure(
    store: Store,
    monitor: Store,
    dagbag: DagBag,
    statements: _Statements,
    mode: str,
    folder: str,
    *,
    n: int,
    slots: int,
    window_s: float,
    seed: int,
) -> dict[str, Any]:
    RECORDER.reset()
    rng = random.Random(seed)
    due = sorted((rng.uniform(0, window_s), f"r{i:06d}") for i in range(n))
    created: dict[str, float] = {}
    timeline: list[tuple[float, int, int]] = []
    worker = Worker(store, dagbag, slots=slots, poll_interval_s=1.0, heartbeat_s=5.0)
    triggerer = Triggerer(store, capacity=n + 10, poll_interval_s=1.0)
    scheduler = Scheduler(store, None, interval_s=1.0)
    done = anyio.Event()

    async def create_files(start: float) -> None:
        for at, run_id in due:
            delay = start + at - time.monotonic()
            if delay > 0:
                await anyio.sleep(delay)
            await anyio.Path(folder, f"{run_id}.ready").touch()
            created[run_id] = time.monotonic()

    async def sample(t0: float) -> None:
        while not done.is_set():
            timeline.append(
                (time.monotonic() - t0, RECORDER.sensors_holding, RECORDER.computes_running)
            )
            await anyio.sleep(0.1)

    async def wait_all_finished() -> None:
        while True:
            states = await monitor.count_task_states()
            if sum(states.get(s, 0) for s in FINISHED) >= 2 * n:
                return
            await anyio.sleep(0.25)

    # The runs exist before the engine starts, so every mode starts from the same backlog and
    # creating them is not part of the measure (their statements are counted).
    statements.reset()
    started = time.monotonic()
    now = await store.now()
    with console.status(f"[{mode}] creating {n} runs"):
        for _, run_id in sorted(due, key=lambda d: d[1]):
            await store.create_dag_run(DAG_ID, run_id, logical_date=now)
    create_runs_s = time.monotonic() - started
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)
        await tg.start(triggerer.run)
        await tg.start(worker.run)
        t0 = time.monotonic()
        tg.start_soon(sample, t0)
        tg.start_soon(create_files, t0)
        with console.status(f"[{mode}] {n} sensors on {slots} slots"):
            await wait_all_finished()
        makespan_s = time.monotonic() - t0
        done.set()
        for process in (worker, triggerer, scheduler):
            process.stop()
    tis = await monitor.list_task_instances(dag_id=DAG_ID, limit=4 * n)
    compute_tis = [ti for ti in tis if ti.task_id == "compute"]
    sensor_states: dict[str, int] = {}
    for ti in tis:
        if ti.task_id == "sense":
            sensor_states[ti.state] = sensor_states.get(ti.state, 0) + 1
    queue_ms = [
        (ti.started_at - ti.run_after).total_seconds() * 1000
        for ti in compute_tis
        if ti.started_at is not None and ti.run_after is not None
    ]
    latency_ms = [
        (RECORDER.compute_started[run_id] - created[run_id]) * 1000
        for run_id in created
        if run_id in RECORDER.compute_started
    ]
    return {
        "makespan_s": round(makespan_s, 2),
        "create_runs_s": round(create_runs_s, 2),
        "slot_seconds_waiting": round(RECORDER.sensor_busy_s, 1),
        "peak_slots_waiting": RECORDER.peak_sensors,
        "compute_queue_delay_ms": percentiles(queue_ms),
        "db_statements_per_sensor": round(statements.count / n, 1),
        "db_pool_resets_per_sensor": round(statements.pool_resets / n, 1),
        "db_statements_by_query": dict(
            sorted(statements.by_name.items(), key=lambda kv: -kv[1])[:12]
        ),
        "condition_to_downstream_ms": percentiles(latency_ms),
        "sensor_calls_on_workers": RECORDER.sensor_calls,
        "sensor_states": sensor_states,
        "slots_timeline": _downsample(timeline),
    }


def _downsample(timeline: list[tuple[float, int, int]]) -> list[list[float]]:
    """``[t, sensors holding slots, computes running]`` at TIMELINE_STEP_S, peaks kept."""
    out: list[list[float]] = []
    bucket: list[tuple[float, int, int]] = []
    edge = TIMELINE_STEP_S
    for point in timeline:
        if point[0] >= edge and bucket:
            out.append(
                [
                    round(edge - TIMELINE_STEP_S, 1),
                    max(p[1] for p in bucket),
                    max(p[2] for p in bucket),
                ]
            )
            bucket = []
            while point[0] >= edge:
                edge += TIMELINE_STEP_S
        bucket.append(point)
    if bucket:
        out.append(
            [round(edge - TIMELINE_STEP_S, 1), max(p[1] for p in bucket), max(p[2] for p in bucket)]
        )
    return out


@contextlib.contextmanager
def _quiet_loggers() -> Iterator[None]:
    """The engine's INFO lines off while the fleet runs, and put back after: the fleet runs
    in the caller's process (tests included)."""
    noisy = [logging.getLogger(name) for name in ("engine", "operators", "triggers")]
    levels = [logger.level for logger in noisy]
    for logger in noisy:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(noisy, levels, strict=True):
            logger.setLevel(level)


def run_fleet(
    *,
    modes: Sequence[str],
    n: int,
    slots: int,
    window_s: float,
    poke_interval_s: float,
    compute_ms: float,
    seed: int,
    keep_db: bool,
    pools: bool = False,
) -> dict[str, Any]:
    """Run the fleet in each mode, one after another, each against a fresh database
    (``pools``: the sensors and the compute tasks each in a pool of their own)."""
    with _quiet_loggers():
        settings = load_settings()
        admin_url = database_url(settings)
        result: dict[str, Any] = {
            "sensors": n,
            "slots": slots,
            "window_s": window_s,
            "poke_interval_s": poke_interval_s,
            "compute_ms": compute_ms,
            "seed": seed,
            "pools": pools,
            "machine": _machine(),
            "modes": {},
        }
        for mode in modes:

            async def one(mode: str = mode) -> dict[str, Any]:
                return await _run_mode(
                    admin_url,
                    mode,
                    n=n,
                    slots=slots,
                    window_s=window_s,
                    poke_interval_s=poke_interval_s,
                    compute_ms=compute_ms,
                    seed=seed,
                    keep_db=keep_db,
                    pools=pools,
                )

            result["modes"][mode] = anyio.run(
                one, backend="asyncio", backend_options={"use_uvloop": True}
            )
            console.print(f"{mode}: makespan {result['modes'][mode]['makespan_s']} s")
        return result


# -- output -------------------------------------------------------------------------------


def print_table(result: dict[str, Any]) -> None:
    table = Table(
        title=f"sensor fleet: {result['sensors']} sensors, {result['slots']} slots, window "
        f"{result['window_s']:g} s, poke interval {result['poke_interval_s']:g} s"
        + (", sensors and compute in pools" if result.get("pools") else "")
    )
    table.add_column("metric")
    modes = list(result["modes"])
    for mode in modes:
        table.add_column(mode, justify="right")

    def row(label: str, get: Any) -> None:
        table.add_row(label, *[str(get(result["modes"][m])) for m in modes])

    row("makespan (s)", lambda m: m["makespan_s"])
    row("slot-seconds waiting", lambda m: m["slot_seconds_waiting"])
    row("peak slots waiting", lambda m: m["peak_slots_waiting"])
    row("compute queue delay p50 (ms)", lambda m: m["compute_queue_delay_ms"]["p50"])
    row("compute queue delay p99 (ms)", lambda m: m["compute_queue_delay_ms"]["p99"])
    row("condition -> downstream p50 (ms)", lambda m: m["condition_to_downstream_ms"]["p50"])
    row("condition -> downstream p99 (ms)", lambda m: m["condition_to_downstream_ms"]["p99"])
    row("DB statements per sensor", lambda m: m["db_statements_per_sensor"])
    row("sensor calls on workers", lambda m: m["sensor_calls_on_workers"])
    console.print(table)


def plot_slots(result: dict[str, Any], path: str) -> None:
    """Slots held by waiting sensors (and by compute tasks) over time, one panel per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    fig, axes = plt.subplots(
        len(modes), 1, figsize=(9, 2.6 * len(modes)), sharex=True, squeeze=False
    )
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        points = result["modes"][mode]["slots_timeline"]
        t = [p[0] for p in points]
        ax.fill_between(
            t, [p[1] for p in points], step="post", alpha=0.6, label="slots held by waiting sensors"
        )
        ax.plot(
            t,
            [p[2] for p in points],
            drawstyle="steps-post",
            color="tab:orange",
            label="slots running compute",
        )
        ax.axhline(result["slots"], color="grey", linestyle="--", linewidth=1)
        ax.axvspan(0, result["window_s"], color="grey", alpha=0.1, label="conditions come true")
        ax.set_ylim(0, result["slots"] + 1)
        ax.set_ylabel("slots")
        ax.set_title(f"{mode}: makespan {result['modes'][mode]['makespan_s']} s", fontsize=10)
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the engine started on the backlog of runs")
    fig.suptitle(f"{result['sensors']} sensors on {result['slots']} worker slots")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
