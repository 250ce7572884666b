"""A triggerer's own connection, outside the pool: it holds the triggerer's session lock.

The triggerer's lease thread (engine/triggerer/lease.py) runs these statements on an event loop of
its own. The connection's session holds the advisory lock taken at registration: when the
process dies or the connection drops, PostgreSQL frees the lock at once, and any live
triggerer's ``reap_triggerers`` frees the dead one's triggers for adoption.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from engine.store.models import TriggererHealth, TriggerOutcome
from engine.store.queries import load_queries
from engine.store.store import _storable_text
from engine.version import __version__
from operators.base import DEFAULT_QUEUE

__all__ = ["TriggererSession"]


class TriggererSession:
    """One dedicated connection; every call may raise a transient error (reconnect)."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        self._url = url
        self._q = load_queries()
        #: Bound on connecting and on each statement: a hung server must not stall the lease.
        self.timeout_s = timeout_s
        self._conn: asyncpg.Connection | None = None

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    async def connect(self) -> None:
        await self.close()
        self._conn = await asyncpg.connect(
            self._url,
            timeout=self.timeout_s,
            server_settings={"application_name": "deferral triggerer lease"},
        )

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            conn.terminate()  # no round trip: the session (and its lock) ends with the socket

    def _c(self) -> asyncpg.Connection:
        if self._conn is None or self._conn.is_closed():
            raise asyncpg.InterfaceError("the triggerer's lease connection is closed")
        return self._conn

    async def register(
        self,
        hostname: str,
        pid: int,
        capacity: int,
        lease_s: float,
        queues: Sequence[str] = (DEFAULT_QUEUE,),
    ) -> int:
        """A new triggerer row whose session lock this connection holds; it claims the
        triggers of ``queues``."""
        row = await self._c().fetchrow(
            self._q["register_triggerer_locked"],
            hostname,
            pid,
            capacity,
            lease_s,
            __version__,
            list(queues),
            timeout=self.timeout_s,
        )
        assert row is not None
        return int(row["id"])

    async def relock(self, triggerer_id: int) -> bool:
        """Take the lock of a triggerer registered before this connection; False if held."""
        locked: bool = await self._c().fetchval(
            self._q["relock_triggerer"], triggerer_id, timeout=self.timeout_s
        )
        return locked

    async def unlock(self, triggerer_id: int) -> None:
        await self._c().fetchval(self._q["unlock_triggerer"], triggerer_id, timeout=self.timeout_s)

    async def renew(
        self, triggerer_id: int, lease_s: float, health: TriggererHealth | None = None
    ) -> int | None:
        """Extend the lease (and record the loop's ``health`` for the status page, in the same
        statement); the triggers it owns, or None when the registration is gone."""
        h = health or TriggererHealth()
        row = await self._c().fetchrow(
            self._q["renew_triggerer_lease"],
            triggerer_id,
            lease_s,
            h.loop_lag_p99_ms,
            None if health is None else h.blocked_loops,
            h.worst_blocker,
            h.worst_block_ms,
            timeout=self.timeout_s,
        )
        return None if row is None else int(row["owned"])

    async def reap(self) -> tuple[int, int]:
        """Free the triggers of gone triggerers: ``(triggerers reaped, triggers freed)``."""
        conn = self._c()
        rows = await conn.fetch(self._q["reap_triggerers"], timeout=self.timeout_s)
        if not rows:
            return 0, 0
        gone = [r["id"] for r in rows]
        row = await conn.fetchrow(self._q["release_reaped_triggers"], gone, timeout=self.timeout_s)
        assert row is not None
        return len(gone), int(row["triggers"])

    async def fail_triggers(
        self, triggerer_id: int, outcomes: Sequence[TriggerOutcome]
    ) -> set[int]:
        """Write failures through the same fenced statement as every outcome; returns the
        triggers whose failure was accepted. (Downstream tasks are resolved by the
        scheduler's backstop: this connection only keeps the lease.)"""
        conn = self._c()
        ids = [o.trigger_id for o in outcomes]
        async with conn.transaction():  # lock first: see Store.fire_triggers
            await conn.execute(
                self._q["lock_owned_triggers"], triggerer_id, ids, timeout=self.timeout_s
            )
            rows = await conn.fetch(
                self._q["fire_triggers"],
                triggerer_id,
                ids,
                [o.fence for o in outcomes],
                [o.kind for o in outcomes],
                [o.payload for o in outcomes],
                [_storable_text(o.error) for o in outcomes],
                timeout=self.timeout_s,
            )
        return {r["fired_id"] for r in rows if r["id"] is None}
