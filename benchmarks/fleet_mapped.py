"""``bench fleet --mapped``: the sensor fleet built from data, one run of one DAG in which an
upstream task returns the N files to wait for and a deferrable FileSensor is expanded over
that list (``FileSensor.partial(...).expand(filepath=files.output)``), followed by one
task that reads the N results.

The figure of interest is the fan-out: from the upstream task's end to all N instances
deferred (the worker claims the mapped task, reads the list, makes the N instances in one
statement, then claims and defers them), taken from the database's own timestamps (the
upstream's ``ended_at``, the instances' ``deferred_at``). Then the conditions come true over
the window, as in the fleet's other modes: makespan, slot-seconds the sensors spent on
worker slots (one check each, then deferred) and the statements per sensor. Imported only
when it runs.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
import uuid
from typing import Any

import anyio
import asyncpg

from benchmarks.fleet_run import RECORDER, _machine, _quiet_loggers, _Statements
from engine.config import load_settings
from engine.dags.dag import DAG
from engine.dags.dagbag import DagBag
from engine.scheduler.scheduler import Scheduler
from engine.store import Store, database_url
from engine.store.databases import create_database, drop_database
from engine.triggerer import Triggerer
from engine.worker.worker import Worker
from operators.base import Context
from operators.python import PythonOperator
from operators.sensors import FileSensor

__all__ = ["run_mapped_fleet"]

DAG_ID = "sensor_fleet_mapped"
RUN_ID = "mapped"


class _MappedSensor(FileSensor):
    """A FileSensor that records how long each of its checks held a worker slot."""

    def execute(self, context: Context) -> Any:
        started = RECORDER.sensor_started()
        try:
            return super().execute(context)
        finally:
            RECORDER.sensor_ended(started)


def _files(paths: list[str]) -> list[str]:
    return paths


def _collect(ti: Any) -> int:
    return len(ti.xcom_pull(task_ids="sense") or [])


def _dag(paths: list[str], poke_interval_s: float) -> DAG:
    with DAG(dag_id=DAG_ID) as dag:
        files = PythonOperator(task_id="files", python_callable=_files, op_args=[paths])
        sensors = _MappedSensor.partial(
            task_id="sense", deferrable=True, poke_interval=poke_interval_s, timeout=24 * 3600
        ).expand(filepath=files.output)
        sensors >> PythonOperator(task_id="collect", python_callable=_collect)
    return dag


_READ_OUT = """
SELECT (SELECT ended_at FROM deferral_task_instances WHERE task_id = 'files') AS upstream_end,
       min(deferred_at) AS first_deferred, max(try_queued_at) AS expanded_at,
       max(deferred_at) AS last_deferred, count(*) AS instances,
       count(*) FILTER (WHERE state = 'success') AS succeeded
