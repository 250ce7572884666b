"""Variables and Connections as task code and templates read them.

``from engine import Variable`` (Airflow: ``from airflow.sdk import Variable``)::

    Variable.get("bucket")                                # the text, KeyError if none
    Variable.get("bucket", default_var="fallback")
    Variable.get("settings", deserialize_json=True)       # JSON decoded
    await Variable.async_get("bucket")                    # in async code
    Variable.set("last_seen", "2026-12-01") ; Variable.delete("last_seen")

A key is looked up first in the environment (``DEFERRAL_VAR_<KEY>``, the key upper-cased with
every character that is not a letter or digit as ``_``, as connections are), then in the
database (``deferral variables set``). In templates: ``{{ var.value.bucket }}``,
``{{ var.json.settings.region }}``, ``{{ var.value.get('bucket', 'fallback') }}``; connections:
``{{ conn.warehouse.host }}`` (triggers.connections looks them up).

The database is reached through the engine the task runs in: a worker binds its store for the
task (:func:`bind_store`), and a sync task, a sensor's ``poke`` or a template reads through
it from its worker thread. On the event loop's own thread (an ``async def execute``) a sync
``Variable.get`` would stop every other task of the worker while it waits: it refuses, and
``await Variable.async_get(...)`` reads without blocking. Code that runs outside a worker
(a DAG file's top level in a scheduler, a script) reads through a connection of its own to the
database the settings name. A task with ``isolation="process"`` runs in a process without
database credentials: it is refused, with a message saying so (:func:`bind_fallback`).

A value read is registered with the secrets masker (engine.masking) when its key is named
like a secret (``api_token``) or the Variable is marked secret (``--secret``), and a
connection's password and its extra's secret-named values always: logs and stored rendered
fields of the task show ``***`` for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from engine.masking import register_secret
from triggers.connections import (
    Connection,
    ConnectionNotFound,
    ConnectionSource,
    LookupWouldBlock,
    connection_source,
    current_source,
    get_connection,
)

if TYPE_CHECKING:
    from engine.store import Store

__all__ = [
    "ConnectionAccessor",
    "StoreAccess",
    "Variable",
    "VariableAccessor",
    "VariableNotFound",
    "bind_fallback",
    "bind_store",
    "bind_store_here",
    "var_env_name",
]

T = TypeVar("T")

#: How long a sync read waits for the database before giving up.
SYNC_TIMEOUT_S = 60.0
#: How long a stored connection is reused by the process that read it (a trigger that polls
#: every few seconds does not query the database each time).
CONNECTION_TTL_S = 10.0


class VariableNotFound(KeyError):
    """No environment variable or stored Variable has the key (and no default was given)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "Variable not found"


def var_env_name(key: str) -> str:
    """The environment variable that defines Variable ``key``."""
    return "DEFERRAL_VAR_" + re.sub(r"[^A-Za-z0-9]", "_", key).upper()


# -- access to a store -------------------------------------------------------------------------


class StoreAccess:
    """Reads (and writes) of Variables and Connections through a store whose connections
    belong to ``loop``, from any thread or event loop: the statements always run on ``loop``.
    Also the stored-connections source of :mod:`triggers.connections`."""

    def __init__(self, store: Store, loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.loop = loop
        self._conns: dict[str, tuple[float, Connection | None]] = {}

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    async def run(self, make: Callable[[], Awaitable[T]]) -> T:
        """``await make()`` on the store's loop, from whatever loop this is."""
        if self._on_loop():
            return await make()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_call(make), self.loop))

    def run_sync(self, make: Callable[[], Awaitable[T]], what: str) -> T:
        """``make()`` on the store's loop, waited for here (a worker thread, another loop's
        thread); LookupWouldBlock on the store's own loop thread."""
        if self._on_loop():
            raise LookupWouldBlock(
                f"{what} cannot wait for the database on the event loop's own thread (it would "
                "stop the worker's other tasks): in async code use the async form "
                "(await Variable.async_get(...), await aget_connection(...))"
            )
        future = asyncio.run_coroutine_threadsafe(_call(make), self.loop)
        return future.result(timeout=SYNC_TIMEOUT_S)

    # -- the triggers.connections source -------------------------------------------------

    def _cached(self, conn_id: str) -> tuple[bool, Connection | None]:
        found = self._conns.get(conn_id)
        if found is None or self.loop.time() - found[0] > CONNECTION_TTL_S:
            return False, None
        return True, found[1]

    async def _read_connection(self, conn_id: str) -> Connection | None:
        row = await self.store.get_connection(conn_id)
        conn = None if row is None else row.connection()
        if conn is not None:
            _register_connection(conn)
        self._conns[conn_id] = (self.loop.time(), conn)
        return conn

    def lookup(self, conn_id: str) -> Connection | None:
        hit, conn = self._cached(conn_id)
        if hit:
            return conn
        return self.run_sync(lambda: self._read_connection(conn_id), f"connection {conn_id!r}")

    async def alookup(self, conn_id: str) -> Connection | None:
        hit, conn = self._cached(conn_id)
        if hit:
            return conn
        return await self.run(lambda: self._read_connection(conn_id))


