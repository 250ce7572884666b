"""``deferral tasks test DAG TASK``: one task run in-process on a scratch database, its trigger
included, with its log, deferrals, resumes and outcome printed; the database dropped after."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import msgspec
import pytest

from engine.testing.tasktest import SCRATCH_PREFIX, mask_secrets
from tests.helpers import REPO_ROOT, child_env

DAG_FILE = """
import asyncio
import logging

from engine import DAG
from operators.base import BaseOperator
from operators.python import PythonOperator
from operators.sensors import TimeDeltaSensor
from triggers.base import BaseTrigger, TriggerEvent

log = logging.getLogger(__name__)


class ReadyTrigger(BaseTrigger):
    def __init__(self, job: str, token: str, poll_interval: float = 0.01):
        self.job, self.token, self.poll_interval = job, token, poll_interval

    def serialize(self):
        return (
            "pipeline.ReadyTrigger",
            {"job": self.job, "token": self.token, "poll_interval": self.poll_interval},
        )

    async def run(self):
        self.log.info("trigger polls job %s", self.job)
        await asyncio.sleep(self.poll_interval)
        yield TriggerEvent({"job": self.job, "rows": 42})


class SubmitAndWait(BaseOperator):
    def execute(self, context):
        self.log.info("submitted job j-7")
        self.defer(
            trigger=ReadyTrigger("j-7", token="hunter2"), method_name="landed", timeout=60
        )

    def landed(self, context, event):
        self.log.info("job %s has %s rows", event["job"], event["rows"])
        return {"loaded": event["rows"]}


class Forever(BaseTrigger):
    def serialize(self):
        return ("pipeline.Forever", {})

    async def run(self):
        await asyncio.Event().wait()
        yield TriggerEvent(None)


class WaitsForever(BaseOperator):
    def execute(self, context):
        self.defer(trigger=Forever(), method_name="execute")


def extract(conf, logical_date):
    log.info("extracting for %s", conf["region"])
    print("a line printed by the task")
    return {"region": conf["region"], "date": logical_date.isoformat()}


def explode():
    raise RuntimeError("the warehouse is on fire")


with DAG(dag_id="pipeline"):
    first = PythonOperator(task_id="never_runs", python_callable=explode)
    first >> PythonOperator(task_id="extract", python_callable=extract)
    first >> SubmitAndWait(task_id="wait_for_job")
    first >> PythonOperator(task_id="explode", python_callable=explode, retries=3)
    first >> WaitsForever(task_id="forever")
    first >> TimeDeltaSensor(task_id="short_sensor", delta=0.3, timeout=60, deferrable=True)
