"""Prometheus metrics and the health probes: the names, types and labels the docs promise,
counters that move when an engine runs, and probes that turn 503 when the database stops."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import DAG
from engine.runtime import metrics
from engine.runtime.health import HealthServer, WithHealth, database_check
from engine.runtime.metrics import Metrics
from engine.scheduler.duties import export_fleet
from engine.store import Store
from engine.testing import run_engine
from engine.worker.worker import Worker
from operators.base import BaseOperator, Context
from operators.python import PythonOperator
from tests.helpers import child_env, wait_until
from tests.log_triggers import ChattyOperator
from tests.pg_server import start_server, stop_server
from tests.processes import Children, explained, process_env
from tests.triggerer_support import WaitOn
from tests.triggers_for_tests import NeverTrigger, RaisingTrigger
from triggers.base import BaseTrigger

#: Every metric: its type and its labels. The docs (docs/howto/metrics.md) list the same.
EXPECTED: dict[str, tuple[str, frozenset[str]]] = {
    "deferral_build_info": ("gauge", frozenset({"version", "python"})),
    "deferral_triggers_running": ("gauge", frozenset()),
    "deferral_triggers_capacity": ("gauge", frozenset()),
    "deferral_trigger_starts": ("counter", frozenset({"trigger_class"})),
    "deferral_trigger_events": ("counter", frozenset({"trigger_class"})),
    "deferral_trigger_failures": ("counter", frozenset({"trigger_class"})),
    "deferral_trigger_timeouts": ("counter", frozenset({"trigger_class"})),
    "deferral_loop_blocked_seconds": ("counter", frozenset({"trigger_class"})),
    "deferral_loop_lag_seconds": ("histogram", frozenset()),
    "deferral_db_errors": ("counter", frozenset({"kind"})),
    "deferral_resume_latency_seconds": ("histogram", frozenset()),
    "deferral_worker_slots_used": ("gauge", frozenset()),
    "deferral_worker_slots": ("gauge", frozenset()),
    "deferral_task_outcomes": ("counter", frozenset({"state"})),
    "deferral_claim_batch_size": ("histogram", frozenset({"claim"})),
    "deferral_claim_duration_seconds": ("histogram", frozenset({"claim"})),
    "deferral_write_batch_size": ("histogram", frozenset({"write"})),
    "deferral_write_duration_seconds": ("histogram", frozenset({"write"})),
    "deferral_tasks": ("gauge", frozenset({"state"})),
    "deferral_triggers_unassigned": ("gauge", frozenset()),
    "deferral_pool_open_slots": ("gauge", frozenset({"pool"})),
    "deferral_pool_queued_slots": ("gauge", frozenset({"pool"})),
    "deferral_pool_running_slots": ("gauge", frozenset({"pool"})),
    "deferral_pool_deferred_slots": ("gauge", frozenset({"pool"})),
    "deferral_dag_runs": ("gauge", frozenset({"dag_id", "state"})),
    "deferral_dag_run_duration_seconds": ("histogram", frozenset({"dag_id", "state"})),
    "deferral_scheduling_delay_seconds": ("histogram", frozenset({"dag_id"})),
    "deferral_task_duration_seconds": ("histogram", frozenset({"state"})),
}

#: Labels that would make a time series per task or trigger. (dag_id and pool label names
#: users write, bounded by metrics_max_series: test_metrics_cardinality.py.)
_ID_LABELS = {"id", "trigger", "trigger_id", "task", "task_id", "ti", "run", "run_id"}


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def _touch_every_labelled_metric(m: Metrics) -> None:
    for counter in (m.trigger_starts, m.trigger_events, m.trigger_failures, m.trigger_timeouts):
        counter.labels("triggers.temporal.DateTimeTrigger").inc()
    m.loop_blocked.labels("unknown").inc(0.5)
    m.db_errors.labels("connection").inc()
    m.task_outcomes.labels("success").inc()
    m.claim_batch.labels("tasks").observe(3)
    m.claim_duration.labels("tasks").observe(0.01)
    m.write_batch.labels("task_outcomes").observe(3)
    m.write_duration.labels("task_outcomes").observe(0.01)
    m.tasks.labels("running").set(2)
    for gauge in (m.pool_open_slots, m.pool_queued_slots, m.pool_running_slots):
        gauge.labels("default_pool").set(1)
    m.pool_deferred_slots.labels("default_pool").set(1)
    m.dag_runs.labels("d", "running").set(1)
    m.dag_run_duration.labels("d", "success").observe(3)
    m.scheduling_delay.labels("d").observe(1)
    m.task_duration.labels("success").observe(2)


def test_metric_names_types_and_labels() -> None:
    m = Metrics()
    _touch_every_labelled_metric(m)
    text = m.exposition().decode()
    families = _families(text)
    assert {name: f.type for name, f in families.items()} == {
        name: kind for name, (kind, _) in EXPECTED.items()
    }
    for name, family in families.items():
        assert name.startswith("deferral_")
        _kind, labels = EXPECTED[name]
        for sample in family.samples:
            assert not _ID_LABELS & set(sample.labels), sample
            assert set(sample.labels) - {"le"} == labels, sample
            if family.type == "counter":
                assert sample.name == f"{name}_total", sample
    # Base units: durations in seconds, named so.
    assert all(
        name.endswith("_seconds") for name in families if "lag" in name or "duration" in name
    )


def test_registries_are_per_instance() -> None:
    one, two = Metrics(), Metrics()
    one.task_outcomes.labels("success").inc(5)
    assert _sample(two.exposition().decode(), "deferral_task_outcomes_total", state="success") == 0
    assert _sample(one.exposition().decode(), "deferral_task_outcomes_total", state="success") == 5


@pytest.mark.anyio
async def test_counters_move_when_an_engine_runs(store: Store) -> None:
    fresh = Metrics()
    previous = metrics.current()
    metrics.use(fresh)
    try:
        with DAG(dag_id="counted") as dag:
            ChattyOperator(task_id="talk")
        async with run_engine(store) as engine:
            tis = await engine.run_dag(dag)

            # (The run reads ended once the scheduler's statement commits; the scheduler
            # observes its duration just after: wait for that, not for the row alone.)
            async def observed() -> bool:
                text = fresh.exposition().decode()
                ran = {"dag_id": "counted", "state": "success"}
                return _sample(text, "deferral_dag_run_duration_seconds_count", **ran) == 1

            await wait_until(observed, what="the scheduler observing the run it ended")
            await export_fleet(engine.scheduler)
            assert engine.worker.metrics is fresh
            text = fresh.exposition().decode()
            pools = await store.list_pools()
    finally:
        metrics.use(previous)
    assert tis["__run__"]["state"] == "success"
    chatty = "tests.log_triggers.ChattyTrigger"
    assert _sample(text, "deferral_trigger_starts_total", trigger_class=chatty) == 1
    assert _sample(text, "deferral_trigger_events_total", trigger_class=chatty) == 1
    assert _sample(text, "deferral_trigger_failures_total", trigger_class=chatty) == 0
    assert _sample(text, "deferral_task_outcomes_total", state="deferred") == 1
    assert _sample(text, "deferral_task_outcomes_total", state="success") == 1
    assert _sample(text, "deferral_resume_latency_seconds_count") == 1
    # (one claim, of the try's start: the resume was handed to the worker as its trigger
    # fired, migration 0033, and counts in the resume latency, not as a claim)
    assert _sample(text, "deferral_claim_batch_size_count", claim="tasks") == 1
    assert _sample(text, "deferral_claim_batch_size_sum", claim="triggers") == 1
    assert _sample(text, "deferral_write_batch_size_sum", write="task_outcomes") == 1
    assert _sample(text, "deferral_write_batch_size_sum", write="trigger_events") == 1
    assert _sample(text, "deferral_triggers_capacity") == engine.triggerer.capacity
    assert _sample(text, "deferral_worker_slots") == engine.worker.slots
    assert _sample(text, "deferral_tasks", state="success") == 1
    assert _sample(text, "deferral_triggers_unassigned") == 0
    # The scheduler's families of the fleet: the pools, the runs it ended and their tasks.
    (default_pool,) = [p for p in pools if p.name == "default_pool"]
    assert _sample(text, "deferral_pool_open_slots", pool="default_pool") == default_pool.slots
    assert _sample(text, "deferral_pool_running_slots", pool="default_pool") == 0
    assert _sample(text, "deferral_dag_runs", dag_id="counted", state="running") == 0
    ran = {"dag_id": "counted", "state": "success"}
    assert _sample(text, "deferral_dag_run_duration_seconds_count", **ran) == 1
    assert _sample(text, "deferral_task_duration_seconds_count", state="success") == 1
    # (A manual run has no schedule to be late on.)
    assert _sample(text, "deferral_scheduling_delay_seconds_count", dag_id="counted") == 0


#: The families only one kind of process exports (every process: build info, db errors).
OWN_FAMILIES = {
    "scheduler": {"deferral_tasks", "deferral_triggers_unassigned", "deferral_pool_open_slots"},
    "worker": {"deferral_worker_slots", "deferral_worker_slots_used"},
    "triggerer": {"deferral_triggers_running", "deferral_triggers_capacity"},
}


@pytest.mark.parametrize("kind", sorted(OWN_FAMILIES))
def test_each_process_exports_only_its_own_families(kind: str) -> None:
    """A triggerer exports no `deferral_worker_slots 0`, a worker no fleet gauges."""
    m = Metrics(kind=kind)
    _touch_every_labelled_metric(m)
    names = set(_families(m.exposition().decode()))
    assert {"deferral_build_info", "deferral_db_errors"} <= names
    assert OWN_FAMILIES[kind] <= names
    for other, families in OWN_FAMILIES.items():
        if other != kind:
            assert not families & names, (kind, families & names)
    claims = {"deferral_claim_batch_size", "deferral_write_duration_seconds"}
    assert (claims <= names) == (kind != "scheduler")


class _DeferTo(BaseOperator):
    """Defers to its trigger (with an optional deadline); resumes returning the event."""

    def __init__(self, *, trigger: BaseTrigger, timeout: float | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.trigger = trigger
        self.timeout = timeout

    def execute(self, context: Context) -> None:
        self.defer(trigger=self.trigger, method_name="done", timeout=self.timeout)

    def done(self, context: Context, event: Any = None) -> Any:
        return event


@pytest.mark.anyio
async def test_trigger_failures_and_timeouts_are_counted_by_class(store: Store) -> None:
    fresh = Metrics()
    with DAG(dag_id="failing") as dag:
        _DeferTo(task_id="raises", trigger=RaisingTrigger("boom"), retries=0)
        _DeferTo(task_id="late", trigger=NeverTrigger(_tag()), timeout=0.1, retries=0)
    previous = metrics.current()
    metrics.use(fresh)
    try:
        async with run_engine(store) as engine:
            tis = await engine.run_dag(dag)
            text = fresh.exposition().decode()
    finally:
        metrics.use(previous)
    assert tis["raises"]["state"] == "failed"
    assert tis["late"]["state"] == "failed"
    here = "tests.triggers_for_tests"
    assert (
        _sample(text, "deferral_trigger_failures_total", trigger_class=f"{here}.RaisingTrigger")
        == 1
    )
    assert (
        _sample(text, "deferral_trigger_events_total", trigger_class=f"{here}.RaisingTrigger") == 0
    )
    assert (
        _sample(text, "deferral_trigger_timeouts_total", trigger_class=f"{here}.NeverTrigger") == 1
    )
    assert _sample(text, "deferral_task_outcomes_total", state="deferred") == 2


@pytest.mark.anyio
async def test_blocked_loop_seconds_are_counted_by_the_class_that_blocked(store: Store) -> None:
    fresh = Metrics()
    with DAG(dag_id="offender") as dag:
        WaitOn(task_id="w", trigger="BlockingTrigger", trigger_kwargs={"block_s": 0.2, "times": 0})
    options = {"blocked_loop_s": 0.08, "cancel_blocking_after": 2, "metrics": fresh}
    async with run_engine(store, scheduler=False, triggerer_options=options) as engine:
        await engine.start_run(dag)
        ti = await engine.wait_for_state("offender", "w", "failed")
    assert "blocked the triggerer's event loop" in (ti["error"] or "")
    text = fresh.exposition().decode()
    blocker = "tests.triggerer_support.BlockingTrigger"
    assert _sample(text, "deferral_loop_blocked_seconds_total", trigger_class=blocker) > 0
    assert _sample(text, "deferral_trigger_failures_total", trigger_class=blocker) == 1


@pytest.mark.anyio
async def test_readyz_says_stopping_while_a_worker_drains_and_livez_still_answers(
    store: Store,
) -> None:
    started, release = threading.Event(), threading.Event()

    def long_task() -> None:
        started.set()
        release.wait(60)

    with DAG(dag_id="drain") as dag:
        PythonOperator(task_id="long", python_callable=long_task)
    async with (
        run_engine(store, worker=False, triggerer=False) as engine,
        aiohttp.ClientSession() as http,
    ):
        worker = Worker(store, engine.dagbag, heartbeat_s=0.5, metrics=Metrics())
        server = HealthServer(
            worker.metrics,
            port=0,
            checks={"database": database_check(store.now), **worker.health_checks()},
        )
        served = WithHealth(worker, server)

        async def get(path: str) -> tuple[int, str]:
            async with http.get(f"http://127.0.0.1:{server.bound_port}{path}") as reply:
                return reply.status, await reply.text()

        async with anyio.create_task_group() as tg:
            await tg.start(served.run)
            await engine.start_run(dag)

            async def task_started() -> bool:
                return started.is_set()

            await wait_until(task_started, what="the task to start")
            status, body = await get("/readyz?verbose")
            assert status == 200, body
            assert "[+]heartbeat ok" in body
            served.stop()
            status, body = await get("/readyz?verbose")
            assert status == 503
            assert "[-]stopping failed" in body
            assert (await get("/livez"))[0] == 200
            release.set()
        assert worker.finished == 1


def _tag() -> str:
    return f"metrics-{uuid.uuid4().hex[:8]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def _health(url: str) -> subprocess.CompletedProcess[str]:
    return _cli("health", "--url", url)


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_readyz_turns_503_when_the_database_stops_and_livez_stays_200(
    own_server: Any, tmp_path: Path
) -> None:
    url = own_server.get_uri(database="postgres")
    logs = tmp_path / "logs"
    logs.mkdir()
    kids = Children(process_env(url, tmp_path), logs)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        async with explained(kids):
            kids.start(
                "--log-format",
                "json",
                "triggerer",
                "--capacity",
                "7",
                "--metrics-port",
                str(port),
                name="triggerer",
            )

            async def answers(path: str, status: int) -> bool:
                got, _ = await anyio.to_thread.run_sync(_get, base + path)
                return got == status

            await wait_until(lambda: answers("/readyz", 200), what="/readyz to answer 200")
            status, body = await anyio.to_thread.run_sync(_get, base + "/readyz?verbose")
            assert status == 200
            assert "[+]database ok" in body
            assert "[+]lease ok" in body
            status, text = await anyio.to_thread.run_sync(_get, base + "/metrics")
            assert status == 200
            assert _sample(text, "deferral_triggers_capacity") == 7
            assert "deferral_build_info" in _families(text)
            assert (await anyio.to_thread.run_sync(_health, base)).returncode == 0

            await anyio.to_thread.run_sync(stop_server, own_server)
            await wait_until(lambda: answers("/readyz", 503), what="/readyz to answer 503")
            status, body = await anyio.to_thread.run_sync(_get, base + "/readyz?verbose")
            assert status == 503
            assert "[-]database failed" in body
            assert (await anyio.to_thread.run_sync(_get, base + "/livez"))[0] == 200

            async def errors_counted() -> bool:
                _, text = await anyio.to_thread.run_sync(_get, base + "/metrics")
                return _sample(text, "deferral_db_errors_total", kind="connection") > 0

            await wait_until(errors_counted, what="the lost connection to be counted")
            probe = await anyio.to_thread.run_sync(_health, base)
            assert probe.returncode == 1
            assert "[-]database failed" in probe.stderr

            await anyio.to_thread.run_sync(start_server, own_server)
            await wait_until(lambda: answers("/readyz", 200), what="/readyz to recover")
    finally:
        kids.stop_all()
    # --log-format json: every line of the process is one object naming the process.
    lines = (logs / "triggerer.log").read_text().splitlines()
    docs = [msgspec.json.decode(line) for line in lines if line.startswith("{")]
    assert docs
    assert len(docs) == len([line for line in lines if line.strip()]), lines
    assert {d["process"] for d in docs} == {"triggerer"}
    assert {d["pid"] for d in docs} == {kids.procs[0].pid}


def test_database_errors_are_counted_by_kind() -> None:
    import asyncpg

    m = Metrics()
    for exc in (
        ConnectionRefusedError(),
        asyncpg.ConnectionDoesNotExistError(),
        TimeoutError(),
        asyncpg.SerializationError(),
        asyncpg.DeadlockDetectedError(),
        asyncpg.TooManyConnectionsError(),
        asyncpg.UndefinedTableError(),
        ValueError(),
    ):
        m.count_db_error(exc)
    text = m.exposition().decode()
    counts = {
        kind: _sample(text, "deferral_db_errors_total", kind=kind)
        for kind in ("connection", "timeout", "conflict", "resources", "query", "other")
    }
    assert counts == {
        "connection": 2,
        "timeout": 1,
        "conflict": 2,
        "resources": 1,
        "query": 1,
        "other": 1,
    }


def test_standalone_serves_three_ports_from_the_base() -> None:
    from engine.config import Settings
    from engine.launch.standalone import metrics_ports

    assert metrics_ports(Settings()) == {"scheduler": 9464, "worker": 9465, "triggerer": 9466}
    assert metrics_ports(Settings(metrics_port=9000))["triggerer"] == 9002
    # 0: each child takes a free port (bound by standalone before it starts them).
    assert metrics_ports(Settings(metrics_port=0)) == dict.fromkeys(
        ("scheduler", "worker", "triggerer"), 0
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(test_triggers=False),
    )


def test_health_without_a_metrics_port_checks_the_database(db_url: str) -> None:
    ok = _cli("--database-url", db_url, "health")
    assert ok.returncode == 0, ok.stderr
    assert "[+]database ok" in ok.stdout
    bad = _cli("--database-url", "postgresql://nobody@127.0.0.1:1/none", "health")
    assert bad.returncode == 1
    assert "[-]database failed" in bad.stderr
