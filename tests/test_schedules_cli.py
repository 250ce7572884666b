"""Schedules through the CLI and engine processes: ``dags trigger --logical-date``, ``runs
list``, ``dags pause/unpause``, ``dags backfill`` and two scheduler processes at once."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.store import Store
from tests.helpers import wait_until
from tests.processes import Children, explained, process_env

pytestmark = pytest.mark.anyio

DAG_FILE = """
import datetime as dt
from engine import DAG
from operators.base import FailTask
from operators.python import PythonOperator


def work(logical_date):
    if logical_date.day == 2 and logical_date.year == 2024:
        raise FailTask("the 2nd of January is bad")


with DAG("daily", schedule="@daily", start_date=dt.datetime(2024, 1, 1),
         is_paused_upon_creation=True, params={"region": "eu"}):
    PythonOperator(task_id="t", python_callable=work)

START = dt.datetime.now(dt.UTC).replace(second=0, microsecond=0) - dt.timedelta(minutes=40)
for n in range(4):
    with DAG(f"minutely{n}", schedule="* * * * *", start_date=START, catchup=True):
        PythonOperator(task_id="t", python_callable=work)
"""


@pytest.fixture
def dags_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "dags"
    folder.mkdir()
    (folder / "scheduled.py").write_text(textwrap.dedent(DAG_FILE))
    return folder


def cli(env: dict[str, str], *args: str, cwd: Path, timeout_s: float = 90.0) -> tuple[int, str]:
    """``python -m engine ARGS``; its exit code and what it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"deferral {' '.join(args)} kept running:\n{out.decode(errors='replace')}")
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.subprocess
def test_trigger_with_a_logical_date_and_runs_list(
    db_url: str, tmp_path: Path, dags_folder: Path
) -> None:
    env = process_env(db_url, tmp_path, dags_folder)
    code, out = cli(
        env, "dags", "trigger", "daily", "--logical-date", "2024-01-02T05:00", cwd=tmp_path
    )
    assert code == 0, out
    code, out = cli(env, "runs", "list", "--dag", "daily", "--json", cwd=tmp_path)
    assert code == 0, out
    (listed,) = json.loads(out)
    keys = ("dag_id", "run_id", "run_type", "logical_date", "data_interval_start",
            "data_interval_end", "state")  # fmt: skip
    assert {key: listed[key] for key in keys} == {
        "dag_id": "daily",
        "run_id": "manual__2024-01-02T05:00:00+00:00",
        "run_type": "manual",
        "logical_date": "2024-01-02T05:00:00Z",
        "data_interval_start": "2024-01-01T00:00:00Z",
        "data_interval_end": "2024-01-02T00:00:00Z",
        "state": "running",
    }
    code, out = cli(env, "runs", "list", "--state", "success", "--json", cwd=tmp_path)
    assert (code, json.loads(out)) == (0, [])
    code, out = cli(env, "runs", "list", "--state", "bogus", cwd=tmp_path)
    assert code == 2, out
    assert "--state" in out, out
    code, out = cli(env, "dags", "trigger", "daily", "--logical-date", "yesterday", cwd=tmp_path)
    assert code == 2, out
    assert "--logical-date" in out, out
    assert "Traceback" not in out, out


@pytest.mark.subprocess
def test_pause_and_unpause(db_url: str, tmp_path: Path, dags_folder: Path) -> None:
    env = process_env(db_url, tmp_path, dags_folder)
    code, out = cli(env, "dags", "list", "--json", cwd=tmp_path)
    assert code == 0, out
    # (The JSON is stdout's one line; the log (LOG_LEVEL=INFO, on stderr) may say more.)
    listing = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    daily = next(d for d in listing["dags"] if d["dag_id"] == "daily")
    assert (daily["is_paused"], daily["schedule"]) == (True, "@daily")
    assert daily["next_dagrun"] is not None
    # The next run's logical date starts its interval; it is created when the interval ends.
    next_run = dt.datetime.fromisoformat(daily["next_dagrun"])
    created = dt.datetime.fromisoformat(daily["next_dagrun_create_after"])
    assert created - next_run == dt.timedelta(days=1)
    code, out = cli(env, "dags", "unpause", "daily", cwd=tmp_path)
    assert code == 0, out
    code, out = cli(env, "dags", "list", "--wide", cwd=tmp_path)
    assert code == 0, out
    assert "@daily" in out, out
    assert "created at" in out, out
    (row,) = [line for line in out.splitlines() if line.lstrip("│ ").startswith("daily")]
    assert created.astimezone(dt.UTC).isoformat() in row, out
    code, out = cli(env, "dags", "pause", "daily", cwd=tmp_path)
    assert code == 0, out
    assert "paused" in out, out
    code, out = cli(env, "dags", "pause", "no_such_dag", cwd=tmp_path)
    assert code == 2, out
    assert "no_such_dag" in out, out