"""


@dataclass
class Done:
    code: int
    stdout: str
    stderr: str


@pytest.fixture
def dags(tmp_path: Path) -> Path:
    folder = tmp_path / "dags"
    folder.mkdir()
    (folder / "pipeline.py").write_text(textwrap.dedent(DAG_FILE))
    return folder


def scratch_databases(admin_url: str, pid: int) -> list[str]:
    async def names() -> list[str]:
        conn = await asyncpg.connect(admin_url)
        try:
            rows = await conn.fetch(
                "SELECT datname FROM pg_database WHERE datname LIKE $1",
                f"{SCRATCH_PREFIX}{pid}\\_%",
            )
        finally:
            await conn.close()
        return [r["datname"] for r in rows]

    return asyncio.run(names())


def start(admin_url: str, dags: Path, *args: str) -> subprocess.Popen[bytes]:
    """``deferral tasks test ARGS --dags DAGS`` next to the test server."""
    # The default allow-list: built-in triggers and the modules of the DAGs folder.
    env = child_env(test_triggers=False, DATABASE_URL=admin_url)
    return subprocess.Popen(
        [sys.executable, "-m", "engine", "tasks", "test", *args, "--dags", str(dags)],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def finish(admin_url: str, proc: subprocess.Popen[bytes], *args: str) -> Done:
    """Wait for the command to end; its scratch database checked to be gone afterwards."""
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"tasks test {args} kept running:\n{out.decode()}\n{err.decode()}")
    assert scratch_databases(admin_url, proc.pid) == [], "the scratch database was left"
    return Done(proc.returncode, out.decode(), err.decode())


def tasks_test(admin_url: str, dags: Path, *args: str) -> Done:
    return finish(admin_url, start(admin_url, dags, *args), *args)


pytestmark = pytest.mark.subprocess


def test_a_python_task_runs_alone_with_its_conf_and_logical_date(
    admin_url: str, dags: Path
) -> None:
    done = tasks_test(
        admin_url,
        dags,
        "pipeline",
        "extract",
        "--conf",
        '{"region": "emea"}',
        "--logical-date",
        "2026-01-31T06:00:00+00:00",
        "--json",
    )
    assert done.code == 0, done
    report = msgspec.json.decode(done.stdout)  # stdout is the report alone
    assert report["state"] == "success"
    assert report["try_number"] == 1
    # Its upstream task (which would fail) was not run: the task ran on its own.
    assert report["result"] == {"region": "emea", "date": "2026-01-31T06:00:00+00:00"}
    assert report["error"] is None
    messages = [(line["logger"], line["message"], line["source"]) for line in report["log"]]
    assert ("pipeline", "extracting for emea", "task") in messages
    assert report["deferrals"] == []
    assert report["resumes"] == []
    assert report["database"].startswith(SCRATCH_PREFIX)
    # With --json, what the task prints goes to stderr.
    assert "a line printed by the task" in done.stderr


def test_a_deferral_runs_its_trigger_in_process_and_prints_the_resume(
    admin_url: str, dags: Path
) -> None:
    done = tasks_test(admin_url, dags, "pipeline", "wait_for_job")
    assert done.code == 0, done
    out = done.stdout
    lines = out.splitlines()
    assert 'deferred on pipeline.ReadyTrigger {"job":"j-7","poll_interval":0.01,' in out
    assert '"token":"***"' in out
    assert "hunter2" not in out + done.stderr
    assert 'resumed at landed with {"job":"j-7","rows":42}' in lines
    assert any(line.endswith("pipeline.ReadyTrigger: trigger polls job j-7") for line in lines)
    assert any(line.endswith("pipeline.SubmitAndWait: job j-7 has 42 rows") for line in lines)
    # In the order they happened, then the outcome.
    order = [
        next(i for i, line in enumerate(lines) if needle in line)
        for needle in ("submitted job", "deferred on", "trigger polls", "resumed at", "42 rows")
    ]
    assert order == sorted(order), out
    assert lines[-3:] == ["state: success", "try: 1", 'result: {"loaded":42}']


def test_a_sensors_deferral_shows_its_timeout_rounded(admin_url: str, dags: Path) -> None:
    """A sensor defers with what is left of its timeout, a hair under it: the line said
    "(timeout 59.9997s)"; it says "(timeout 60s)" (the JSON report keeps the exact value)."""
    done = tasks_test(admin_url, dags, "pipeline", "short_sensor")
    assert done.code == 0, done
    line = next(line for line in done.stdout.splitlines() if line.startswith("deferred on"))
    assert line.endswith("(timeout 60s)"), done.stdout


def test_the_deferral_and_resume_are_in_the_json_report(admin_url: str, dags: Path) -> None:
    done = tasks_test(admin_url, dags, "pipeline", "wait_for_job", "--json")
    assert done.code == 0, done
    report = msgspec.json.decode(done.stdout)
    assert report["deferrals"] == [
        {
            "classpath": "pipeline.ReadyTrigger",
            "kwargs": {"job": "j-7", "poll_interval": 0.01, "token": "***"},
            "method_name": "landed",
            "timeout_s": 60.0,
        }
    ]
    assert report["resumes"] == [{"method_name": "landed", "event": {"job": "j-7", "rows": 42}}]
    assert {line["source"] for line in report["log"]} == {"task", "trigger"}
    assert report["result"] == {"loaded": 42}


def test_a_failing_task_exits_1_with_its_traceback_after_one_try(
    admin_url: str, dags: Path
) -> None:
    done = tasks_test(admin_url, dags, "pipeline", "explode")
    assert done.code == 1, done
    assert "state: failed" in done.stdout
    assert "try: 1" in done.stdout  # retries=3 is not used: one try
    assert "Traceback (most recent call last)" in done.stdout
    assert "RuntimeError: the warehouse is on fire" in done.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("pipeline", "extrcat"), "DAG 'pipeline' has no task 'extrcat'; did you mean extract?"),
        (("pipelin", "extract"), "no DAG 'pipelin' in"),
        (("pipelin", "extract"), "did you mean pipeline?"),
        (("pipeline", "extract", "--conf", "[1]"), "--conf"),
        (("pipeline", "extract", "--logical-date", "yesterday"), "--logical-date"),
    ],
)
def test_usage_errors_exit_2_naming_close_names(
    admin_url: str, dags: Path, args: tuple[str, ...], expected: str
) -> None:
    done = tasks_test(admin_url, dags, *args)
    assert done.code == 2, done
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_test_drops_its_scratch_database(
    admin_url: str, dags: Path, signum: signal.Signals
) -> None:
    proc = start(admin_url, dags, "pipeline", "forever")
    assert proc.stdout is not None
    seen = []
    # Read until the task is deferred (pytest-timeout bounds a command that never gets there).
    for raw in proc.stdout:
        seen.append(raw.decode())
        if raw.startswith(b"deferred on pipeline.Forever"):
            break
    else:
        pytest.fail(f"the task never deferred: {seen}")
    proc.send_signal(signum)
    done = finish(admin_url, proc)  # checks that the scratch database is gone
    assert done.code == 130, done
    assert f"interrupted ({signum.name}) before the task ended" in done.stderr


def test_the_readme_example_task_runs_with_tasks_test(admin_url: str, tmp_path: Path) -> None:
    from tests.test_readme import readme_dag

    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "orders.py").write_text(readme_dag())
    landed = tmp_path / "orders-test.csv"
    landed.touch()
    conf = msgspec.json.encode({"path": str(landed)}).decode()
    done = tasks_test(admin_url, dags, "orders", "wait", "--conf", conf)
    assert done.code == 0, done
    assert "deferred on orders.FileLandedTrigger" in done.stdout
    assert done.stdout.splitlines()[-1] == f"result: {msgspec.json.encode(str(landed)).decode()}"


def test_a_user_that_may_not_create_databases_gets_a_usage_error(
    admin_url: str, dags: Path
) -> None:
    role = f"tasktest_nocreate_{os.getpid()}"
    password = "not-a-secret"

    async def sql(statement: str) -> None:
        conn = await asyncpg.connect(admin_url)
        try:
            await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(sql(f"CREATE ROLE {role} LOGIN NOCREATEDB PASSWORD '{password}'"))
    try:
        parts = urlsplit(admin_url)
        host = parts.netloc.rpartition("@")[2]
        url = urlunsplit(parts._replace(netloc=f"{role}:{password}@{host}"))
        done = tasks_test(url, dags, "pipeline", "extract")
    finally:
        asyncio.run(sql(f"DROP ROLE {role}"))
    assert done.code == 2, done
    assert "cannot create a scratch database on DEFERRAL_DATABASE_URL" in done.stderr
    assert "CREATEDB" in done.stderr
    assert "Traceback" not in done.stderr


def test_secret_looking_values_are_masked() -> None:
    kwargs = {
        "url": "postgresql://me:pw@db/x",
        "headers": {"Authorization": "Bearer abc", "Accept": "json"},
        "api_key": "k",
        "items": [{"password": "p", "n": 1}],
        "poll_interval": 5,
    }
    assert mask_secrets(kwargs) == {
        "url": "postgresql://me:***@db/x",
        "headers": {"Authorization": "***", "Accept": "json"},
        "api_key": "***",
        "items": [{"password": "***", "n": 1}],
        "poll_interval": 5,
    }


DAILY_FILE = """
import datetime as dt

