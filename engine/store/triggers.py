"""The triggerer's statements: registration and lease, claims, the fenced write of trigger
outcomes, deadlines, and the triggers and triggerers the CLI lists. A reader of
:class:`engine.store.Store`.

Registration, lease renewal and the outcome write are functions taking a connection (or the
pool): the triggerer's lease connection (:class:`engine.store.session.TriggererSession`) and the
store's pool run the one implementation. Writes return what they moved and settle nothing: the
triggerer settles it (engine/store/downstream.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import asyncpg

from engine.security.keys import MARKER, Keyring, UnreadableValue
from engine.store.connection import Conn
from engine.store.core import StoreCore, from_dicts, off_loop, one, storable_opt, structs
from engine.store.models import (
    ClaimedTrigger,
    FiredTriggers,
    MovedTask,
    RefusedTrigger,
    TimedOutTask,
    TriggerClaim,
    TriggererHealth,
    TriggererRow,
    TriggerOutcome,
    TriggerRow,
    TriggerWaiters,
)
from engine.version import __version__
from operators.defaults import DEFAULT_QUEUE

__all__ = [
    "TriggerQueries",
    "reap_triggerers",
    "register_triggerer",
    "renew_triggerer_lease",
    "write_trigger_outcomes",
]

log = logging.getLogger(__name__)


async def register_triggerer(
    on: Conn | asyncpg.Pool,
    q: dict[str, str],
    hostname: str,
    pid: int,
    capacity: int,
    lease_s: float,
    queues: Sequence[str],
    *,
    locked: bool,
    timeout_s: float | None = None,
) -> int:
    """A new triggerer row that claims the triggers of ``queues``, with a lease of ``lease_s``
    seconds on the database clock. ``locked``: the connection ``on`` also takes, in the same
    statement, the session lock that shows the triggerer alive for as long as that connection
    lives (the lease connection's registration; a pooled connection must not hold it).
    ``timeout_s`` bounds each statement (None: the connection's own bound)."""
    row = await on.fetchrow(
        q["register_triggerer_locked" if locked else "register_triggerer"],
        hostname,
        pid,
        capacity,
        lease_s,
        __version__,
        list(queues),
        timeout=timeout_s,
    )
    assert row is not None
    return int(row["id"])


async def renew_triggerer_lease(
    on: Conn | asyncpg.Pool,
    q: dict[str, str],
    triggerer_id: int,
    lease_s: float,
    health: TriggererHealth | None = None,
    *,
    timeout_s: float | None = None,
) -> int | None:
    """Extend the lease (and record the loop's ``health`` for the status page, in the same
    statement; None: left as it was); how many triggers it owns, or None when the
    registration is gone (the lease was lost)."""
    h = health or TriggererHealth()
    row = await on.fetchrow(
        q["renew_triggerer_lease"],
        triggerer_id,
        lease_s,
        h.loop_lag_p99_ms,
        None if health is None else h.blocked_loops,
        h.worst_blocker,
        h.worst_block_ms,
        timeout=timeout_s,
    )
    return None if row is None else int(row["owned"])


async def reap_triggerers(
    on: Conn | asyncpg.Pool, q: dict[str, str], *, timeout_s: float | None = None
) -> tuple[int, int]:
    """Remove the triggerers that are gone (lease expired, or session lock free) and free
    their triggers for adoption, in two statements (see reap_triggerers in queries.sql):
    ``(triggerers reaped, triggers freed)``."""
    gone = [r["id"] for r in await on.fetch(q["reap_triggerers"], timeout=timeout_s)]
    if not gone:
        return 0, 0
    row = await one(on, q["release_reaped_triggers"], gone, timeout_s=timeout_s)
    return len(gone), int(row["triggers"])


async def write_trigger_outcomes(
    on: Conn | asyncpg.Pool,
    q: dict[str, str],
    keyring: Keyring,
    triggerer_id: int,
    outcomes: Sequence[TriggerOutcome],
    *,
    timeout_s: float | None = None,
) -> FiredTriggers:
    """Write a batch of trigger outcomes in one round trip, their payloads sealed with
    ``keyring``: one call that locks the triggers, then writes every outcome in a statement of
    its own (fire_triggers in queries.sql, and lock_owned_triggers for why two statements).

    Returns the ids of the triggers whose outcome was accepted (the others were refused by
    the fencing check: this triggerer no longer owns them, or owns a later claim of them) and
    the task instances that moved, which the caller settles (engine/store/downstream.py)."""
    payloads = await off_loop(
        keyring, lambda batch: [keyring.encrypt_opt(o.payload) for o in batch], list(outcomes)
    )
    ids = [o.trigger_id for o in outcomes]
    rows = await on.fetch(
        q["fire_triggers"],
        triggerer_id,
        ids,
        [o.fence for o in outcomes],
        [o.kind for o in outcomes],
        payloads,
        [storable_opt(o.error) for o in outcomes],
        [storable_opt(o.shown) for o in outcomes],
        timeout=timeout_s,
    )
    accepted = frozenset([r["fired_id"] for r in rows])
    woke = any(r["woke"] for r in rows)
    moved = structs([r for r in rows if r["id"] is not None], MovedTask)
    return FiredTriggers(accepted=accepted, moved=moved, woke=woke)


class TriggerQueries(StoreCore):
    """The statements of triggerers and their triggers."""

    # -- triggerers ------------------------------------------------------------------------

    async def register_triggerer(
        self,
        hostname: str,
        pid: int,
        capacity: int,
        lease_s: float,
        queues: Sequence[str] = (DEFAULT_QUEUE,),
    ) -> int:
        """A triggerer without a session lock (its lease alone shows it alive): a triggerer
        process registers on its lease connection instead (TriggererSession.register)."""
        return await register_triggerer(
            self._pool, self._q, hostname, pid, capacity, lease_s, queues, locked=False
        )

    async def renew_triggerer_lease(self, triggerer_id: int, lease_s: float) -> int | None:
        """Extend the lease; returns how many triggers it owns, or None if the lease was lost."""
        return await renew_triggerer_lease(self._pool, self._q, triggerer_id, lease_s)

    async def owned_triggers(self, triggerer_id: int) -> dict[int, int]:
        rows = await self._pool.fetch(self._q["owned_trigger_ids"], triggerer_id)
        return {r["id"]: r["fence"] for r in rows}

    async def count_owned_triggers(self, triggerer_id: int) -> int:
        n: int = await self._pool.fetchval(self._q["count_owned_triggers"], triggerer_id)
        return n

    async def release_triggers(self, triggerer_id: int, trigger_ids: Sequence[int]) -> set[int]:
        """Unown the given triggers of a triggerer, so any triggerer claims them again."""
        rows = await self._pool.fetch(self._q["release_triggers"], triggerer_id, list(trigger_ids))
        return {r["id"] for r in rows}

    async def release_triggerer(self, triggerer_id: int) -> int:
        """Give up every trigger at once (graceful stop) and remove the triggerer."""
        released: int = await self._pool.fetchval(self._q["release_triggerer"], triggerer_id)
        return released

    async def reap_triggerers(self) -> int:
        """Unown the triggers of triggerers that are gone (lease expired, or session lock
        free); returns how many were freed."""
        reaped, freed = await reap_triggerers(self._pool, self._q)
        if reaped:
            log.warning(
                "%d triggerer(s) gone (session ended or lease lapsed); %d trigger(s) freed for "
                "adoption",
                reaped,
                freed,
            )
        return freed

    async def release_ownerless_triggers(self) -> int:
        """Free triggers owned by no registered triggerer (the scheduler's backstop)."""
        row = await one(self._pool, self._q["release_ownerless_triggers"])
        return int(row["triggers"])

    # -- claims, outcomes and deadlines ----------------------------------------------------

    async def claim_triggers(self, triggerer_id: int, limit: int) -> TriggerClaim:
        """Claim up to ``limit`` unowned triggers of the triggerer's queues, their kwargs
        opened. A trigger no configured key opens cannot run here or anywhere with these
        keys: it comes back refused, as the failure to write (its tasks fail, retries apply,
        with an error naming the setting)."""
        rows = await self._pool.fetch(self._q["claim_triggers"], triggerer_id, limit)
        return await off_loop(self.keyring, self._open_triggers, rows)

    def _open_triggers(self, rows: list[asyncpg.Record]) -> TriggerClaim:
        """Decrypt the kwargs of claimed triggers; the ones no configured key opens come back
        refused instead."""
        opened: list[dict[str, Any]] = []
        refused: list[RefusedTrigger] = []
        for r in rows:
            try:
                kwargs = self.keyring.decrypt(r["kwargs"])
            except UnreadableValue as exc:
                log.error("trigger %s (%s) cannot run: %s", r["id"], r["classpath"], exc)
                outcome = TriggerOutcome(
                    trigger_id=r["id"],
                    fence=r["fence"],
                    kind="failed",
                    error=f"trigger {r['classpath']} cannot run: {exc}",
                )
                refused.append(RefusedTrigger(classpath=r["classpath"], outcome=outcome))
                continue
            row = dict(r)
            row["kwargs"] = kwargs
            row["sealed"] = not self.keyring.encrypts or r["kwargs"].startswith(MARKER)
            opened.append(row)
        return TriggerClaim(claimed=from_dicts(opened, ClaimedTrigger), refused=refused)

    async def count_unowned_triggers(self) -> int:
        n: int = await self._pool.fetchval(self._q["count_unowned_triggers"])
        return n

    async def fire_triggers(
        self, triggerer_id: int, outcomes: Sequence[TriggerOutcome]
    ) -> FiredTriggers:
        """Write a batch of trigger outcomes (:func:`write_trigger_outcomes`)."""
        return await write_trigger_outcomes(
            self._pool, self._q, self.keyring, triggerer_id, outcomes
        )

    async def prime_triggerer_connections(self) -> int:
        """Run a triggerer's hot statements once on every connection of the pool, with
        arguments that match nothing (a fire of no trigger; a claim of
        none): nothing is written. Returns the connections primed. Why:
        ``TaskQueries.prime_worker_connections``."""
        q, keyring = self._q, self.keyring

        async def prime(conn: Conn) -> None:
            await write_trigger_outcomes(conn, q, keyring, 0, [])
            await conn.fetch(q["claim_triggers"], 0, 0)

        return await self._on_every_connection(prime)

    async def timeout_deferrals(
        self, trigger_ids: Sequence[int] | None, *, grace_s: float = 0.0
    ) -> list[TimedOutTask]:
        """End deferrals past their deadline (of these triggers, or all when None); returns
        what moved, which the caller settles (engine/store/downstream.py)."""
        rows = await self._pool.fetch(
            self._q["timeout_deferrals"],
            None if trigger_ids is None else list(trigger_ids),
            grace_s,
        )
        return structs(rows, TimedOutTask)

    async def trigger_waiters(self, trigger_ids: Sequence[int]) -> list[TriggerWaiters]:
        """How many task instances wait on each trigger, and the earliest deadline."""
        rows = await self._pool.fetch(self._q["trigger_waiters"], list(trigger_ids))
        return structs(rows, TriggerWaiters)

    async def delete_owned_triggers(
        self, triggerer_id: int, trigger_ids: Sequence[int]
    ) -> set[int]:
        ids = list(trigger_ids)
        async with self._tx() as conn:
            await conn.execute(self._q["lock_owned_triggers"], triggerer_id, ids)
            rows = await conn.fetch(self._q["delete_owned_triggers"], triggerer_id, ids)
        return {r["id"] for r in rows}

    async def delete_orphan_triggers(self, min_age_s: float) -> int:
        """Drop the triggers at least ``min_age_s`` old that no task waits on (the scheduler's
        housekeeping); returns how many."""
        async with self._tx() as conn:
            locked = [r["id"] for r in await conn.fetch(self._q["lock_orphan_triggers"], min_age_s)]
            if not locked:
                return 0
            rows = await conn.fetch(self._q["delete_orphan_triggers"], locked)
        return len(rows)

    # -- listings (the CLI) ----------------------------------------------------------------

    async def list_triggers(
        self, limit: int = 10_000, *, tasks_per_trigger: int = 5
    ) -> list[TriggerRow]:
        """Triggers with their kwargs (decrypted) and the first ``tasks_per_trigger`` task
        instances waiting on each (``waiting`` counts them all)."""
        rows = await self._pool.fetch(self._q["list_triggers"], limit, tasks_per_trigger)
        return from_dicts(self._open_listed(rows), TriggerRow)

    async def get_trigger(self, trigger_id: int) -> TriggerRow | None:
        """One trigger with its kwargs (decrypted) and every task instance waiting on it;
        None when there is no such trigger (it fired, or nobody waits on it any more)."""
        row = await self._pool.fetchrow(self._q["get_trigger"], trigger_id)
        return None if row is None else from_dicts(self._open_listed([row]), TriggerRow)[0]

    def _open_listed(self, rows: Sequence[asyncpg.Record]) -> list[dict[str, Any]]:
        """Rows of triggers with their kwargs decrypted (None where no configured key opens
        them: one unreadable trigger must not hide the others)."""
        listed = [dict(r) for r in rows]
        for row in listed:
            try:
                row["kwargs"] = self.keyring.decrypt(row["kwargs"])
            except UnreadableValue as exc:
                log.warning("trigger %s: kwargs not shown: %s", row["id"], exc)
                row["kwargs"] = None
        return listed

    async def list_triggerers(self) -> list[TriggererRow]:
        return structs(await self._pool.fetch(self._q["list_triggerers"]), TriggererRow)