async def _call(make: Callable[[], Awaitable[T]]) -> T:
    return await make()


def _register_connection(conn: Connection) -> None:
    if conn.password:
        register_secret(conn.password)
    extra = conn.extra_dejson
    if extra:
        register_secret(extra)


def _register_variable(key: str, value: str, *, secret: bool) -> None:
    if secret:
        register_secret(value)
    else:
        register_secret(value, name=key)
    if value[:1] in "{[":
        with contextlib.suppress(ValueError):
            register_secret(json.loads(value))


_access: ContextVar[StoreAccess | None] = ContextVar("deferral_store_access", default=None)


@contextlib.contextmanager
def bind_store(store: Store) -> Iterator[StoreAccess]:
    """Within this block (and the tasks and threads started in it), Variables and stored
    Connections are read through ``store``, whose loop is the running one."""
    access = StoreAccess(store, asyncio.get_running_loop())
    token = _access.set(access)
    try:
        with connection_source(access):
            yield access
    finally:
        _access.reset(token)


def bind_store_here(store: Store) -> StoreAccess:
    """Bind ``store`` for the rest of the current task (a worker's try) unless one is bound
    already; what is bound."""
    access = _access.get()
    if access is not None and access.store is store:
        return access
    access = StoreAccess(store, asyncio.get_running_loop())
    _access.set(access)
    _set_source(access)
    return access


def _set_source(access: ConnectionSource) -> None:
    from triggers import connections

    connections._source.set(access)


# -- without a worker: a connection of the process's own ---------------------------------------

_bridge_lock = threading.Lock()
_bridge: StoreAccess | None = None


#: Set in a child process of ``isolation="process"``: it has no database credentials.
_isolated = False

_ISOLATED = (
    'a task with isolation="process" cannot read stored Variables or connections: its process '
    "gets no database credentials (a clean environment, as a BashOperator command). Read them "
    "in a task without isolation, or pass the value in (op_kwargs, params)"
)


def _open_bridge() -> StoreAccess:
    """A store of this process's own, on an event loop in a thread of its own, opened from
    the settings (environment and deferral.toml) on first use; refused in an isolated task's
    process, which has no credentials (it would reach another database, or none)."""
    global _bridge
    if _isolated:
        raise LookupError(_ISOLATED)
    with _bridge_lock:
        if _bridge is not None:
            return _bridge
        from engine.config import load_settings
        from engine.store import open_store

        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="deferral-variables", daemon=True)
        thread.start()
        settings = load_settings()
        opening = asyncio.run_coroutine_threadsafe(open_store(settings, migrate=False), loop)
        store = opening.result(timeout=SYNC_TIMEOUT_S)
        _bridge = StoreAccess(store, loop)
        return _bridge


def bind_fallback() -> None:
    """In the process of a task with ``isolation="process"``: stored Variables and
    Connections are refused with a message that says why (the environment's are read)."""
    global _isolated
    _isolated = True
    if current_source() is None:
        _set_source(_BridgeSource())


class _BridgeSource:
    """The stored-connections source of a process without a worker: its own store."""

    def lookup(self, conn_id: str) -> Connection | None:
        return _open_bridge().lookup(conn_id)

    async def alookup(self, conn_id: str) -> Connection | None:
        return await _open_bridge().alookup(conn_id)


def _current_or_bridge() -> StoreAccess:
    """The store bound for this task, or the process's own."""
    return _access.get() or _open_bridge()


# -- Variable ----------------------------------------------------------------------------------


