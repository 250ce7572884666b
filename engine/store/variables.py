"""The store's statements for what task code and templates read at run time: Variables,
Connections, and the previous successful run of a DAG (a part of :class:`Store`).

A Variable's value and a Connection's password and extra are encrypted with the store's
keyring (nothing else of them: ids, hosts and logins are listed and searched). A value is
written as UTF-8 text (a Connection's secrets as a JSON object) and sealed with the primary
key; ``rotate_secret_values`` re-encrypts them with the other stored values (``deferral keys
rotate``).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

from engine.security.keys import UnreadableValue
from engine.store.core import StoreCore
from engine.store.models.variables import PrevRun, StoredConnection, VariableRow
from triggers.connections import Connection

__all__ = [
    "ConnectionExists",
    "PrevRun",
    "StoredConnection",
    "VariableQueries",
    "VariableRow",
    "check_id",
]

#: The longest Variable key or connection id (as Airflow's columns: 250).
MAX_ID_CHARS = 250


class ConnectionExists(ValueError):
    """``add_connection`` for an id that is stored already."""


def check_id(value: str, what: str) -> str:
    """A Variable key or connection id as stored: 1-250 characters, no NUL, no surrounding
    spaces. ValueError naming ``what`` otherwise."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"a {what} must be a non-empty string")
    if value != value.strip():
        raise ValueError(f"a {what} must not start or end with spaces: {value!r}")
    if len(value) > MAX_ID_CHARS:
        raise ValueError(f"a {what} is at most {MAX_ID_CHARS} characters, got {len(value)}")
    if "\x00" in value:
        raise ValueError(f"a {what} must not contain a NUL character")
    return value


class VariableQueries(StoreCore):
    """Variable, Connection and previous-run statements (a reader of
    :class:`engine.store.Store`)."""

    # -- Variables -------------------------------------------------------------------------

    async def set_variable(
        self,
        key: str,
        value: str,
        *,
        description: str | None = None,
        is_secret: bool | None = None,
    ) -> bool:
        """Store ``value`` under ``key`` (created or replaced); ``description`` and
        ``is_secret`` stay as they were when None. Returns whether it was created."""
        check_id(key, "Variable key")
        if not isinstance(value, str):
            raise TypeError(f"a Variable's value is text, got {type(value).__name__}")
        sealed = self.keyring.encrypt(value.encode("utf-8"))
        created: bool = await self._pool.fetchval(
            self._q["set_variable"], key, sealed, description, is_secret
        )
        return created

    async def get_variable(self, key: str) -> VariableRow | None:
        row = await self._pool.fetchrow(self._q["get_variable"], key)
        return None if row is None else self._variable(row)

    async def list_variables(self) -> list[VariableRow]:
        return [self._variable(r) for r in await self._pool.fetch(self._q["list_variables"])]

    async def delete_variable(self, key: str) -> bool:
        """Whether a Variable of that key existed (and is gone)."""
        deleted = await self._pool.fetchval(self._q["delete_variable"], key)
        return bool(deleted)

    def _variable(self, row: Any) -> VariableRow:
        return VariableRow(
            key=row["key"],
            value=self.keyring.decrypt(row["value"]).decode("utf-8"),
            description=row["description"],
            is_secret=row["is_secret"],
            updated_at=row["updated_at"],
        )

    # -- Connections -----------------------------------------------------------------------

    async def add_connection(self, conn: Connection, *, replace: bool = False) -> bool:
        """Store ``conn`` (ConnectionExists if its id is stored and not ``replace``).
        Returns whether it was created."""
        check_id(conn.conn_id, "connection id")
        if conn.port is not None and not 0 <= conn.port <= 65535:
            raise ValueError(f"connection {conn.conn_id!r}: port must be 0-65535, got {conn.port}")
        secrets = None
        if conn.password is not None or conn.extra:
            plain = msgspec.json.encode({"password": conn.password, "extra": conn.extra})
            secrets = self.keyring.encrypt(plain)
        args = (conn.conn_id, conn.conn_type, conn.host, conn.schema, conn.login, conn.port,
                secrets, conn.description)  # fmt: skip
        if replace:
            created: bool = await self._pool.fetchval(self._q["replace_connection"], *args)
            return created
        inserted = await self._pool.fetchval(self._q["add_connection"], *args)
        if not inserted:
            raise ConnectionExists(
                f"connection {conn.conn_id!r} exists already: delete it first (deferral "
                f"connections delete {conn.conn_id}) or add it with --replace"
            )
        return True

    async def get_connection(self, conn_id: str) -> StoredConnection | None:
        row = await self._pool.fetchrow(self._q["get_connection"], conn_id)
        return None if row is None else self._connection(row)

    async def list_connections(self) -> list[StoredConnection]:
        return [self._connection(r) for r in await self._pool.fetch(self._q["list_connections"])]

    async def delete_connection(self, conn_id: str) -> bool:
        deleted = await self._pool.fetchval(self._q["delete_connection"], conn_id)
        return bool(deleted)

    def _connection(self, row: Any) -> StoredConnection:
        secrets: dict[str, Any] = {}
        if row["secrets"] is not None:
            secrets = msgspec.json.decode(self.keyring.decrypt(row["secrets"]))
        return StoredConnection(
            conn_id=row["conn_id"],
            conn_type=row["conn_type"],
            host=row["host"],
            schema=row["schema"],
            login=row["login"],
            port=row["port"],
            password=secrets.get("password"),
            extra=secrets.get("extra"),
            description=row["description"],
            updated_at=row["updated_at"],
        )

    # -- rotation ----------------------------------------------------------------------------

    async def rotate_secret_values(self, *, batch_size: int = 500) -> dict[str, int]:
        """Re-encrypt every Variable value and Connection secret with the primary key, in
        batches of short statements; each write is conditional on the ciphertext read (a
        value changed meanwhile is left alone: it was written with the writer's primary key).
        Counts as ``Store.rotate_keys``: ``rewritten``, ``current``, ``changed``,
        ``unreadable``."""
        counts = {"rewritten": 0, "current": 0, "changed": 0, "unreadable": 0}
        for read, write in (
            ("rotation_variables", "rotate_variable_values"),
            ("rotation_connections", "rotate_connection_secrets"),
        ):
            last = ""
            while True:
                rows = await self._pool.fetch(self._q[read], last, batch_size)
                if not rows:
                    break
                last = rows[-1]["id"]
                ids, olds, news = [], [], []
                for row in rows:
                    new = self._reencrypted(row["value"], counts)
                    if new is not None:
                        ids.append(row["id"])
                        olds.append(row["value"])
                        news.append(new)
                if ids:
                    done = await self._pool.fetchval(self._q[write], ids, olds, news)
                    counts["rewritten"] += done
                    counts["changed"] += len(ids) - done
        return counts

    def _reencrypted(self, value: bytes, counts: dict[str, int]) -> bytes | None:
        if self.keyring.is_current(value):
            counts["current"] += 1
            return None
        try:
            return self.keyring.reencrypt(value)
        except UnreadableValue:
            counts["unreadable"] += 1
            return None

    # -- the previous successful run --------------------------------------------------------

    async def prev_success_run(self, dag_id: str, logical_date: dt.datetime) -> PrevRun | None:
        """The latest successful run of ``dag_id`` before ``logical_date``: its data
        interval and when it started and ended (``prev_*_success``)."""
        row = await self._pool.fetchrow(self._q["prev_success_run"], dag_id, logical_date)
        return None if row is None else msgspec.convert(dict(row), PrevRun)
