"""Engine processes in tests: ``python -m engine <kind>`` children of one test, each logging
to its own file, stopped at the end; the ``children`` fixture (tests/conftest.py) gives one
set per test, on the test's database."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from tests.helpers import child_env, free_port

__all__ = ["STOP_GRACE_S", "Children", "explained", "process_env"]

#: How long a child gets to stop after SIGTERM before it is killed.
STOP_GRACE_S = 20.0


class Children:
    """Child processes of one test, each logging to its own file; all stopped at the end."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str, name: str) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("wb")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine", *args],
                env=self.env,
                cwd=self.logs,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        self.procs.append(proc)
        return proc

    def output(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
            for path in sorted(self.logs.glob("*.log"))
        )

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def process_env(db_url: str, tmp_path: Path, dags: Path | None = None) -> dict[str, str]:
    # (The default allow-list: tests that run triggers from tests/ add TEST_TRIGGER_ALLOW.)
    env = child_env(
        test_triggers=False,
        DATABASE_URL=db_url,
        HOME=str(tmp_path / "home"),
        LOG_LEVEL="INFO",
        # (standalone's status page: a port of its own, tests run side by side)
        WEBSERVER_PORT=str(free_port()),
    )
    if dags is not None:
        env["DEFERRAL_DAGS_FOLDER"] = str(dags)
    return env


@contextlib.asynccontextmanager
async def explained(children: Children) -> AsyncIterator[None]:
    """On failure, show what the children logged."""
    try:
        yield
    except BaseException:
        print(children.output())
        raise
