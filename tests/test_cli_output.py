"""What every command prints around what it lists: nothing on a closed pipe (``deferral ...
| head -1``: exit 141 or 0, no message, whichever command it is), no INFO lines about the
embedded server unless asked (``-v``), and one sentence for an empty listing.

Real commands (``python -m engine``) in child processes, on the test's database or on an
embedded server of their own."""

from __future__ import annotations

import datetime as dt
import functools
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from click.testing import CliRunner

from engine import DAG
from engine.cli import cli
from engine.store import Store
from engine.store.logstore import TriggerLogRow
from operators.python import PythonOperator
from tests.helpers import child_env, never_deferral

pytestmark = pytest.mark.subprocess

#: What a shell reports for a process a closed pipe ended, or a clean exit: both are quiet.
QUIET_EXITS = (0, 141)


def _closed_pipe_run(env: dict[str, str], *args: str, cwd: Path) -> tuple[int, str]:
    """``deferral ARGS`` writing to a pipe whose reader has gone (as ``| head -1`` leaves it
    once it read its line); its exit code and what it wrote on stderr."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "engine", *args],
            env=env,
            cwd=cwd,
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write_end)
    return proc.returncode, proc.stderr.decode(errors="replace")


def _noop() -> None:
    return None


async def _some_of_everything(store: Store) -> int:
    """A DAG, a run, task instances, a waiting trigger with stored log lines; the trigger's
    id."""
    with DAG(dag_id="piped") as dag:
        for i in range(30):
            PythonOperator(task_id=f"t{i:02d}", python_callable=_noop)
    await store.upsert_dag("piped", "piped.py", dag.serialize_tasks(), None)
    await store.create_dag_run("piped", "r1", logical_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    worker = await store.register_worker("pipe-host", 1, 1)
    (claimed,) = (await store.claim_tasks(worker, 1)).claimed
    assert await store.defer_task(claimed.id, worker, never_deferral("piped"))
    (trigger,) = await store.list_triggers(10)
    await store.insert_trigger_logs(
        [
            TriggerLogRow(trigger.id, 1.0e9 + i, "INFO", "user.trigger", f"line {i}")
            for i in range(50)
        ]
    )
    return trigger.id


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_a_closed_pipe_ends_every_command_quietly(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    trigger_id = await _some_of_everything(store)
    env = child_env(DATABASE_URL=db_url, HOME=str(tmp_path / "home"))
    commands = [
        ("triggers", "logs", str(trigger_id)),  # the command that said "BrokenPipeError"
        ("triggers", "logs", str(trigger_id), "--json"),
        ("triggers", "list"),
        ("tasks", "list"),
        ("tasks", "list", "--json"),
        ("tasks", "why", "piped", "r1", "t01"),
        ("runs", "list"),
        ("dags", "list"),
        ("pools", "list"),
        ("status",),
        ("config", "show"),
        ("--help",),
        ("--version",),
        ("tasks", "list", "--help"),
    ]
    for args in commands:
        run = functools.partial(_closed_pipe_run, env, *args, cwd=tmp_path)
        code, err = await anyio.to_thread.run_sync(run)
        assert code in QUIET_EXITS, (args, code, err)
        assert err == "", (args, err)


def test_commands_are_quiet_by_default_and_v_shows_the_embedded_servers_lines(
    tmp_path: Path,
) -> None:
    """On the embedded server (a home of the test's own), a listing prints what it lists and
    nothing on stderr; -v shows the server starting and stopping."""
    env = child_env(HOME=str(tmp_path / "home"))
    quiet = subprocess.run(
        [sys.executable, "-m", "engine", "pools", "list"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert quiet.returncode == 0, quiet.stderr.decode()
    assert b"default_pool" in quiet.stdout
    assert quiet.stderr == b"", quiet.stderr.decode()
    verbose = subprocess.run(
        [sys.executable, "-m", "engine", "-v", "pools", "list"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert verbose.returncode == 0, verbose.stderr.decode()
    err = verbose.stderr.decode()
    assert "INFO" in err
    assert "starting the embedded PostgreSQL" in err
    assert "stopping the embedded PostgreSQL" in err
    # A level set on purpose still holds without -v.
    explicit = subprocess.run(
        [sys.executable, "-m", "engine", "--log-level", "INFO", "pools", "list"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert "starting the embedded PostgreSQL" in explicit.stderr.decode()


# -- empty listings ------------------------------------------------------------------------------


def _invoke(db_url: str, *args: str) -> str:
    result = CliRunner().invoke(cli, list(args), env={"DEFERRAL_DATABASE_URL": db_url})
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize(
    ("args", "sentence"),
    [
        (["triggers", "list"], "no waiting triggers\nno triggerer running\n"),
        (["runs", "list"], "no runs\n"),
        (
            ["runs", "list", "--dag", "d", "--state", "failed"],
            "no runs of DAG 'd' in state failed\n",
        ),
        (["tasks", "list", "--state", "deferred"], "no task instances in state deferred\n"),
        (["status"], "no engine process is running on this database (none registered)\n"),
    ],
)
def test_an_empty_listing_prints_one_sentence(db_url: str, args: list[str], sentence: str) -> None:
    out = _invoke(db_url, *args)
    assert out.startswith(sentence), out
    assert "┏" not in out, out
    assert "dag_id" not in out, out


def test_an_empty_dags_list_says_how_dags_get_recorded(db_url: str) -> None:
    out = _invoke(db_url, "dags", "list")
    assert out.startswith("no DAGs recorded yet"), out
    assert "--dags" in out
    # --json stays data: empty lists.
    assert _invoke(db_url, "dags", "list", "--json").strip() == '{"dags":[],"import_errors":[]}'
    assert _invoke(db_url, "triggers", "list", "--json").strip() == "[]"
