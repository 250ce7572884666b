"""Wait until a SQL query's first cell is truthy (PostgreSQL, asyncpg)."""

from __future__ import annotations

import datetime as dt
import decimal
import uuid
from collections.abc import Sequence
from typing import Any

import asyncpg

from triggers.connections import aresolve_url
from triggers.polling import DEFAULT_POLL_INTERVAL_S, PollingTrigger

__all__ = ["SqlTrigger"]


def _plain(value: Any) -> Any:
    """A database value as plain data for the event payload."""
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dt.datetime) and value.tzinfo is None:
        return value.isoformat()
    return value


class SqlTrigger(PollingTrigger):
    """Runs ``sql`` with ``parameters`` every ``poll_interval`` seconds on the database ``conn``
    (a ``postgresql://`` URL or a connection id, see :mod:`triggers.connections`) and fires
    when the first cell of the first row is truthy; that cell is the payload. No row, NULL,
    0, false or an empty string mean "not yet". One connection is held across polls and closed
    in ``cleanup()``.
    """

    def __init__(
        self,
        conn: str,
        sql: str,
        *,
        parameters: Sequence[Any] = (),
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        end_from_trigger: bool = False,
    ) -> None:
        super().__init__(poll_interval=poll_interval, end_from_trigger=end_from_trigger)
        if not isinstance(sql, str) or not sql.strip():
            raise ValueError("sql must be a non-empty string")
        self.conn = conn
        self.sql = sql
        self.parameters = list(parameters)
        self._connection: asyncpg.Connection | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.sql.SqlTrigger",
            {
                "conn": self.conn,
                "sql": self.sql,
                "parameters": self.parameters,
                **self._base_kwargs(),
            },
        )

    async def check(self) -> Any:
        if self._connection is None or self._connection.is_closed():
            self._connection = await asyncpg.connect(await aresolve_url(self.conn))
        try:
            value = await self._connection.fetchval(self.sql, *self.parameters)
        except (asyncpg.PostgresConnectionError, ConnectionError, OSError) as exc:
            self.log.info("query failed (%s); reconnecting at the next poll", exc)
            await self.cleanup()
            return None
        return _plain(value) if value else None

    async def cleanup(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and not connection.is_closed():
            await connection.close()
