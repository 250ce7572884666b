"""BashSensor on a real engine, in each mode: the command runs until it exits 0 (a counter
file makes it true on its third run, no clock involved), with BashOperator's clean
environment; retry_exit_code, the command timeout and the output limit; BashTrigger alone."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path

import anyio
import asyncpg
import pytest

from engine import DAG
from engine.store import Store
from engine.testing import run_engine, run_trigger
from operators.python import PythonOperator
from operators.sensors import BashSensor
from tests.sensor_helpers import FAST
from tests.triggerer_support import WaitOn
from triggers.base import encode_value
from triggers.bash import BashCommandTimeout, BashTrigger

pytestmark = pytest.mark.anyio


def _third_time(counter: Path, show: Path) -> str:
    """True on its third run; writes what it sees of the environment to ``show``."""
    return (
        f"n=$(cat {counter} 2>/dev/null || echo 0); echo $((n+1)) > {counter}; "
        f'printf "%s|%s|%s\\n" "${{FAKE_SECRET--}}" "${{GIVEN--}}" "$DEFERRAL_TASK_ID" > {show}; '
        'echo "run $n"; [ "$n" -ge 2 ]'
    )


def _noop() -> None:
    return None


@pytest.mark.parametrize("how", ["poke", "reschedule", "deferrable"])
async def test_bash_sensor_waits_for_status_zero_in_each_mode(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setenv("FAKE_SECRET", "hunter2")  # the worker's (and triggerer's) environment
    counter, show = tmp_path / "n", tmp_path / "env"
    mode = "reschedule" if how == "reschedule" else "poke"
    with DAG(dag_id=f"bash_sensor_{how}") as dag:
        BashSensor(
            task_id="wait",
            bash_command=_third_time(counter, show),
            env={"GIVEN": "{{ dag.dag_id }}"},
            mode=mode,
            deferrable=how == "deferrable",
            **FAST,
        ) >> PythonOperator(task_id="after", python_callable=_noop)
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        tis = await engine.finish(dag.dag_id)
        fired = engine.triggerer.fired
    assert tis["wait"]["state"] == "success", tis["wait"]["error"]
    assert tis["after"]["state"] == "success"
    assert counter.read_text().strip() == "3"
    # The secret of the process that ran it stays out; env (templated) and the ids are in.
    assert show.read_text().strip() == f"-|bash_sensor_{how}|wait"
    assert fired == (1 if how == "deferrable" else 0)


@pytest.mark.parametrize("deferrable", [False, True])
async def test_another_status_than_retry_exit_code_fails_without_retries(
    store: Store, tmp_path: Path, deferrable: bool
) -> None:
    counter = tmp_path / "n"
    # 1 (retry_exit_code) on the first run, then 3: a failure, not a "not yet".
    command = (
        f"n=$(cat {counter} 2>/dev/null || echo 0); echo $((n+1)) > {counter}; "
        '[ "$n" -ge 1 ] && exit 3; exit 1'
    )
    with DAG(dag_id=f"bash_sensor_fail_{deferrable}") as dag:
        BashSensor(
            task_id="wait",
            bash_command=command,
            retry_exit_code=1,
            retries=2,
            deferrable=deferrable,
            **FAST,
        )
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        tis = await engine.finish(dag.dag_id)
    assert tis["wait"]["state"] == "failed"
    assert tis["wait"]["try_number"] == 1  # no retry: the command said it never will be
    assert (
        "command exited with status 3 (not 0, and not retry_exit_code 1)" in (tis["wait"]["error"])
    )
    assert counter.read_text().strip() == "2"


async def test_any_non_zero_status_is_not_yet_without_retry_exit_code(tmp_path: Path) -> None:
    counter = tmp_path / "n"
    trigger = BashTrigger(
        f"n=$(cat {counter} 2>/dev/null || echo 0); echo $((n+1)) > {counter}; "
        '[ "$n" -ge 2 ] || exit 7',
        poll_interval=0,
    )
    event = await run_trigger(trigger)
    assert event is not None
    assert event.payload is None
    assert counter.read_text().strip() == "3"


async def test_a_run_past_command_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    started = tmp_path / "started"
    # The child (a background sleep) would outlive a kill of bash alone.
    trigger = BashTrigger(
        f"touch {started}; sleep 300 & wait", command_timeout=0.5, poll_interval=0
    )
    with pytest.raises(BashCommandTimeout, match=r"longer than command_timeout \(0.5s\)"):
        await trigger.check()
    assert started.exists()


def _open_files(pid: int | str) -> set[str]:
    """What the descriptors of a process point to ("pipe:[inode]", "socket:[inode]", ...)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed since the listing
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return found


