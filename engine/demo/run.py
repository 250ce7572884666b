"""``deferral demo``: run the bundled DAG on a fresh database with real engine processes.

A scheduler, a worker with a few slots and a triggerer run as child processes (their logs go
to ``<home>/demo.log``, at the ``log_level`` setting). The demo process serves the job API,
creates the run, shows progress live, and ends with a summary and the next steps. Figures are
sampled from the database while the run goes on.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
from rich.console import Console
from rich.live import Live
from rich.table import Table

from engine.client.runs import wait_for_run
from engine.config import Settings
from engine.dags.dagbag import DagBag
from engine.demo import dag as demo_dag
from engine.demo.dag import dag_file_source
from engine.demo.jobs import JobApi
from engine.launch.app import spawn, stop_children
from engine.runtime.runner import run_async
from engine.scheduler.dagsync import sync_dags
from engine.security.keys import child_key_env, keyring_from_settings
from engine.store import Store, TaskInstance, database_url
from engine.store.databases import create_database
from triggers.base import decode_value

__all__ = ["run_demo"]

#: The bundled DAGs folder (the demo DAG at its default size).
DAGS_FOLDER = Path(__file__).resolve().parent / "dags"
DEMO_DB = "deferral_demo"
SAMPLE_S = 0.25


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def _fresh_database(url: str, console: Console) -> str:
    """A new database for the demo on the same server; the given one if we may not create it."""
    try:
        return await create_database(url, DEMO_DB, replace=True)
    except asyncpg.InsufficientPrivilegeError:
        console.print("[yellow]cannot create a demo database; using the configured one[/]")
        return url


class _Sampler:
    """Samples the run from the database every SAMPLE_S seconds."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.held = 0
        self.peak_held = 0
        self.checks_done_s: float | None = None
        self.peak_waiting_slots = 0
        self.states: dict[str, int] = {}

    async def sample(self, store: Store, run_pk: int) -> None:
        self.states = await store.count_task_states(run_pk)
        self.held = sum(t.held for t in await store.list_triggerers())
        self.peak_held = max(self.peak_held, self.held)
        waiters = [
            t
            for t in await store.list_task_instances(dag_id="deferral_demo")
            if t.task_id.startswith(("wait_", "job_"))
        ]
        if self.checks_done_s is None:
            # Every sensor and job runs once on a worker (check, or submit), then defers.
            if all(t.first_try_at is not None and t.state != "running" for t in waiters):
                self.checks_done_s = time.monotonic() - self.started
            return
        # From then on, a waiting task in a slot would be one running without being resumed.
        in_slots = sum(1 for t in waiters if t.state == "running" and not t.next_method)
        self.peak_waiting_slots = max(self.peak_waiting_slots, in_slots)

    def table(self, elapsed: float, total: int) -> Table:
        table = Table(title=f"deferral demo - {elapsed:5.1f}s", title_justify="left")
        table.add_column("state")
        table.add_column("tasks", justify="right")
        for state in (
            "pending",
            "scheduled",
            "running",
            "deferred",
            "success",
            "failed",
            "upstream_failed",
            "up_for_retry",
        ):
            if self.states.get(state):
                table.add_row(state, str(self.states[state]))
        table.add_row("[dim]total[/]", f"[dim]{total}[/]")
        table.add_row("waits held by the triggerer", str(self.held))
        return table


