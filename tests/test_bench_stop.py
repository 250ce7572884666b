"""A benchmark stopped halfway (SIGTERM, Ctrl-C) or killed leaves none of the engine processes
it started running (benchmarks/processes.py). A real ``deferral bench schedule`` (a scheduler
and a worker) on the test server; the test watches the process tree."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import asyncpg
import psutil
import pytest

from engine.store.databases import drop_database
from tests.helpers import WAIT_S, child_env

pytestmark = pytest.mark.subprocess

#: How long the benchmark's engine processes get to end once it is stopped (its grace period
#: is 20 s; they stop in well under a second).
GONE_S = 25.0
#: The smallest benchmark that starts engine processes, for longer than a test lasts.
BENCH = ("bench", "schedule", "--dags", "1", "--duration", "600")


def _engine_children(bench: subprocess.Popen[bytes]) -> list[psutil.Process]:
    kids = []
    for proc in psutil.Process(bench.pid).children(recursive=True):
        try:
            if "engine" in proc.cmdline()[1:3]:
                kids.append(proc)
        except psutil.Error:
            continue
    return kids


def _start(admin_url: str, tmp_path: Path) -> tuple[subprocess.Popen[bytes], list[psutil.Process]]:
    """``deferral bench schedule`` for longer than the test lasts, once its scheduler and
    worker run."""
    env = child_env(DATABASE_URL=admin_url, HOME=str(tmp_path / "home"))
    with (tmp_path / "bench.err").open("wb") as err:
        bench = subprocess.Popen(
            [sys.executable, "-m", "engine", *BENCH],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    deadline = time.monotonic() + WAIT_S
    kids = _engine_children(bench)
    while len(kids) < 2:
        if bench.poll() is not None or time.monotonic() > deadline:
            bench.kill()
            raise AssertionError(f"the bench did not start its engine processes:\n{_err(tmp_path)}")
        time.sleep(0.05)  # (polling the process tree)
        kids = _engine_children(bench)
    return bench, kids


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _left_after(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes still running (not ended, not a zombie) once all ended or after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)  # (polling the process tree)
        alive = [p for p in alive if _running(p)]
    return alive


def _cmdlines(procs: list[psutil.Process]) -> list[str]:
    out = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            out.append(" ".join(proc.cmdline()))
    return out


def _err(tmp_path: Path) -> str:
    return (tmp_path / "bench.err").read_text(errors="replace")[-3000:]


def _bench_databases(admin_url: str) -> set[str]:
    async def names() -> set[str]:
        conn = await asyncpg.connect(admin_url)
        try:
            rows = await conn.fetch(
                "SELECT datname FROM pg_database WHERE datname LIKE 'bench_schedule_%'"
            )
        finally:
            await conn.close()
        return {r["datname"] for r in rows}

    return asyncio.run(names())


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_bench_ends_its_engine_processes(
    admin_url: str, tmp_path: Path, signum: signal.Signals
) -> None:
    before = _bench_databases(admin_url)
    bench, kids = _start(admin_url, tmp_path)
    try:
        bench.send_signal(signum)
        code = bench.wait(WAIT_S)
        alive = _left_after(kids, GONE_S)
        assert not alive, f"still running: {_cmdlines(alive)}\n{_err(tmp_path)}"
        assert code == 128 + signum, _err(tmp_path)
        assert f"stopped by {signum.name}" in _err(tmp_path)
        # Its own clean-up ran too: the benchmark's database is gone.
        assert _bench_databases(admin_url) == before
    finally:
        _kill(bench, kids)


def test_a_killed_bench_leaves_no_engine_process(admin_url: str, tmp_path: Path) -> None:
    """SIGKILL runs no clean-up: each child sees its supervisor's pipe close and stops. What
    the bench's clean-up would have removed, its database and its work folder, the test
    removes (the database was left on the test server)."""
    bench, kids = _start(admin_url, tmp_path)
    left: tuple[str, Path] | None = None
    try:
        left = _bench_leftovers(kids)
        bench.kill()
        bench.wait(WAIT_S)
        alive = _left_after(kids, GONE_S)
        assert not alive, f"still running: {_cmdlines(alive)}"
        assert left[0] in _bench_databases(admin_url)  # (no clean-up ran)
    finally:
        _kill(bench, kids)
        if left is not None:
            db_name, work = left
            asyncio.run(drop_database(admin_url, db_name))
            shutil.rmtree(work, ignore_errors=True)


def _bench_leftovers(kids: list[psutil.Process]) -> tuple[str, Path]:
    """The database and the work folder of the bench whose engine processes are ``kids``,
    read from the environment it gave them."""
    env = kids[0].environ()
    db_name = urllib.parse.urlsplit(env["DEFERRAL_DATABASE_URL"]).path.lstrip("/")
    work = Path(env["DEFERRAL_DAGS_FOLDER"]).parent
    assert db_name.startswith("bench_schedule_"), db_name
    assert work.name.startswith("deferral-bench-schedule-"), work
    return db_name, work


def _kill(bench: subprocess.Popen[bytes], kids: list[psutil.Process]) -> None:
    if bench.poll() is None:
        bench.kill()
        bench.wait()
    for kid in kids:
        with contextlib.suppress(psutil.Error):
            kid.kill()
