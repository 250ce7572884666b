"""Where the engine listens, said honestly: ``deferral standalone`` binds its ports before it
prints an address (a taken port fails at once, naming the flag to change; 0 takes a free one,
whose number is what it prints), and ``deferral status`` lists the running processes, their
pids, versions and addresses, and what holds back the backlog, from the database.

Real commands (``python -m engine``) in child processes, on the test's database."""

from __future__ import annotations

import datetime as dt
import json
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

from engine import DAG
from engine.cli import cli
from engine.store import Store
from engine.version import __version__
from operators.python import PythonOperator
from tests.helpers import wait_until
from tests.processes import Children, explained, process_env

pytestmark = pytest.mark.subprocess

UTC = dt.UTC

DAG_FILE = """\
from engine import DAG
from operators.python import PythonOperator

with DAG(dag_id="ported") as dag:
    PythonOperator(task_id="a", python_callable=lambda: 1)
"""


@pytest.fixture
def dags(tmp_path: Path) -> Path:
    folder = tmp_path / "dags"
    folder.mkdir()
    (folder / "ported.py").write_text(DAG_FILE)
    return folder


def _taken() -> socket.socket:
    """A port another process holds (listening on the loopback address)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def _standalone(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", "standalone", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("flag", "other"),
    [("--webserver-port", ("--no-metrics",)), ("--metrics-port", ("--no-webserver",))],
)
def test_a_taken_port_fails_before_anything_starts_naming_its_flag(
    db_url: str, tmp_path: Path, dags: Path, flag: str, other: tuple[str, ...]
) -> None:
    env = process_env(db_url, tmp_path, dags)
    with _taken() as held:
        port = held.getsockname()[1]
        done = _standalone(env, tmp_path, flag, str(port), *other)
    assert done.returncode == 2, (done.stdout, done.stderr)
    # (Its INFO lines aside: standalone logs what it starts.)
    lines = [line for line in done.stderr.splitlines() if " INFO " not in line and line.strip()]
    assert len(lines) == 1, done.stderr
    assert f"127.0.0.1:{port}" in lines[0]
    assert flag in lines[0], lines[0]
    assert "--port " not in lines[0]  # (standalone has no --port)
    assert "Traceback" not in done.stderr
    # Nothing printed an address it does not serve.
    assert "http://" not in done.stdout, done.stdout


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_port_zero_takes_free_ports_which_are_printed_and_listed_by_status(
    db_url: str, tmp_path: Path, dags: Path, children: Children
) -> None:
    children.env = process_env(db_url, tmp_path, dags)
    children.start("standalone", "--webserver-port", "0", "--metrics-port", "0", name="standalone")
    log = children.logs / "standalone.log"

    async def printed() -> bool:
        return "status page" in log.read_text() and "metrics and health" in log.read_text()

    async with explained(children):
        await wait_until(printed, what="standalone to print its addresses")
        text = log.read_text()
        page = re.search(r"status page: (http://\S+)", text)
        assert page is not None, text
        metrics = dict(re.findall(r"(scheduler|worker|triggerer) (http://\S+/metrics)", text))
        assert set(metrics) == {"scheduler", "worker", "triggerer"}, text
        assert ":0/" not in page.group(1)
        assert all(":0/" not in u for u in metrics.values())
        # The printed addresses are served, each process its own families.
        status, _ = await anyio.to_thread.run_sync(_get, page.group(1))
        assert status == 200
        _, scraped = await anyio.to_thread.run_sync(_get, metrics["triggerer"])
        assert "deferral_triggers_capacity" in scraped
        assert "deferral_worker_slots" not in scraped

        def listed() -> dict[str, Any]:
            result = CliRunner().invoke(
                cli, ["status", "--json"], env={"DEFERRAL_DATABASE_URL": db_url}
            )
            assert result.exit_code == 0, result.output
            found: dict[str, Any] = json.loads(result.stdout)
            return found

        async def all_listed() -> bool:
            found = await anyio.to_thread.run_sync(listed)
            urls = {p["kind"]: p["url"] for p in found["processes"]}
            return urls == {**metrics, "webserver": page.group(1)}

        await wait_until(all_listed, what="status to list the four processes and addresses")
        found = await anyio.to_thread.run_sync(listed)
        for process in found["processes"]:
            assert process["version"] == __version__
            assert process["pid"] > 0
            assert not process["silent"]
        shown = await anyio.to_thread.run_sync(_status_table, db_url)
        for url in [page.group(1), *metrics.values()]:
            assert url in shown, shown


def _status_table(db_url: str) -> str:
    result = CliRunner().invoke(cli, ["status", "--wide"], env={"DEFERRAL_DATABASE_URL": db_url})
    assert result.exit_code == 0, result.output
    return result.stdout


def _noop() -> None:
    return None


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_the_backlog_says_what_a_pool_a_limit_and_the_workers_hold_back(
    store: Store, db_url: str
) -> None:
    """Five runnable tasks, no worker: a pool of one slot holds two of its three, a DAG's
    max_active_tasks=1 one of its two; two wait for a worker."""
    await store.set_pool("small", 1)
    with DAG(dag_id="pooled") as pooled:
        for name in "abc":
            PythonOperator(task_id=name, python_callable=_noop, pool="small")
    with DAG(dag_id="capped", max_active_tasks=1) as capped:
        for name in "xy":
            PythonOperator(task_id=name, python_callable=_noop)
    for dag in (pooled, capped):
        tasks, schedule = dag.serialize_tasks(), dag.serialize_schedule()
        await store.upsert_dag(dag.dag_id, f"{dag.dag_id}.py", tasks, None, schedule)
        await store.create_dag_run(
            dag.dag_id, "r1", logical_date=dt.datetime(2026, 1, 1, tzinfo=UTC)
        )
    backlog = (await store.fleet()).backlog
    assert (backlog.runnable, backlog.held_by_pool, backlog.held_by_limit) == (5, 2, 1)
    assert backlog.waiting_for_worker == 2

    def status() -> str:
        result = CliRunner().invoke(cli, ["status"], env={"DEFERRAL_DATABASE_URL": db_url})
        assert result.exit_code == 0, result.output
        return result.stdout

    out = await anyio.to_thread.run_sync(status)
    said = "5 runnable task(s) not claimed (2 held by a pool, 1 by a limit, 2 waiting for a worker)"
    assert said in out, out