class _Missing:
    def __repr__(self) -> str:
        return "<no default>"


_MISSING: Any = _Missing()


def _decode(key: str, value: str, deserialize_json: bool) -> Any:
    if not deserialize_json:
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise ValueError(f"Variable {key!r} is not JSON ({exc}); read it without "
                         "deserialize_json") from None  # fmt: skip


def _not_found(key: str) -> VariableNotFound:
    return VariableNotFound(
        f"Variable {key!r} does not exist: set it with `deferral variables set {key} VALUE` (or "
        f"the environment variable {var_env_name(key)}), or give Variable.get a default_var"
    )


def _from_env(key: str, environ: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    value = env.get(var_env_name(key))
    return value if value is not None else None


class Variable:
    """Read and write Variables (see the module)."""

    @staticmethod
    def get(key: str, default_var: Any = _MISSING, deserialize_json: bool = False) -> Any:
        """The value of ``key`` (JSON decoded with ``deserialize_json``), or ``default_var``
        when there is none (VariableNotFound, a KeyError, without one)."""
        value = _from_env(key)
        if value is None:
            access = _current_or_bridge()
            row = access.run_sync(lambda: access.store.get_variable(key), f"Variable.get({key!r})")
            if row is None:
                if default_var is not _MISSING:
                    return default_var
                raise _not_found(key)
            value = row.value
            _register_variable(key, value, secret=row.is_secret)
        else:
            _register_variable(key, value, secret=False)
        return _decode(key, value, deserialize_json)

    @staticmethod
    async def async_get(
        key: str, default_var: Any = _MISSING, deserialize_json: bool = False
    ) -> Any:
        """:meth:`get` for async code: the database is read without blocking the loop."""
        value = _from_env(key)
        if value is None:
            access = _current_or_bridge()
            row = await access.run(lambda: access.store.get_variable(key))
            if row is None:
                if default_var is not _MISSING:
                    return default_var
                raise _not_found(key)
            value = row.value
            _register_variable(key, value, secret=row.is_secret)
        else:
            _register_variable(key, value, secret=False)
        return _decode(key, value, deserialize_json)

    @staticmethod
    def set(
        key: str,
        value: Any,
        description: str | None = None,
        serialize_json: bool = False,
    ) -> None:
        """Store ``value`` (text; JSON encoded with ``serialize_json``) under ``key``."""
        text = json.dumps(value, indent=2) if serialize_json else str(value)
        access = _current_or_bridge()
        access.run_sync(
            lambda: access.store.set_variable(key, text, description=description),
            f"Variable.set({key!r})",
        )

    @staticmethod
    def delete(key: str) -> bool:
        """Delete ``key``; whether it existed."""
        access = _current_or_bridge()
        return access.run_sync(
            lambda: access.store.delete_variable(key), f"Variable.delete({key!r})"
        )  # fmt: skip


# -- templates ---------------------------------------------------------------------------------


class VariableAccessor:
    """``var.value`` / ``var.json`` in templates: ``{{ var.value.bucket }}``."""

    def __init__(self, *, deserialize_json: bool) -> None:
        self._json = deserialize_json

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        return Variable.get(key, deserialize_json=self._json)

    def __getitem__(self, key: str) -> Any:
        return Variable.get(key, deserialize_json=self._json)

    def get(self, key: str, default_var: Any = None) -> Any:
        return Variable.get(key, default_var, deserialize_json=self._json)

    def __repr__(self) -> str:
        return f"<Variables{' (JSON)' if self._json else ''}>"


class ConnectionAccessor:
    """``conn`` in templates: ``{{ conn.warehouse.host }}``."""

    def __getattr__(self, conn_id: str) -> Connection:
        if conn_id.startswith("__"):
            raise AttributeError(conn_id)
        return get_connection(conn_id)

    def __getitem__(self, conn_id: str) -> Connection:
        return get_connection(conn_id)

    def get(self, conn_id: str, default_conn: Any = None) -> Any:
        try:
            return get_connection(conn_id)
        except ConnectionNotFound:
            return default_conn

    def __repr__(self) -> str:
        return "<Connections>"


#: ``var`` in templates and the context.
VARIABLES = {
    "value": VariableAccessor(deserialize_json=False),
    "json": VariableAccessor(deserialize_json=True),
}
#: ``conn`` in templates and the context.
CONNECTIONS = ConnectionAccessor()
