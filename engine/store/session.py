"""A triggerer's own connection, outside the pool: it holds the triggerer's session lock.

The triggerer's lease thread (engine/triggerer/lease.py) runs these statements on an event loop of
its own. The connection's session holds the advisory lock taken at registration: when the
process dies or the connection drops, PostgreSQL frees the lock at once, and any live
triggerer's ``reap_triggerers`` frees the dead one's triggers for adoption.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from engine.security.keys import Keyring
from engine.store.connection import SESSION_SETTINGS
from engine.store.models import TriggererHealth, TriggerOutcome
from engine.store.queries import load_queries
from engine.store.triggers import (
    reap_triggerers,
    register_triggerer,
    renew_triggerer_lease,
    write_trigger_outcomes,
)
from operators.defaults import DEFAULT_QUEUE

__all__ = ["TriggererSession"]


class TriggererSession:
    """One dedicated connection; every call may raise a transient error (reconnect)."""

    def __init__(self, url: str, *, timeout_s: float, keyring: Keyring | None = None) -> None:
        self._url = url
        self._q = load_queries()
        #: Seals the payloads of the outcomes it writes (failures carry none).
        self.keyring = keyring or Keyring()
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
            server_settings={**SESSION_SETTINGS, "application_name": "deferral triggerer lease"},
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
        return await register_triggerer(
            self._c(),
            self._q,
            hostname,
            pid,
            capacity,
            lease_s,
            queues,
            locked=True,
            timeout_s=self.timeout_s,
        )

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
        return await renew_triggerer_lease(
            self._c(), self._q, triggerer_id, lease_s, health, timeout_s=self.timeout_s
        )

    async def reap(self) -> tuple[int, int]:
        """Free the triggers of gone triggerers: ``(triggerers reaped, triggers freed)``."""
        return await reap_triggerers(self._c(), self._q, timeout_s=self.timeout_s)

    async def fail_triggers(
        self, triggerer_id: int, outcomes: Sequence[TriggerOutcome]
    ) -> set[int]:
        """Write failures as every outcome is written (:func:`write_trigger_outcomes`); returns
        the triggers whose failure was accepted. (Downstream tasks are resolved by the
        scheduler's backstop: this connection only keeps the lease.)"""
        fired = await write_trigger_outcomes(
            self._c(), self._q, self.keyring, triggerer_id, outcomes, timeout_s=self.timeout_s
        )
        return set(fired.accepted)
