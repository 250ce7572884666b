"""The embedded PostgreSQL: private to its owner, password-protected, restarted when killed.

Each test starts a server of its own in a folder of its own (the session's server is left
alone). Run as root (as CI does), the server runs as the OS user ``deferral-pg`` and the
"another local user" is ``nobody``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

import anyio
import asyncpg
import psutil
import pytest

from engine.store import Store, pgcluster
from engine.store.databases import create_database
from engine.store.embedded import (
    PASSWORD_FILE,
    ROOT_DATA_BASE,
    EmbeddedServerError,
    embedded_database_url,
    stop_embedded_server,
)
from engine.store.pgcluster import SERVER_OS_USER, ensure_initialized, server_account
from tests.conftest import REPO
from tests.helpers import child_env, wait_until
from tests.triggers_for_tests import release_file

IS_ROOT = os.geteuid() == 0
as_root = pytest.mark.skipif(not IS_ROOT, reason="needs root to act as another local user")


def _socket_dir(url: str) -> Path:
    return Path(unquote(parse_qs(urlsplit(url).query)["host"][0]))


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{parts.username}@"))


def _server_uid() -> int:
    return pwd.getpwnam(SERVER_OS_USER).pw_uid if IS_ROOT else os.geteuid()


def _postmaster_pid(url: str) -> int:
    """The pid of the postmaster of ``url`` (which is not printed: it has the password)."""
    data = _socket_dir(url)
    pid_file = data / "postmaster.pid"
    if not pid_file.exists():  # the socket is in a private folder: find the data by its socket
        for proc in psutil.process_iter(["name", "cmdline"]):
            cmdline = proc.info["cmdline"] or []
            if proc.info["name"] == "postgres" and str(data) in " ".join(cmdline):
                return int(proc.pid)
        raise AssertionError(f"no postmaster with its socket in {data}")
    return int(pid_file.read_text().split()[0])


async def _select_1(url: str) -> bool:
    try:
        conn = await asyncpg.connect(url, timeout=5)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return False
    try:
        return bool(await conn.fetchval("SELECT 1") == 1)
    finally:
        await conn.close()


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder for one test's homes; as root the server's OS user may enter it (0711)."""
    folder = Path(tempfile.mkdtemp(prefix="deferral-emb-"))
    folder.chmod(0o711)
    try:
        yield folder
    finally:
        for home in [folder / "home", *folder.glob("*/home")]:
            stop_embedded_server(home)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_connection_needs_the_password_and_the_socket_folder_is_private(base: Path) -> None:
    url = embedded_database_url(base / "home")
    socket_dir = _socket_dir(url)
    st = socket_dir.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == _server_uid()
    assert stat.S_IMODE((base / "home" / PASSWORD_FILE).stat().st_mode) == 0o600

    async def check() -> None:
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(_without_password(url))
        conn = await asyncpg.connect(url)
        try:
            assert await conn.fetchval("SHOW listen_addresses") == ""
            assert await conn.fetchval("SHOW password_encryption") == "scram-sha-256"
            hba = await conn.fetch("SELECT type, auth_method FROM pg_hba_file_rules")
            assert {r["auth_method"] for r in hba} == {"scram-sha-256"}
        finally:
            await conn.close()

    anyio.run(check)


# Standard library only: run by the system's Python as another user, who may not be able to
# read the virtual environment (or the interpreter it links to, under /root).
_OTHER_USER = """
import socket, struct, sys

def attempt(family, address):
    sock = socket.socket(family)
    sock.settimeout(10)
    try:
        sock.connect(address)
        body = struct.pack("!i", 196608) + b"user\\0postgres\\0database\\0postgres\\0\\0"
        sock.sendall(struct.pack("!i", len(body) + 4) + body)
        reply = sock.recv(9)
    except OSError as exc:
        return f"refused ({type(exc).__name__})"
    finally:
        sock.close()
    # AuthenticationOk (R, code 0) without a password: the server let this user in.
    if reply[:1] == b"R" and len(reply) == 9 and struct.unpack("!i", reply[5:])[0] == 0:
        return "CONNECTED"
    return f"refused (the server answered {reply[:1]!r})"

print("socket:", attempt(socket.AF_UNIX, sys.argv[1] + "/.s.PGSQL.5432"))
print("tcp:", attempt(socket.AF_INET, ("127.0.0.1", 5432)))
"""
#: A Python the other user can run (the system's, when there is one).
_OTHER_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


