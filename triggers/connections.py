"""Connections: a trigger (or a task) names a connection id instead of carrying a secret.

A connection id is looked up, first match wins:

1. the environment: ``DEFERRAL_CONN_<ID>`` holds the connection's URL
   (``DEFERRAL_CONN_WAREHOUSE=postgresql://...``, ``DEFERRAL_CONN_JOBS_API=https://user:token@jobs``)
   or its fields as a JSON object (``{"conn_type": "http", "host": ..., "password": ...}``). The
   id is upper-cased and every character that is not a letter or digit becomes ``_``;
2. what the running engine provides itself: its own database is the connection id
   ``deferral`` (also the embedded server, whose URL exists only once it started), handed over
   with :func:`connection_defaults` (the environment is never written);
3. the connections stored in the database (``deferral connections add``), which the engine
   hands over with :func:`connection_source`.

The lookup happens where the trigger runs (the triggerer, or the worker for a sensor's check),
so the secret is never stored with the trigger. Both hand-overs are context variables, not a
process-wide registry: they reach the asyncio tasks and the worker threads started within the
block, and two engines in one process (tests) each see their own.

From async code (a trigger's ``run``), use :func:`aresolve_url` / :func:`aget_connection`: a
stored connection is read from the database without blocking the event loop. The sync
:func:`resolve_url` / :func:`get_connection` read it too from a worker thread (a sync task or
a sensor's ``poke``), but not on an event loop's own thread, where they find the environment's
and the engine's connections only, and say so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, Protocol
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

__all__ = [
    "DEFAULT_DEFERRAL_CONN_ID",
    "Connection",
    "ConnectionNotFound",
    "ConnectionSource",
    "LookupWouldBlock",
    "aget_connection",
    "aresolve_url",
    "conn_env_name",
    "connection_defaults",
    "connection_source",
    "get_connection",
    "resolve_url",
]

#: The connection id of the engine's own database (``TaskStateTrigger`` reads it).
DEFAULT_DEFERRAL_CONN_ID = "deferral"


class ConnectionNotFound(LookupError):
    """No environment variable, engine default or stored connection defines the id."""


class LookupWouldBlock(RuntimeError):
    """A stored connection (or Variable) was asked for synchronously on an event loop's own
    thread, where waiting for the database would stop the loop."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Connection:
    """A connection's fields, as Airflow names them (``{{ conn.my_conn.host }}``).

    ``extra`` is JSON text (``extra_dejson``: the object). The password is never part of the
    ``repr``."""

    conn_id: str
    conn_type: str | None = None
    description: str | None = None
    host: str | None = None
    login: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    schema: str | None = None
    port: int | None = None
    extra: str | None = dataclasses.field(default=None, repr=False)

    @property
    def extra_dejson(self) -> dict[str, Any]:
        """``extra`` as an object (``{}`` when empty or not a JSON object)."""
        if not self.extra:
            return {}
        try:
            value = json.loads(self.extra)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    @classmethod
    def from_uri(cls, conn_id: str, uri: str, **fields: Any) -> Connection:
        """The fields of a connection URL: ``type://login:password@host:port/schema?extra``
        (percent-encoded; the query is ``extra``, or ``__extra__=<JSON>``)."""
        parts = urlsplit(uri)
        if not parts.scheme or "://" not in uri:
            raise ValueError(f"connection {conn_id!r}: a URI needs a scheme (type://...)")
        conn_type = parts.scheme.replace("-", "_")
        if conn_type == "postgresql":
            conn_type = "postgres"
        query = parse_qsl(parts.query, keep_blank_values=True)
        extra: str | None = None
        if query:
            found = dict(query)
            extra = found["__extra__"] if "__extra__" in found else json.dumps(found)
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"connection {conn_id!r}: the URI's port is not a number") from None
        return cls(
            conn_id=conn_id,
            conn_type=conn_type,
            host=unquote(parts.hostname) if parts.hostname else None,
            login=unquote(parts.username) if parts.username is not None else None,
            password=unquote(parts.password) if parts.password is not None else None,
            schema=unquote(parts.path.lstrip("/")) or None,
            port=port,
            extra=extra,
            **fields,
        )

    @classmethod
    def from_json(cls, conn_id: str, text: str) -> Connection:
        """The fields of a connection given as a JSON object (``extra``: an object or text)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"connection {conn_id!r}: the JSON must be an object of fields")
        extra = data.get("extra")
        if isinstance(extra, dict):
            extra = json.dumps(extra)
        port = data.get("port")
        return cls(
            conn_id=conn_id,
            conn_type=data.get("conn_type"),
            description=data.get("description"),
            host=data.get("host"),
            login=data.get("login"),
            password=data.get("password"),
            schema=data.get("schema"),
            port=int(port) if port not in (None, "") else None,
            extra=extra,
        )

    def get_uri(self) -> str:
        """The connection as a URL (what :func:`resolve_url` hands a trigger)."""
        scheme = (self.conn_type or "").lower().replace("_", "-")
        if scheme == "postgres":
            scheme = "postgresql"
        uri = f"{scheme}://"
        if self.login is not None or self.password is not None:
            uri += quote(self.login or "", safe="")
            if self.password is not None:
                uri += ":" + quote(self.password, safe="")
            uri += "@"
        uri += self.host or ""
        if self.port is not None:
            uri += f":{self.port}"
        if self.schema:
            uri += "/" + quote(self.schema, safe="")
        extra = self.extra_dejson
        if extra:
            if all(isinstance(v, str) for v in extra.values()):
                uri += "?" + urlencode(extra)
            else:
                uri += "?" + urlencode({"__extra__": json.dumps(extra)})
        return uri

    @classmethod
    def get(cls, conn_id: str) -> Connection:
        """The connection ``conn_id`` (environment, engine, database); see the module."""
        return get_connection(conn_id)

    @classmethod
    async def async_get(cls, conn_id: str) -> Connection:
        return await aget_connection(conn_id)


class ConnectionSource(Protocol):
    """The stored connections, as the engine hands them over (:func:`connection_source`)."""

    def lookup(self, conn_id: str) -> Connection | None:
        """Sync; raises :class:`LookupWouldBlock` on the event loop's own thread."""

    async def alookup(self, conn_id: str) -> Connection | None: ...


