"""What every reader of the store shares (:class:`StoreCore`, the base of each reader class):
the pool, the named queries, the keys, and the helpers that turn records into structs and
keep text storable."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import asyncpg
import msgspec

from engine.security.keys import Keyring
from engine.store.connection import Conn, in_tx, migrate
from engine.store.queries import load_queries

__all__ = [
    "StoreCore",
    "from_dicts",
    "in_tx",
    "off_loop",
    "one",
    "storable",
    "storable_opt",
    "struct",
    "structs",
]

T = TypeVar("T")

#: Batches with fewer values than this are encrypted or decrypted on the event loop; larger
#: ones in a thread (a Fernet token costs some 10-20 us: 5,000 would hold the loop ~0.1 s).
INLINE_CRYPTO = 256


def storable(text: str) -> str:
    """PostgreSQL text holds neither NUL characters nor lone surrogates (a filename decoded
    with surrogateescape); an error message or a log line can carry both (a task or trigger
    may raise or print anything). Escaped, it is stored instead of failing the whole batch."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def storable_opt(text: str | None) -> str | None:
    return None if text is None else storable(text)


def structs(records: Sequence[asyncpg.Record], type_: type[T]) -> list[T]:
    """Database rows as structs (the columns a struct does not name are ignored). Each record
    is copied into a dict first: msgspec reads a dict several times faster than a record
    (about 1 against 3-5 us a row, measured on claim and moved rows)."""
    return from_dicts(list(map(dict, records)), type_)


def from_dicts(rows: list[dict[str, Any]], type_: type[T]) -> list[T]:
    """Rows already copied into dicts (and decrypted) as structs, in one msgspec call."""
    converted: list[T] = msgspec.convert(rows, list[type_])  # type: ignore[valid-type]
    return converted


def struct(record: asyncpg.Record, type_: type[T]) -> T:
    return msgspec.convert(dict(record), type_)


async def one(
    conn: Conn | asyncpg.Pool, sql: str, *args: Any, timeout_s: float | None = None
) -> asyncpg.Record:
    """A statement that always returns exactly one row (``timeout_s``: its bound)."""
    row = await conn.fetchrow(sql, *args, timeout=timeout_s)
    assert row is not None, sql
    return row


async def off_loop(keyring: Keyring, fn: Callable[[list[Any]], T], items: list[Any]) -> T:
    """Run a (de|en)cryption pass over a large batch in a thread, so the event loop's other
    coroutines are not held for its duration; small batches (or no keys) run inline."""
    if len(items) < INLINE_CRYPTO or not keyring.encrypts:
        return fn(items)
    return await anyio.to_thread.run_sync(fn, items)


class StoreCore:
    """A pool of connections, the named queries and the keys; every reader class of the store
    derives from it, and :class:`engine.store.Store` from them all."""

    def __init__(self, pool: asyncpg.Pool, url: str, keyring: Keyring | None = None) -> None:
        self._pool = pool
        self.url = url
        self._q = load_queries()
        #: Seals trigger kwargs, resume kwargs, events and results; no keys: plaintext.
        self.keyring = keyring or Keyring()
        #: The worker's heartbeats go on a connection of their own (heartbeat_worker).
        self._heartbeat_conn: asyncpg.Connection | None = None
        self._heartbeat_lock = asyncio.Lock()

    async def close(self) -> None:
        self._drop_heartbeat_connection()
        await self._pool.close()

    def _drop_heartbeat_connection(self) -> None:
        conn, self._heartbeat_conn = self._heartbeat_conn, None
        if conn is not None:
            conn.terminate()

    async def _on_every_connection(self, run: Callable[[Conn], Awaitable[object]]) -> int:
        """Run ``run`` on each connection of the pool at once (all of them held together, so
        that each is a different one); returns how many. For a pool opened in full
        (``warm``): the connections a burst will use are otherwise first used in it."""
        size = self._pool.get_max_size()
        held: list[asyncpg.pool.PoolConnectionProxy] = []
        try:
            for _ in range(size):
                held.append(await self._pool.acquire())
            await asyncio.gather(*(run(conn) for conn in held))
        finally:
            for conn in held:
                await self._pool.release(conn)
        return len(held)

    @contextlib.asynccontextmanager
    async def _tx(self) -> AsyncIterator[Conn]:
        async with self._pool.acquire() as conn, in_tx(conn):
            yield conn

    async def migrate(self) -> list[int]:
        """Apply the migrations not applied yet, in order; returns their versions."""
        return await migrate(self._pool, self._q)

    async def now(self) -> dt.datetime:
        value: dt.datetime = await self._pool.fetchval(self._q["db_now"])
        return value

    async def notify(self, channel: str, payload: str = "") -> None:
        await self._pool.execute(self._q["notify"], channel, payload)
