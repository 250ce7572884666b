"""Test fixtures: a real PostgreSQL (embedded, or DEFERRAL_TEST_DSN), one fresh database per
test created from a migrated template, and the engine's processes running in the test's loop.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.security.keys import Keyring, generate_key
from engine.store import Store
from engine.store.databases import create_database, drop_database
from engine.store.embedded import embedded_database_url
from tests.processes import Children, process_env

REPO = Path(__file__).resolve().parent.parent

#: The encryption key of this test session. Tests hand child processes the database URL, which
#: makes the database external for them: they need a key too, and inherit this one.
TEST_FERNET_KEY = os.environ.setdefault("DEFERRAL_FERNET_KEY", generate_key())


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    """Every async test runs on asyncio (debug mode) and on uvloop."""
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def admin_url() -> str:
    """A superuser URL: DEFERRAL_TEST_DSN, or an embedded server of this session's own.

    Its data lives in a folder of its own, not under pytest's basetemp: pytest deletes old
    basetemp folders when another session starts, which would pull the data from under a
    running server.
    """
    dsn = os.environ.get("DEFERRAL_TEST_DSN")
    if dsn:
        return dsn
    home = Path(tempfile.mkdtemp(prefix="deferral-tests-"))
    # As root the server runs as another OS user, which must be able to enter the folder
    # (0711: enter, not list); otherwise its data would go to /var/lib/deferral-pg and
    # outlive this session.
    home.chmod(0o711)
    # Registered before the server starts, so it runs after the server's own exit handler
    # has stopped it (exit handlers run last-registered first).
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    return embedded_database_url(home)


@pytest.fixture(scope="session")
def template_db(admin_url: str) -> Iterator[str]:
    """A migrated database that every test's database is copied from."""
    name = f"deferral_tpl_{os.getpid()}"

    async def create() -> None:
        url = await create_database(admin_url, name, replace=True)
        store = await Store.connect(url, pool_size=1)
        await store.close()

    asyncio.run(create())
    yield name
    asyncio.run(drop_database(admin_url, name))


@pytest.fixture
def db_url(admin_url: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    yield asyncio.run(create_database(admin_url, name, template=template_db))
    asyncio.run(drop_database(admin_url, name))


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[Store]:
    s = await Store.connect(db_url, pool_size=4, keyring=Keyring([TEST_FERNET_KEY]))
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
def own_server() -> Iterator[Any]:
    """An embedded PostgreSQL of this test alone: the test stops and starts it
    (tests.pg_server.stop_server, start_server)."""
    from tests.pg_server import own_server

    with own_server() as server:
        yield server


@pytest.fixture
def children(db_url: str, tmp_path: Path) -> Iterator[Children]:
    """Engine processes of one test on its database (tests/processes.py); all stopped at the
    end."""
    logs = tmp_path / "logs"
    logs.mkdir()
    kids = Children(process_env(db_url, tmp_path), logs)
    try:
        yield kids
    finally:
        kids.stop_all()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Captured output is sent from each pytest-xdist worker as UTF-8: a test that prints
    undecodable bytes (surrogate escapes, e.g. a NUL-bearing error read back) would crash the
    worker's report, so such characters are shown escaped."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    report.sections = [
        (title, text.encode("utf-8", "backslashreplace").decode("utf-8"))
        for title, text in report.sections
    ]