#: URLs by connection id that the running engine provides (see :func:`connection_defaults`).
_NONE: Mapping[str, str] = MappingProxyType({})
_defaults: ContextVar[Mapping[str, str]] = ContextVar("deferral_connection_defaults", default=_NONE)
_source: ContextVar[ConnectionSource | None] = ContextVar("deferral_connections", default=None)


@contextlib.contextmanager
def connection_defaults(urls: Mapping[str, str]) -> Iterator[None]:
    """Within this block, the connection ids in ``urls`` that no ``DEFERRAL_CONN_<ID>``
    variable defines resolve to these URLs (the environment still wins)."""
    token = _defaults.set({**_defaults.get(), **urls})
    try:
        yield
    finally:
        _defaults.reset(token)


@contextlib.contextmanager
def connection_source(source: ConnectionSource | None) -> Iterator[None]:
    """Within this block, connection ids neither the environment nor the engine's defaults
    define are looked up in ``source`` (the database's connections)."""
    token = _source.set(source)
    try:
        yield
    finally:
        _source.reset(token)


def current_source() -> ConnectionSource | None:
    return _source.get()


def conn_env_name(conn_id: str) -> str:
    """The environment variable that defines ``conn_id``."""
    return "DEFERRAL_CONN_" + re.sub(r"[^A-Za-z0-9]", "_", conn_id).upper()


def _given(conn: str, environ: Mapping[str, str] | None) -> str | None:
    """The URL (or JSON) the environment or the engine gives ``conn``, if any."""
    env = os.environ if environ is None else environ
    url = env.get(conn_env_name(conn), "") or _defaults.get().get(conn, "")
    if not url and conn == DEFAULT_DEFERRAL_CONN_ID:
        url = env.get("DEFERRAL_DATABASE_URL", "")
    return url or None


def _parse_given(conn_id: str, text: str) -> Connection:
    if text.lstrip().startswith("{"):
        return Connection.from_json(conn_id, text)
    return Connection.from_uri(conn_id, text)


def _not_found(conn: str, reason: str = "") -> ConnectionNotFound:
    return ConnectionNotFound(
        f"connection {conn!r} is not defined: set the environment variable "
        f"{conn_env_name(conn)} to its URL, or add it with `deferral connections add {conn} "
        f"--uri ...`{reason}"
    )


_ON_LOOP = (
    " (a stored connection cannot be read synchronously on the event loop's own thread: "
    "from async code use `await aresolve_url(...)` or `await aget_connection(...)`)"
)


def _stored(conn: str) -> Connection:
    source = _source.get()
    if source is None:
        raise _not_found(conn)
    try:
        found = source.lookup(conn)
    except LookupWouldBlock:
        raise _not_found(conn, _ON_LOOP) from None
    if found is None:
        raise _not_found(conn)
    return found


async def _astored(conn: str) -> Connection:
    source = _source.get()
    found = None if source is None else await source.alookup(conn)
    if found is None:
        raise _not_found(conn)
    return found


def resolve_url(conn: str, environ: Mapping[str, str] | None = None) -> str:
    """A URL as given (anything with ``://``), or the URL of the connection id ``conn``
    (looked up as the module says: environment, engine, database)."""
    if "://" in conn:
        return conn
    given = _given(conn, environ)
    if given is not None and not given.lstrip().startswith("{"):
        return given
    if given is not None:
        return Connection.from_json(conn, given).get_uri()
    return _stored(conn).get_uri()


async def aresolve_url(conn: str, environ: Mapping[str, str] | None = None) -> str:
    """:func:`resolve_url` for async code: a stored connection is read without blocking."""
    if "://" in conn:
        return conn
    given = _given(conn, environ)
    if given is not None and not given.lstrip().startswith("{"):
        return given
    if given is not None:
        return Connection.from_json(conn, given).get_uri()
    return (await _astored(conn)).get_uri()


def get_connection(conn_id: str, environ: Mapping[str, str] | None = None) -> Connection:
    """The connection ``conn_id``'s fields (environment, engine, database)."""
    given = _given(conn_id, environ)
    if given is not None:
        return _parse_given(conn_id, given)
    return _stored(conn_id)


async def aget_connection(conn_id: str, environ: Mapping[str, str] | None = None) -> Connection:
    """:func:`get_connection` for async code."""
    given = _given(conn_id, environ)
    if given is not None:
        return _parse_given(conn_id, given)
    return await _astored(conn_id)
