"""What Variables, Connections and the previous run read as (engine/store/variables.py)."""

from __future__ import annotations

import datetime as dt

import msgspec

from triggers.connections import Connection

__all__ = ["PrevRun", "StoredConnection", "VariableRow"]


class VariableRow(msgspec.Struct, frozen=True, kw_only=True):
    """A stored Variable (its value decrypted)."""

    key: str
    value: str
    description: str | None
    is_secret: bool
    updated_at: dt.datetime


class StoredConnection(msgspec.Struct, frozen=True, kw_only=True):
    """A stored Connection's row (password and extra decrypted)."""

    conn_id: str
    conn_type: str | None
    host: str | None
    schema: str | None
    login: str | None
    port: int | None
    password: str | None
    extra: str | None
    description: str | None
    updated_at: dt.datetime

    def connection(self) -> Connection:
        return Connection(
            conn_id=self.conn_id,
            conn_type=self.conn_type,
            description=self.description,
            host=self.host,
            login=self.login,
            password=self.password,
            schema=self.schema,
            port=self.port,
            extra=self.extra,
        )


class PrevRun(msgspec.Struct, frozen=True, kw_only=True):
    """The latest successful run of a DAG before a logical date (the ``prev_*_success``
    template variables)."""

    data_interval_start: dt.datetime
    data_interval_end: dt.datetime
    start_date: dt.datetime | None
    end_date: dt.datetime | None