@as_root
def test_another_local_user_cannot_connect_even_with_a_long_data_path(base: Path) -> None:
    # ~100 characters: too long for a socket in the data folder, so it moves to the temp folder.
    home = base / ("d" * 80) / "home"
    home.parent.mkdir()
    url = embedded_database_url(home)
    socket_dir = _socket_dir(url)
    try:
        assert not socket_dir.is_relative_to(home)
        st = socket_dir.lstat()
        assert stat.S_ISDIR(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == _server_uid()
        assert anyio.run(_select_1, url)

        nobody = pwd.getpwnam("nobody")
        env = {"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent"}
        done = subprocess.run(
            [_OTHER_PYTHON, "-c", _OTHER_USER, str(socket_dir)],
            user=nobody.pw_uid,
            group=nobody.pw_gid,
            extra_groups=[],
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert len(lines) == 2, done.stdout
        assert all("refused" in line for line in lines), done.stdout
    finally:
        stop_embedded_server(home)
        shutil.rmtree(socket_dir, ignore_errors=True)


_USER_OF_THE_SERVER = """
import asyncio, sys
from pathlib import Path
import asyncpg
from engine.store.embedded import embedded_database_url

async def main():
    conn = await asyncpg.connect(embedded_database_url(Path(sys.argv[1])))
    print("started", await conn.fetchval("SELECT pg_postmaster_start_time()"), flush=True)
    await conn.close()

asyncio.run(main())
sys.stdin.read()  # keep using the server until the test lets go
"""


def test_processes_starting_at_once_share_one_server_stopped_by_the_last(base: Path) -> None:
    home = base / "home"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    users = [
        subprocess.Popen(
            [sys.executable, "-c", _USER_OF_THE_SERVER, str(home)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        lines = [user.stdout.readline() for user in users if user.stdout is not None]
        assert all(line.startswith("started ") for line in lines), lines
        assert len(set(lines)) == 1, lines
    finally:
        for user in users:
            if user.stdin is not None:
                user.stdin.close()
        codes = [user.wait(60) for user in users]
        for user in users:
            if user.stdout is not None:
                user.stdout.close()
    assert codes == [0, 0, 0]
    assert not (home / "pgdata" / "postmaster.pid").exists()


def _modes(path: Path) -> dict[Path, int]:
    return {p: stat.S_IMODE(p.stat().st_mode) for p in [*path.parents, path]}


def test_folders_above_the_home_and_the_binaries_keep_their_modes(tmp_path: Path) -> None:
    parent = tmp_path / "private"
    parent.mkdir(mode=0o700)
    home = parent / "home"
    binaries = pgcluster.binaries(home / "pgdata")
    before = _modes(parent) | _modes(binaries)
    try:
        url = embedded_database_url(home)
        assert anyio.run(_select_1, url)
        assert _modes(parent) | _modes(binaries) == before
        assert stat.S_IMODE(parent.stat().st_mode) == 0o700
        if IS_ROOT:
            # The server's OS user cannot enter ``parent``: the data went where it can.
            target = (home / "pgdata").resolve()
            assert target.is_relative_to(ROOT_DATA_BASE)
            # Root's, passable but not writable by the server's account.
            assert stat.S_IMODE(ROOT_DATA_BASE.stat().st_mode) == 0o711
            assert ROOT_DATA_BASE.stat().st_uid == 0
    finally:
        stop_embedded_server(home)
        if IS_ROOT and (home / "pgdata").is_symlink():
            shutil.rmtree((home / "pgdata").resolve(), ignore_errors=True)


@as_root
def test_old_data_the_server_user_cannot_reach_is_a_clear_error(tmp_path: Path) -> None:
    parent = tmp_path / "private"
    parent.mkdir(mode=0o700)
    (parent / "home" / "pgdata").mkdir(parents=True)
    with pytest.raises(EmbeddedServerError) as err:
        embedded_database_url(parent / "home")
    assert str(parent) in str(err.value)
    assert SERVER_OS_USER in str(err.value)
    assert stat.S_IMODE(parent.stat().st_mode) == 0o700


def test_a_data_folder_of_the_old_layout_gets_a_password(base: Path) -> None:
    home = base / "home"
    home.mkdir()
    # What the old code left: a cluster made by initdb --auth=trust, no password.
    ensure_initialized(home / "pgdata", server_account())
    (home / "pgdata" / ".handle_pids.json").write_text("[]")
    url = embedded_database_url(home)

    async def check() -> None:
        assert await _select_1(url)
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(_without_password(url))

    anyio.run(check)


def test_a_server_the_old_code_left_running_is_restarted_with_a_password(base: Path) -> None:
    home = base / "home"
    home.mkdir()
    account = server_account()
    ensure_initialized(home / "pgdata", account)
    pgcluster.start(home / "pgdata", account, home / "pgdata")  # trust, as the old code
    old_pid = _postmaster_pid(f"postgresql://x@/y?host={home / 'pgdata'}")
    url = embedded_database_url(home)
    new_pid = _postmaster_pid(url)
    assert new_pid != old_pid

    async def check() -> None:
        assert await _select_1(url)
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(_without_password(url))

    anyio.run(check)


def test_a_killed_postmaster_is_started_again_without_any_cli_call(base: Path) -> None:
    url = embedded_database_url(base / "home")
    first = _postmaster_pid(url)
    os.kill(first, signal.SIGKILL)

    async def back() -> bool:
        return await _select_1(url)

    anyio.run(wait_until, back)
    again = _postmaster_pid(url)
    assert again != first


_DAG = """
    from typing import Any
    from engine import DAG
    from operators.base import BaseOperator
    from tests.triggers_for_tests import FileTrigger

    class WaitForFile(BaseOperator):
        def __init__(self, *, path: str, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.path = path

        def execute(self, context: Any) -> None:
            self.defer(trigger=FileTrigger(self.path), method_name="resume")

        def resume(self, context: Any, event: Any = None) -> Any:
            return event["text"]

    with DAG(dag_id="outage"):
        for i in range(3):
            WaitForFile(task_id=f"w{{i}}", path=f"{folder}/release-{{i}}")
"""


@pytest.mark.subprocess
def test_engine_processes_finish_their_tasks_after_the_postmaster_is_killed(base: Path) -> None:
    home = base / "home"
    admin = embedded_database_url(home)
    dags = base / "dags"
    dags.mkdir()
    (dags / "outage_dag.py").write_text(textwrap.dedent(_DAG.format(folder=base)))
    env = child_env(HOME=str(base / "child-home"), DAGS_FOLDER=str(dags), LOG_LEVEL="INFO")
    procs: list[subprocess.Popen[bytes]] = []

    async def migrated_database() -> str:
        url = await create_database(admin, f"outage_{uuid.uuid4().hex[:12]}")
        store = await Store.connect(url, pool_size=1)
        await store.close()
        return url

    url = anyio.run(migrated_database)
    env["DEFERRAL_DATABASE_URL"] = url

    async def scenario() -> None:
        store = await Store.connect(url, pool_size=1, migrate=False)
        try:

            async def dag_synced() -> bool:
                return "outage" in {d.dag_id for d in await store.list_dags()}

            await wait_until(dag_synced, what="the scheduler's DAG sync")
            now = await store.now()
            await store.create_dag_run("outage", "run1", logical_date=now, conf=None)

            async def all_deferred() -> bool:
                # Every process is past its start-up: the kill hits a running engine.
                tis = await store.list_task_instances(dag_id="outage", state="deferred")
                owners = [t.triggerer_id for t in await store.list_triggers()]
                return len(tis) == 3 and len(owners) == 3 and None not in owners

            await wait_until(all_deferred, what="three deferred tasks held by the triggerer")
        finally:
            await store.close()

        os.kill(_postmaster_pid(admin), signal.SIGKILL)
        await wait_until(lambda: _select_1(admin), what="the server to be back")
        for i in range(3):
            release_file(base / f"release-{i}", f"done {i}")

        async def run_ended() -> bool:
            try:
                store = await Store.connect(url, pool_size=1, migrate=False)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                return False
            try:
                run = await store.get_dag_run("outage", "run1")
                return run is not None and run.state == "success"
            finally:
                await store.close()

        await wait_until(run_ended, timeout_s=60, what="the run to succeed after the outage")

    try:
        for kind in ("scheduler", "worker", "triggerer"):
            with (base / f"{kind}.log").open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "engine", kind],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        anyio.run(scenario)
    except BaseException:
        for path in sorted(base.glob("*.log")):
            print(f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}")
        raise
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert all(proc.returncode == 0 for proc in procs)


def test_files_root_writes_in_the_data_folder_replace_a_planted_link(tmp_path: Path) -> None:
    """The server's account can write in its data folder: a link it plants there (to
    /etc/passwd, say) must be replaced, not written or chowned through."""
    outside = tmp_path / "outside"
    outside.write_text("precious\n")
    before = outside.stat()
    data = tmp_path / "data"
    data.mkdir()
    planted = data / "pg_hba.conf"
    planted.symlink_to(outside)
    pgcluster._write_owned(planted, "new contents\n", None)
    pgcluster._give(planted, None)
    assert outside.read_text() == "precious\n"
    assert not planted.is_symlink()
    assert planted.read_text() == "new contents\n"
    assert stat.S_IMODE(planted.stat().st_mode) == 0o600
    after = outside.stat()
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    )