from engine import DAG
from operators.python import PythonOperator


def interval(data_interval_start, data_interval_end):
    return [data_interval_start.isoformat(), data_interval_end.isoformat()]


with DAG(dag_id="daily", schedule="@daily", start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC)):
    PythonOperator(task_id="interval", python_callable=interval)
"""


def test_a_tested_task_has_the_data_interval_dags_trigger_infers(
    admin_url: str, dags: Path
) -> None:
    """A manual run of a daily DAG covers the last whole day before its logical date, in
    `tasks test` as in `dags trigger` (it had a zero-length interval)."""
    (dags / "daily.py").write_text(textwrap.dedent(DAILY_FILE))
    done = tasks_test(
        admin_url, dags, "daily", "interval", "--logical-date", "2026-11-20T06:00:00", "--json"
    )
    assert done.code == 0, done
    report = msgspec.json.decode(done.stdout)
    assert report["result"] == ["2026-11-19T00:00:00+00:00", "2026-11-20T00:00:00+00:00"]


def test_a_mapped_task_is_refused_clearly(admin_url: str, tmp_path: Path) -> None:
    folder = tmp_path / "mapped_dags"
    folder.mkdir()
    (folder / "mapped.py").write_text(
        textwrap.dedent(
            """
            from engine import DAG
            from operators.bash import BashOperator

            with DAG(dag_id="mapped"):
                BashOperator.partial(task_id="echo").expand(bash_command=["echo 1", "echo 2"])
            """
        )
    )
    done = tasks_test(admin_url, folder, "mapped", "echo")
    assert done.code == 2, done
    assert "task 'echo' is mapped" in done.stderr
    assert "Traceback" not in done.stderr