async def test_a_killed_run_lets_go_of_its_output_pipe(tmp_path: Path) -> None:
    """A run killed past command_timeout closes this side of its output pipe before the
    check ends, even while a process it started holds the other end (here one that left
    its process group, which the kill misses): otherwise the event loop keeps watching the
    pipe (uvloop then fails to close: "Device or resource busy"; Python 3.11's wait()
    waits for the pipe too, so the check would not end before that process does)."""
    pid_file = tmp_path / "pid"
    trigger = BashTrigger(
        f"setsid sleep 300 & echo $! > {pid_file}; wait", command_timeout=0.5, poll_interval=0
    )
    before = _open_files("self")
    try:
        with anyio.fail_after(60), pytest.raises(BashCommandTimeout):
            await trigger.check()
        escaped = pid_file.read_text().strip()
        assert os.readlink(f"/proc/{escaped}/fd/1").startswith(("pipe:", "socket:"))
        # (a pipe of uvloop's is a socket pair: its two ends have inodes of their own)
        left = {f for f in _open_files("self") - before if f.startswith(("pipe:", "socket:"))}
        assert not left, "the check ended with its output pipe open"
    finally:
        if pid_file.exists():
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


async def test_output_is_kept_up_to_max_output_bytes(caplog: pytest.LogCaptureFixture) -> None:
    trigger = BashTrigger(
        "printf 'short\\n'; head -c 100000 /dev/zero | tr '\\0' x; echo; echo tail",
        max_output_bytes=1000,
    )
    with caplog.at_level(logging.INFO):
        assert await trigger.check() is True
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("triggers")]
    assert lines[0] == "short"
    kept = sum(len(line) for line in lines if set(line) == {"x"})
    assert 0 < kept <= 1000
    assert "tail" not in lines
    assert any("more bytes of output not kept (max_output_bytes=1000)" in m for m in lines)


def test_bad_arguments_are_a_dag_files_error() -> None:
    with pytest.raises(ValueError, match="task w: command_timeout must be a positive number"):
        BashSensor(task_id="w", bash_command="true", command_timeout=0)
    with pytest.raises(TypeError, match="task w: retry_exit_code must be an int"):
        BashSensor(task_id="w", bash_command="true", retry_exit_code="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bash_command must be a non-empty string"):
        BashSensor(task_id="w", bash_command=" ")


async def test_a_plaintext_row_naming_bash_trigger_never_runs_its_command(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    """Whoever can write to the database but has no key cannot make a triggerer run a
    command: a trigger row rewritten with SQL to a BashTrigger (its kwargs in plaintext, as no
    engine process writes them when it has a key) fails its task and runs nothing."""
    marker = tmp_path / "pwned"
    with DAG(dag_id="bash_forged") as dag:
        WaitOn(
            task_id="wait",
            trigger="FlagTrigger",
            trigger_kwargs={"flag": str(tmp_path / "never"), "key": "k"},
        )
    async with run_engine(store, triggerer=False) as engine:
        await engine.start_run(dag)
        await engine.wait_for_state(dag.dag_id, "wait", "deferred")
        forged = BashTrigger(f"touch {marker}", poll_interval=0).serialize()
        conn = await asyncpg.connect(db_url)
        try:
            status = await conn.execute(
                "UPDATE deferral_triggers SET classpath = $1, kwargs = $2",
                forged[0],
                encode_value(forged[1]),
            )
        finally:
            await conn.close()
        assert status == "UPDATE 1"
    async with run_engine(store, worker=False) as engine:
        tis = await engine.finish(dag.dag_id)
    assert not marker.exists(), "the command ran"
    assert tis["wait"]["state"] == "failed"
    assert "stored in plaintext while the engine has an encryption key" in tis["wait"]["error"]