async def _demo(
    settings: Settings, sensors: int, jobs: int, slots: int, window_s: float, console: Console
) -> bool:
    started = time.monotonic()
    keyring = keyring_from_settings(settings)
    url = await _fresh_database(database_url(settings), console)
    store = await Store.connect(url, pool_size=2, keyring=keyring)
    api = JobApi()
    children: list[subprocess.Popen[bytes]] = []
    log_path = settings.home_path / "demo.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        api_url = await api.start()
        # The sizes reach the engine processes in the DAG file itself, not the environment.
        dags_folder = settings.home_path / "demo_dags"
        dags_folder.mkdir(parents=True, exist_ok=True)
        (dags_folder / "deferral_demo.py").write_text(
            dag_file_source(sensors=sensors, jobs=jobs, window_s=window_s)
        )
        demo_settings = settings.replace(
            database_url=url,
            dags_folder=str(dags_folder),
            # The processes' lines go to the log file, not to the terminal: all of them.
            log_level=settings.log_level,
            # The demo's trigger lives in engine.demo.jobs, not in its DAGs folder.
            trigger_allow=("triggers.*", "engine.demo.jobs.*"),
        )
        bag = DagBag(dags_folder)
        await sync_dags(store, bag)
        if bag.import_errors:
            raise RuntimeError(f"demo DAG failed to import: {bag.import_errors}")
        with log_path.open("ab") as log_file:
            for kind, args in (
                ("scheduler", []),
                ("triggerer", ["--capacity", str(max(1000, sensors + jobs))]),
                ("worker", ["--slots", str(slots)]),
            ):
                children.append(
                    spawn(
                        kind,
                        demo_settings,
                        *args,
                        env=child_key_env(settings),
                        stderr=log_file,
                    )
                )
        total = sensors * 2 + jobs * 2
        console.print(
            f"[bold]deferral demo[/]: {sensors} deferrable timer sensors (firing "
            f"{window_s:.0f}-{2 * window_s:.0f}s from now) and {jobs} submit-and-wait jobs, "
            f"each followed by a compute task: {total} tasks on a worker with {slots} slots.\n"
            f"Database: {_shown(url)}\nProcess logs: {log_path}"
        )
        now = await store.now()
        run_id = f"demo__{now.isoformat()}"
        run_pk = await store.create_dag_run(
            "deferral_demo", run_id, logical_date=now, conf={"job_api": api_url}
        )
        sampler = _Sampler()
        deadline = time.monotonic() + 2 * window_s + 60
        state = "running"
        with Live(sampler.table(0, total), console=console, refresh_per_second=4) as live:
            while state == "running" and time.monotonic() < deadline:
                await sampler.sample(store, run_pk)
                live.update(sampler.table(time.monotonic() - started, total))
                for child in children:
                    if child.poll() is not None:
                        raise RuntimeError(
                            f"an engine process exited with {child.returncode}; see {log_path}"
                        )
                state = await wait_for_run(
                    store, "deferral_demo", run_id, SAMPLE_S, poll_s=SAMPLE_S
                )
            await sampler.sample(store, run_pk)
            live.update(sampler.table(time.monotonic() - started, total))
        tis = await store.list_task_instances(dag_id="deferral_demo", run_id=run_id)
        _summary(console, state, tis, sampler, slots, time.monotonic() - started)
        _next_steps(console, dags_folder / "deferral_demo.py", log_path)
        return state == "success"
    finally:
        stop_children(children, grace_s=15)
        await api.stop()
        await store.close()


def _summary(
    console: Console,
    state: str,
    tis: list[TaskInstance],
    sampler: _Sampler,
    slots: int,
    elapsed: float,
) -> None:
    timer_latency: list[float] = []
    job_latency: list[float] = []
    for ti in tis:
        if ti.state != "success" or ti.result is None:
            continue
        result = decode_value(ti.result)
        if isinstance(result, dict) and "due" in result:
            lateness_ms = (result["resumed"] - result["due"]) * 1000
            (timer_latency if ti.task_id.startswith("wait_") else job_latency).append(lateness_ms)
    by_state: dict[str, int] = {}
    for ti in tis:
        by_state[ti.state] = by_state.get(ti.state, 0) + 1
    table = Table(title=f"run {state} in {elapsed:.1f}s", title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key in sorted(by_state):
        table.add_row(f"tasks {key}", str(by_state[key]))
    table.add_row("peak waits held by the triggerer", str(sampler.peak_held))
    if sampler.checks_done_s is not None:
        table.add_row(
            "first checks and submits done (then all deferred)", f"{sampler.checks_done_s:.1f}s"
        )
    table.add_row(
        "peak worker slots held by waiting tasks after that",
        f"{sampler.peak_waiting_slots} of {slots}",
    )
    table.add_row(
        "timer resume latency p50 / p99 (due -> method start)",
        f"{_percentile(timer_latency, 50):.1f} / {_percentile(timer_latency, 99):.1f} ms",
    )
    if job_latency:
        table.add_row(
            "job resume latency p50 / p99 (job end -> method start, 0.5s polls)",
            f"{_percentile(job_latency, 50):.0f} / {_percentile(job_latency, 99):.0f} ms",
        )
    console.print(table)


def _shown(url: str) -> str:
    """The URL without its password (the embedded server's carries one)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{host}"))


def _next_steps(console: Console, dag_file: Path, log_path: Path) -> None:
    console.print(
        f"The demo DAG is {dag_file} (its tasks come from {Path(demo_dag.__file__)}); the "
        f"processes' logs are in {log_path}.\n"
        "Next: write a trigger and a DAG of your own with the tutorial (docs/tutorial.md), then "
        "run your DAGs folder with\n"
        "  deferral standalone --dags FOLDER\n"
        "and start a run from another terminal with\n"
        "  deferral dags trigger DAG_ID --dags FOLDER --wait",
        highlight=False,
        soft_wrap=True,
    )


def run_demo(settings: Settings, *, sensors: int, jobs: int, slots: int, window_s: float) -> bool:
    console = Console()
    try:
        return run_async(_demo, settings, sensors, jobs, slots, window_s, console)
    except KeyboardInterrupt:
        console.print("interrupted")
        return False
