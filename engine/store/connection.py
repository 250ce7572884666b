"""The store's connections, apart from its queries: the pool (with the JSON codec and retries
at start), the migrations, and ``LISTEN`` (a dedicated connection per listener). The channel
names every process listens on are here too."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import anyio
import asyncpg
import msgspec

from engine.runtime.retry import with_db_retry
from engine.store.queries import migrations

__all__ = [
    "CHANNEL_DEADLINES",
    "CHANNEL_FINISHED",
    "CHANNEL_RUNS",
    "CHANNEL_STOP",
    "CHANNEL_TASKS",
    "CHANNEL_TRIGGERS",
    "CONNECT_ATTEMPTS",
    "HANDED_UNREAD_S",
    "PAYLOAD_CALLBACKS",
    "PAYLOAD_HANDED",
    "SESSION_SETTINGS",
    "Conn",
    "Listener",
    "create_pool",
    "in_tx",
    "migrate",
]

log = logging.getLogger(__name__)

#: A task instance became runnable: workers claim.
CHANNEL_TASKS = "deferral_tasks"
#: The payload on :data:`CHANNEL_TASKS` of a callback request written (migration 0030): only
#: the workers' callback runners claim.
PAYLOAD_CALLBACKS = "callbacks"
#: The payload on :data:`CHANNEL_TASKS`, followed by a worker's id, of a fire that handed that
#: worker resumes (migration 0033): only that worker reads them; no worker claims.
PAYLOAD_HANDED = "handed "
#: Seconds a resume handed to a worker may stay unread before the scheduler gives it back for
#: any worker to claim (the worker reads it on the notification, and at its polling backstop
#: at the latest: a second by default; migration 0033).
HANDED_UNREAD_S = 5.0
#: A trigger is unowned: triggerers claim.
CHANNEL_TRIGGERS = "deferral_triggers"
#: A task joined a running trigger with an earlier deadline; the payload is the trigger id.
CHANNEL_DEADLINES = "deferral_deadlines"
#: A run has no unfinished task instance left: the scheduler ends it (payload: its id).
CHANNEL_FINISHED = "deferral_finished"
#: A DAG run ended; the payload is "<dag_id> <run_id> <state>".
CHANNEL_RUNS = "deferral_runs"
#: A mark or a clear told a worker to stop a running try; the payload is the worker's id.
CHANNEL_STOP = "deferral_stop"

#: How many times a process tries to connect and migrate at start before giving up.
CONNECT_ATTEMPTS = 6

#: A connection of the pool or one of its own (the statements run on either).
Conn = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy


#: How long the start or the rollback of a transaction may hold up a cancel (a hung database).
ROLLBACK_S = 5.0


@contextlib.asynccontextmanager
async def in_tx(conn: Conn) -> AsyncIterator[None]:
    """A transaction on ``conn`` (as ``conn.transaction()``) that a cancel cannot leave open.

    Its start and its rollback are shielded from a cancel (for up to ``ROLLBACK_S`` each): a
    transaction cut short by a cancel (a stopping scheduler, a try's execution_timeout, a
    stopping process) is rolled back before its connection goes back to the pool. Else the
    cancel cut the ``BEGIN`` (asyncpg then still holds the transaction as begun) or the
    ``ROLLBACK`` too, and the pool's reset rolled it back while logging an error ('Resetting
    connection with an active transaction'). (A lost connection has nothing to roll back.)"""
    tx = conn.transaction()
    with anyio.move_on_after(ROLLBACK_S, shield=True) as starting:
        await tx.start()
    if starting.cancelled_caught:
        raise TimeoutError(f"BEGIN had no answer within {ROLLBACK_S:g} s")
    try:
        yield
    except BaseException:
        with anyio.move_on_after(ROLLBACK_S, shield=True), contextlib.suppress(Exception):
            await tx.rollback()
        raise
    await tx.commit()


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb",
        encoder=lambda value: msgspec.json.encode(value).decode(),
        decoder=msgspec.json.decode,
        schema="pg_catalog",
        format="text",
    )