FROM deferral_task_instances WHERE task_id = 'sense'
"""


async def _read_out(url: str) -> asyncpg.Record:
    """The benchmark's own read-out (the engine's statements are its own)."""
    conn = await asyncpg.connect(url)
    try:
        row = await conn.fetchrow(_READ_OUT)
        assert row is not None
        return row
    finally:
        await conn.close()


async def _run(
    admin_url: str,
    *,
    n: int,
    slots: int,
    window_s: float,
    poke_interval_s: float,
    seed: int,
    keep_db: bool,
) -> dict[str, Any]:
    db_name = f"deferral_fleet_mapped_{uuid.uuid4().hex[:8]}"
    url = await create_database(admin_url, db_name)
    folder = tempfile.mkdtemp(prefix="fleet-mapped-")
    statements = _Statements()
    store = await Store.connect(url, pool_size=8, on_connect=statements.attach)
    monitor = await Store.connect(url, pool_size=2, migrate=False)
    try:
        RECORDER.reset()
        rng = random.Random(seed)
        paths = [os.path.join(folder, f"f{i:06d}.ready") for i in range(n)]
        due = sorted((rng.uniform(0, window_s), p) for p in paths)
        dag = _dag(paths, poke_interval_s)
        dagbag = DagBag(None)
        dagbag.add_dag(dag)
        await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
        worker = Worker(
            store, dagbag, slots=slots, poll_interval_s=1.0, heartbeat_s=5.0, max_map_length=n
        )
        triggerer = Triggerer(store, capacity=n + 10, poll_interval_s=1.0)
        scheduler = Scheduler(store, None, interval_s=1.0)

        async def all_deferred() -> None:
            while True:
                if (await monitor.count_task_states()).get("deferred", 0) >= n:
                    return
                await anyio.sleep(0.05)

        async def all_done() -> None:
            while True:
                run = await monitor.get_dag_run(DAG_ID, RUN_ID)
                if run is not None and run.state not in ("running", "queued"):
                    return
                await anyio.sleep(0.25)

        statements.reset()
        async with anyio.create_task_group() as tg:
            await tg.start(scheduler.run)
            await tg.start(triggerer.run)
            await tg.start(worker.run)
            t0 = time.monotonic()
            await store.create_dag_run(DAG_ID, RUN_ID, logical_date=await store.now())
            await all_deferred()
            fan_out_statements = statements.count
            # Every sensor waits: now their conditions come true over the window.
            t1 = time.monotonic()
            for at, path in due:
                delay = t1 + at - time.monotonic()
                if delay > 0:
                    await anyio.sleep(delay)
                await anyio.Path(path).touch()
            await all_done()
            makespan_s = time.monotonic() - t0
            for process in (worker, triggerer, scheduler):
                process.stop()
        row = await _read_out(url)
        run = await monitor.get_dag_run(DAG_ID, RUN_ID)
        to_deferred = (row["last_deferred"] - row["upstream_end"]).total_seconds()
        return {
            "upstream_end_to_all_deferred_s": round(to_deferred, 3),
            # (an instance's first try was due from its expansion: try_queued_at)
            "upstream_end_to_expanded_s": round(
                (row["expanded_at"] - row["upstream_end"]).total_seconds(), 3
            ),
            "instances": row["instances"],
            "sensors_succeeded": row["succeeded"],
            "run_state": None if run is None else run.state,
            "makespan_s": round(makespan_s, 2),
            "slot_seconds_waiting": round(RECORDER.sensor_busy_s, 2),
            "peak_slots_waiting": RECORDER.peak_sensors,
            "sensor_calls_on_workers": RECORDER.sensor_calls,
            "db_statements_per_sensor": round(statements.count / n, 1),
            "db_statements_per_sensor_to_deferred": round(fan_out_statements / n, 2),
            "db_statements_by_query": dict(
                sorted(statements.by_name.items(), key=lambda kv: -kv[1])[:12]
            ),
        }
    finally:
        await monitor.close()
        await store.close()
        shutil.rmtree(folder, ignore_errors=True)
        if not keep_db:
            await drop_database(admin_url, db_name)


def run_mapped_fleet(
    *, n: int, slots: int, window_s: float, poke_interval_s: float, seed: int, keep_db: bool
) -> dict[str, Any]:
    """The mapped fleet against a fresh database; its figures."""
    with _quiet_loggers():
        admin_url = database_url(load_settings())

        async def one() -> dict[str, Any]:
            return await _run(
                admin_url,
                n=n,
                slots=slots,
                window_s=window_s,
                poke_interval_s=poke_interval_s,
                seed=seed,
                keep_db=keep_db,
            )

        # (the machine may be shared: how busy it was is part of the figures)
        load_at_start = round(os.getloadavg()[0], 2)
        figures = anyio.run(one, backend="asyncio", backend_options={"use_uvloop": True})
        return {
            "sensors": n,
            "slots": slots,
            "window_s": window_s,
            "poke_interval_s": poke_interval_s,
            "seed": seed,
            "mapped": True,
            "machine": _machine(),
            "load_avg_1m_at_start": load_at_start,
            "figures": figures,
        }


def print_mapped(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    figures = result["figures"]
    table = Table(
        title=f"mapped sensor fleet: {result['sensors']} sensors from one expand, "
        f"{result['slots']} slots, window {result['window_s']:g} s, load average "
        f"{result['load_avg_1m_at_start']:g} at the start"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, key in (
        ("upstream end -> all instances deferred (s)", "upstream_end_to_all_deferred_s"),
        ("upstream end -> instances made (s)", "upstream_end_to_expanded_s"),
        ("instances", "instances"),
        ("sensors succeeded", "sensors_succeeded"),
        ("run state", "run_state"),
        ("makespan (s)", "makespan_s"),
        ("slot-seconds waiting", "slot_seconds_waiting"),
        ("peak slots waiting", "peak_slots_waiting"),
        ("sensor calls on workers", "sensor_calls_on_workers"),
        ("DB statements per sensor", "db_statements_per_sensor"),
        ("  of which until deferred", "db_statements_per_sensor_to_deferred"),
    ):
        table.add_row(label, str(figures[key]))
    Console(stderr=True).print(table)