@pytest.mark.subprocess
async def test_backfill_waits_and_exits_1_when_a_run_failed(
    db_url: str, tmp_path: Path, dags_folder: Path, children: Children, store: Store
) -> None:
    env = process_env(db_url, tmp_path, dags_folder)
    children.env = env
    async with explained(children):
        children.start("worker", name="worker")
        children.start("scheduler", name="scheduler")
        code, out = cli(
            env, "dags", "backfill", "daily", "--start-date", "2024-01-01",
            "--end-date", "2024-01-03", "--max-active-runs", "2", "--wait", cwd=tmp_path,
        )  # fmt: skip
        assert code == 1, out
        assert "3 run(s) created" in out, out
        runs = sorted(await store.list_runs(dag_id="daily"), key=lambda r: r.logical_date)
        assert [(r.logical_date.day, r.run_type, r.state) for r in runs] == [
            (1, "backfill", "success"), (2, "backfill", "failed"), (3, "backfill", "success"),
        ]  # fmt: skip
        code, out = cli(
            env, "dags", "backfill", "daily", "--start-date", "2024-01-01",
            "--end-date", "2024-01-03", "--wait", cwd=tmp_path,
        )  # fmt: skip
        assert code == 0, out  # nothing reprocessed: nothing failed this time
        code, out = cli(
            env, "dags", "backfill", "daily", "--start-date", "2024-01-05",
            "--end-date", "2024-01-03", cwd=tmp_path,
        )  # fmt: skip
        assert code == 2, out
        assert "after --end-date" in out, out


@pytest.mark.subprocess
async def test_two_scheduler_processes_create_each_interval_once(
    db_url: str, tmp_path: Path, dags_folder: Path, children: Children, store: Store
) -> None:
    children.env = process_env(db_url, tmp_path, dags_folder)
    async with explained(children):
        for n in range(2):
            children.start("scheduler", name=f"scheduler{n}")

        async def caught_up() -> bool:
            runs = await store.list_runs()
            per_dag = {
                d: sum(r.dag_id == d for r in runs) for d in (f"minutely{n}" for n in range(4))
            }
            return min(per_dag.values()) >= 40

        await wait_until(caught_up, timeout_s=60, what="40 runs of each minutely DAG")
    runs = await store.list_runs()
    keys = [(r.dag_id, r.logical_date) for r in runs if r.dag_id.startswith("minutely")]
    assert len(keys) == len(set(keys)), "an interval got two runs"
    for dag_id, group in itertools.groupby(sorted(keys), key=lambda k: k[0]):
        dates = [date for _, date in group]
        gaps = {b - a for a, b in itertools.pairwise(dates)}
        assert gaps == {dt.timedelta(minutes=1)}, (dag_id, dates)


RELOG_DAG = """
import datetime as dt
from pathlib import Path
from engine import DAG
from operators.python import PythonOperator

PASS = Path(__file__).with_name("pass.txt")


def talk(logical_date):
    print(f"pass {PASS.read_text().strip()} of {logical_date.date()}")


with DAG("relog", schedule="@daily", start_date=dt.datetime(2024, 1, 1),
         is_paused_upon_creation=True):
    PythonOperator(task_id="t", python_callable=talk, retries=1)
"""


@pytest.mark.subprocess
async def test_a_reprocessed_run_makes_new_tries_whose_logs_are_their_own(
    db_url: str, tmp_path: Path, children: Children, store: Store
) -> None:
    folder = tmp_path / "relog_dags"
    folder.mkdir()
    (folder / "relog.py").write_text(textwrap.dedent(RELOG_DAG))
    env = process_env(db_url, tmp_path, folder)
    children.env = env
    run_id = "backfill__2024-01-01T00:00:00+00:00"
    backfill = ("dags", "backfill", "relog", "--start-date", "2024-01-01",
                "--end-date", "2024-01-01", "--wait")  # fmt: skip
    async with explained(children):
        children.start("worker", name="worker")
        children.start("scheduler", name="scheduler")
        (folder / "pass.txt").write_text("one")
        code, out = cli(env, *backfill, cwd=tmp_path)
        assert code == 0, out
        (folder / "pass.txt").write_text("two")
        code, out = cli(env, *backfill, "--reprocess-behavior", "completed", cwd=tmp_path)
        assert code == 0, out
        assert "1 run(s) created" in out, out

    def logs(*args: str) -> list[dict[str, str]]:
        code, out = cli(env, "tasks", "logs", "relog", run_id, "t", "--json", *args,
                        cwd=tmp_path)  # fmt: skip
        assert code == 0, out
        return [json.loads(line) for line in out.splitlines()]

    # The run's new try is try 2, numbered on from the old one: its log is its own.
    assert [line["message"] for line in logs()] == ["pass two of 2024-01-01"]
    assert [line["message"] for line in logs("--try", "2")] == ["pass two of 2024-01-01"]
    # The old run's try is still there, as try 1.
    assert [line["message"] for line in logs("--try", "1")] == ["pass one of 2024-01-01"]
    code, out = cli(env, "tasks", "list", "--dag", "relog", "--run", run_id, "--json", cwd=tmp_path)
    assert code == 0, out
    (ti,) = json.loads(out)
    assert (ti["state"], ti["try_number"]) == ("success", 2)