# Settings of every pooled connection, the workers' heartbeat connection and the
# triggerers' lease connection (those two run against a deadline). ``jit``: PostgreSQL
# compiles a statement whose estimated cost passes ``jit_above_cost`` with LLVM, and the
# claim's function runs with ``enable_seqscan = off``, which prices a sequential read of a
# small table at 1e10: on a server built with JIT (most packaged ones; the embedded one is
# not) every claim was compiled and optimised anew, 1.6-7 s a call instead of ~1 ms, and
# resumes waited minutes. The engine's statements are short; compiling them never pays.
SESSION_SETTINGS = {"jit": "off"}


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Pooled connections keep no session state (no LISTEN, no session locks, no SET), so the
    reset round trip asyncpg makes on every release is skipped."""


async def create_pool(
    url: str,
    *,
    pool_size: int,
    on_connect: Callable[[asyncpg.Connection], Any] | None = None,
    warm: bool = False,
) -> asyncpg.Pool:
    """A pool whose connections encode and decode ``jsonb`` with msgspec (``on_connect`` also
    runs for each new one). A connection lost while starting (a killed backend, a restarting
    server) is tried again a few times; a database that cannot be reached at all still fails
    soon, with its own error.

    ``warm``: every connection is opened now and kept open however long it idles (else they
    open on demand, from one, and close after 5 idle minutes). For the processes whose
    latency is the product (workers, triggerers): a connection opened in a burst costs the
    statements that wait for it a new backend, its authentication and its cold caches, some
    50 to 200 ms on this machine's two cores, and a burst (the first due triggers of a
    window, a fleet's condition coming true) is exactly when the pool grows."""

    async def init(conn: asyncpg.Connection) -> None:
        await _init_connection(conn)
        if on_connect is not None:
            on_connect(conn)

    pool: asyncpg.Pool = await with_db_retry(
        "connect to the database",
        lambda: asyncpg.create_pool(
            url,
            min_size=pool_size if warm else 1,
            max_size=pool_size,
            init=init,
            reset=_keep_session,
            command_timeout=60,
            server_settings=SESSION_SETTINGS,
        ),
        attempts=CONNECT_ATTEMPTS,
    )
    return pool


async def migrate(pool: asyncpg.Pool, q: dict[str, str]) -> list[int]:
    """Apply the migrations not applied yet, in order, in one transaction that holds the
    migrations lock (processes starting together take turns); returns their versions."""
    applied: list[int] = []
    async with pool.acquire() as conn, in_tx(conn):
        await conn.execute(q["lock_migrations"])
        await conn.execute(q["ensure_migrations_table"])
        done = {r["version"] for r in await conn.fetch(q["applied_migrations"])}
        for version, name, sql in migrations():
            if version in done:
                continue
            await conn.execute(sql)
            await conn.execute(q["record_migration"], version, name)
            applied.append(version)
    if applied:
        log.info("applied migrations %s", applied)
    return applied


class Listener:
    """A dedicated connection that LISTENs on channels and reconnects when it drops.

    Notifications only wake loops up; every loop still polls as a backstop, so a lost
    notification (or a lost connection) delays work but never loses it.
    """

    def __init__(self, url: str, channels: Iterable[str]) -> None:
        self._url = url
        self._channels = tuple(channels)
        self._conn: asyncpg.Connection | None = None
        self._callbacks: list[Callable[[str, str], None]] = []
        self._closing = False

    def on_notify(self, callback: Callable[[str, str], None]) -> None:
        self._callbacks.append(callback)

    def _dispatch(self, _conn: Any, _pid: int, channel: str, payload: object) -> None:
        for callback in self._callbacks:
            callback(channel, str(payload))

    async def connect(self) -> None:
        conn = await asyncpg.connect(self._url)
        try:
            for channel in self._channels:
                await conn.add_listener(channel, self._dispatch)
            conn.add_termination_listener(self._on_lost)
        except BaseException:
            conn.terminate()  # half made (killed while listening): not kept
            raise
        self._conn = conn

    def _on_lost(self, _conn: object) -> None:
        if not self._closing:
            log.warning("notification connection lost; polling until it is back")
        self._conn = None

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    async def ensure_connected(self) -> None:
        if not self.connected:
            try:
                await self.connect()
            except (
                OSError,
                TimeoutError,
                asyncpg.PostgresError,
                asyncpg.InterfaceError,
                asyncpg.InternalClientError,
            ) as exc:
                log.warning("cannot LISTEN (%s: %s); polling only for now", type(exc).__name__, exc)

    async def close(self) -> None:
        self._closing = True
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            try:
                await conn.close()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.debug("closing the notification connection: %s", exc)
                conn.terminate()
