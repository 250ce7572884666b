"""The worker's statements: registration and heartbeats, claims, and what a try writes (its
outcome, a deferral, a reschedule, its rendered fields). A reader of :class:`engine.store.Store`.

The writes return what they moved and settle nothing: the worker settles it
(engine/store/downstream.py). A claim returns the tries it took that cannot run (``refused``)
unwritten: the worker writes them as it writes every outcome.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Sequence
from typing import Any

import asyncpg

from engine.security.keys import UnreadableValue
from engine.store.connection import SESSION_SETTINGS, Conn
from engine.store.core import StoreCore, from_dicts, one, storable_opt, structs
from engine.store.models import (
    ClaimedTask,
    Deferral,
    FinishedTask,
    Heartbeat,
    StopRequest,
    TaskClaim,
    TaskOutcome,
)
from engine.version import __version__
from operators.defaults import DEFAULT_QUEUE

log = logging.getLogger("engine.store")

__all__ = ["TaskQueries"]

#: Resume kwargs of none (``encode_value({})``, MessagePack's empty map): stored as null,
#: which the resume reads as no kwargs. Nothing to keep secret, so nothing to encrypt.
_NO_KWARGS = b"\x80"


def _missing_pools(rows: list[dict[str, Any]], worker_id: int) -> list[TaskOutcome]:
    """The claimed tries whose pool does not exist, as failed outcomes (no retry: another
    try would not find the pool either) naming the pool and how to make it."""
    return [
        TaskOutcome(
            ti_id=row["id"],
            worker_id=worker_id,
            try_number=row["try_number"],
            kind="failed",
            no_retry=True,
            error=(
                f"pool {row['pool']!r} does not exist: create it (deferral pools set "
                f"{row['pool']} --slots N) or set the task's pool to one `deferral pools list` "
                "shows"
            ),
        )
        for row in rows
        if row.get("missing_pool")
    ]


class TaskQueries(StoreCore):
    """The statements of workers and their tries."""

    # -- workers ---------------------------------------------------------------------------

    async def register_worker(
        self,
        hostname: str,
        pid: int,
        slots: int,
        queues: Sequence[str] = (DEFAULT_QUEUE,),
        *,
        parallelism: int = 0,
        heartbeat_s: float = 5.0,
        takes_resumes: bool = False,
    ) -> int:
        """A new worker row; its id. ``takes_resumes``: triggerers hand it the resumes they
        can admit as their triggers fire (it must read them when told: ``handed_tasks``;
        what it does not read within a few seconds is given back)."""
        worker_id: int = await self._pool.fetchval(
            self._q["register_worker"],
            hostname,
            pid,
            slots,
            __version__,
            list(queues),
            parallelism,
            heartbeat_s,
            takes_resumes,
        )
        return worker_id

    async def stop_taking_resumes(self, worker_id: int) -> None:
        """No triggerer hands this worker a resume once this returns (a stopping worker)."""
        await self._pool.execute(self._q["stop_taking_resumes"], worker_id)

    async def unregister_worker(self, worker_id: int) -> None:
        await self._pool.execute(self._q["unregister_worker"], worker_id)

    async def heartbeat_worker(
        self,
        worker_id: int,
        running: Sequence[tuple[int, int]],
        *,
        timeout_s: float | None = None,
    ) -> Heartbeat:
        """Keep the worker and the tries it runs (``running``: (task instance id, try number)
        pairs, tries told to stop that still run included) alive; the tries it was told to
        stop that it no longer runs are settled (their slots free), and those it still runs
        come back for it to stop. ``alive`` is False if the worker was reaped.

        With ``timeout_s``, the heartbeat goes on a connection of its own, and the call
        (connecting included) is bounded: past it, TimeoutError, and that connection is dropped
        (the next call makes a new one). A connection that hangs (a half-open socket, a stuck
        backend), or a pool whose connections all wait on hung statements, must not keep the
        worker silent while the scheduler, which reaches the database, counts the silence."""
        args = (
            worker_id,
            [ti_id for ti_id, _ in running],
            [try_number for _, try_number in running],
        )
        if timeout_s is None:
            row = await one(self._pool, self._q["heartbeat_worker"], *args)
        else:
            async with self._heartbeat_lock:
                deadline = time.monotonic() + timeout_s
                try:
                    conn = self._heartbeat_conn
                    if conn is None or conn.is_closed():
                        conn = await asyncpg.connect(
                            self.url, timeout=timeout_s, server_settings=SESSION_SETTINGS
                        )
                        self._heartbeat_conn = conn
                    found = await conn.fetchrow(
                        self._q["heartbeat_worker"],
                        *args,
                        timeout=max(deadline - time.monotonic(), 0.001),
                    )
                except BaseException:
                    self._drop_heartbeat_connection()
                    raise
            assert found is not None
            row = found
        return Heartbeat(
            alive=row["alive"],
            stopped=row["stopped"],
            stop=[
                StopRequest(ti_id=i, try_number=n, reason=r)
                for i, n, r in zip(
                    row["stop_ids"], row["stop_tries"], row["stop_reasons"], strict=True
                )
            ],
        )

    # -- claims ----------------------------------------------------------------------------

    async def claim_tasks(
        self,
        worker_id: int,
        limit: int,
        *,
        queues: Sequence[str] = (DEFAULT_QUEUE,),
        parallelism: int = 0,
    ) -> TaskClaim:
        """Claim up to ``limit`` runnable task instances of ``queues`` that every limit admits
        (pools, the DAG's max_active_tasks, the task's max_active_tis_per_dag, and
        ``parallelism`` running tasks across all workers; 0: no limit). With none claimed,
        also says in how many seconds the next waiting one becomes runnable (None: none waits
        for a time). A claimed try that cannot run (its resume no configured key opens, its
        pool does not exist) comes back refused, as the failed outcome to write, naming why."""
        records = await self._pool.fetch(
            self._q["claim_tasks"], worker_id, limit, list(queues), parallelism
        )
        rows, refused = self._open_resumes(records, worker_id)
        refused += _missing_pools(rows, worker_id)
        rows = [r for r in rows if not r.get("missing_pool")]
        claimed = from_dicts([r for r in rows if r["id"] is not None], ClaimedTask)
        next_in: float | None = rows[0]["next_in"] if not claimed and rows else None
        held = bool(rows[0]["held"]) if not claimed and rows else False
        if refused and not claimed:
            next_in = 0.0  # once they are written, their slots are free: claim again
        return TaskClaim(claimed=claimed, refused=refused, next_in=next_in, held=held)

    def _open_resumes(
        self, rows: list[asyncpg.Record], worker_id: int
    ) -> tuple[list[dict[str, Any]], list[TaskOutcome]]:
        """Decrypt the resume kwargs and events of claimed rows; the ones no configured key
        opens come back as failed outcomes instead."""
        opened: list[dict[str, Any]] = []
        failed: list[TaskOutcome] = []
        for r in rows:
            row = dict(r)
            if row["id"] is not None:
                try:
                    row["next_kwargs"] = self.keyring.decrypt_opt(row["next_kwargs"])
                    row["next_event"] = self.keyring.decrypt_opt(row["next_event"])
                    row["map_value"] = self._open_map_value(row)
                except UnreadableValue as exc:
                    failed.append(
                        TaskOutcome(
                            ti_id=row["id"],
                            worker_id=worker_id,
                            try_number=row["try_number"],
                            kind="failed",
                            error=f"cannot resume: {exc}",
                        )
                    )
                    continue
            opened.append(row)
        return opened, failed

    def _open_map_value(self, row: dict[str, Any]) -> bytes | None:
        """A mapped instance's own arguments, decrypted; None when no configured key opens
        them (the worker reads them from the upstream values again)."""
        try:
            return self.keyring.decrypt_opt(row.get("map_value"))
        except UnreadableValue as exc:
            log.warning("task instance %s: its mapped arguments: %s", row["id"], exc)
            return None

    async def unacknowledged_claims(self, worker_id: int, running: Sequence[int]) -> TaskClaim:
        """The task instances the database says worker ``worker_id`` runs, other than the ones
        it knows it runs (``running``): claims whose reply it never received (the connection
        was lost after the claim committed). Read only; the same try continues. Refused as a
        claim refuses: what cannot run."""
        records = await self._pool.fetch(self._q["unacknowledged_claims"], worker_id, list(running))
        return self._held_claim(records, worker_id)

    def _held_claim(self, records: list[asyncpg.Record], worker_id: int) -> TaskClaim:
        """Rows this worker already holds (a claim whose reply was lost, resumes handed to
        it) as a claim: opened, and refused as a claim refuses. (A claim's refusals are
        written by the worker after the reply: a task read this way must not run here without
        its pool.)"""
        rows, refused = self._open_resumes(records, worker_id)
        refused += _missing_pools(rows, worker_id)
        rows = [r for r in rows if not r.get("missing_pool")]
        return TaskClaim(claimed=from_dicts(rows, ClaimedTask), refused=refused)

    async def handed_tasks(self, worker_id: int, limit: int) -> TaskClaim:
        """The resumes triggerers handed worker ``worker_id`` as their triggers fired
        (migration 0033) that it has not read yet, at most ``limit`` (its free slots), marked
        read in the same statement: from then on they are its tries, as claimed ones are; the
        rest are given back for any worker to claim. A reply lost after that commit leaves
        them to :meth:`unacknowledged_claims`. Refused as a claim refuses: what cannot run."""
        found = await self._pool.fetch(self._q["take_handed"], worker_id, max(0, limit))
        return self._held_claim([r for r in found if r["id"] is not None], worker_id)

    # -- what a try writes -----------------------------------------------------------------

    async def finish_tasks(self, outcomes: Sequence[TaskOutcome]) -> list[FinishedTask]:
        """End running tries in one statement, with the tasks their branching successes skip
        (``TaskOutcome.skip``); returns the tries that changed, with their new state (a
        missing one: its worker no longer held it), then the tasks skipped (``worker_id``
        None). The caller settles them (engine/store/downstream.py)."""
        skips = [(o.ti_id, t) for o in outcomes for t in o.skip]
        rows = await self._pool.fetch(
            self._q["finish_tasks"],
            [o.ti_id for o in outcomes],
            [o.worker_id for o in outcomes],
            [o.kind for o in outcomes],
            [self.keyring.encrypt_opt(o.result) for o in outcomes],
            [storable_opt(o.error) for o in outcomes],
            [o.no_retry for o in outcomes],
            [o.try_number for o in outcomes],
            [
                {"ti": o.ti_id, **event}
                for o in outcomes
                if o.asset_events and o.kind == "success"
                for event in o.asset_events
            ]
            or None,
            [ti_id for ti_id, _ in skips],
            [task_id for _, task_id in skips],
        )
        return structs(rows, FinishedTask)

    async def reschedule_task(
        self, ti_id: int, worker_id: int, at: dt.datetime, *, try_number: int
    ) -> bool:
        """Give try ``try_number``'s slot back until ``at``; False if the worker no longer
        holds that try (nothing is written)."""
        row = await self._pool.fetchrow(
            self._q["reschedule_task"], ti_id, worker_id, at, try_number
        )
        return row is not None

    async def expand_task(
        self,
        ti_id: int,
        worker_id: int,
        try_number: int,
        count: int,
        values: Sequence[bytes] | None = None,
    ) -> int:
        """Expand mapped task instance ``ti_id`` (map index -1), whose try ``try_number``
        worker ``worker_id`` holds, into ``count`` (>= 1) scheduled instances, 0..count-1, in
        one statement (``values``: each instance's own arguments, encoded, kept encrypted and
        returned by its claims); how many were made (0: the worker no longer held it, nothing
        written)."""
        if count < 1:
            raise ValueError(f"a mapped task expands into at least 1 instance, got {count}")
        if values is not None and len(values) != count:
            raise ValueError(f"{len(values)} values for {count} mapped instances")
        sealed = None if values is None else [self.keyring.encrypt(v) for v in values]
        row = await self._pool.fetchrow(
            self._q["expand_task"], ti_id, worker_id, try_number, count, sealed
        )
        return 0 if row is None else int(row["made"])

    async def defer_task(self, ti_id: int, worker_id: int, deferral: Deferral) -> bool:
        """Store the trigger (or join an identical waiting one) and park the task on it, in one
        statement. False if the worker no longer holds the task (nothing is written)."""
        return ti_id in await self.defer_tasks(worker_id, [(ti_id, deferral)])

    async def defer_tasks(
        self, worker_id: int, deferrals: Sequence[tuple[int, Deferral]]
    ) -> set[int]:
        """Park tries of worker ``worker_id`` on their triggers, a batch in one statement: each
        ``(task instance id, deferral)`` stores its trigger (or joins the one waiting with the
        same dedup key) as :meth:`defer_task` does. Returns the task instances parked; one the
        worker no longer holds (in that try) is left as it is, and the others are written."""
        keyring = self.keyring
        rows = await self._pool.fetch(
            self._q["defer_tasks"],
            [ti_id for ti_id, _ in deferrals],
            worker_id,
            [d.classpath for _, d in deferrals],
            [keyring.encrypt(d.kwargs) for _, d in deferrals],
            [keyring.dedup_key(d.classpath, d.kwargs, d.dedup_key) for _, d in deferrals],
            [d.timeout_s for _, d in deferrals],
            [d.method_name for _, d in deferrals],
            [
                None if d.method_kwargs == _NO_KWARGS else keyring.encrypt(d.method_kwargs)
                for _, d in deferrals
            ],
            [d.try_number for _, d in deferrals],
            [storable_opt(d.line) for _, d in deferrals],
        )
        return {r["id"] for r in rows}

    async def prime_worker_connections(self) -> int:
        """Run a worker's hot statements once on every connection of the pool, with arguments
        that match nothing (a claim of none, empty batches of outcomes and deferrals, a claim
        of no callback): nothing is written. Returns the connections primed.

        A pool opened in full at start (``warm``) is used last-in first-out, so a worker whose
        deferrals go through one writer uses two or three of its connections until a burst
        of resumes reaches for the others. The first run of a statement on a backend costs
        it the plan, the catalog caches of every table and index it touches, the compiled
        admission function and asyncpg's prepare and type look-ups: 7 to 17 ms for a claim
        or a completion on this machine's two cores (1 ms after), each holding the admission
        lock (claims) or the slots of its batch (completions) meanwhile, all at the first due
        time. Paid here, at start, instead."""
        q = self._q

        async def prime(conn: Conn) -> None:
            await conn.fetch(q["claim_tasks"], 0, 0, [], 0)
            await conn.fetch(q["finish_tasks"], [], [], [], [], [], [], [], None, [], [])
            await conn.fetch(q["defer_tasks"], [], 0, [], [], [], [], [], [], [], [])
            await conn.fetch(q["claim_callbacks"], 0, [], 0, 1.0)

        return await self._on_every_connection(prime)

    async def set_rendered_fields(
        self, ti_id: int, worker_id: int, try_number: int, rendered: dict[str, Any]
    ) -> bool:
        """Keep what the templated fields of a running try rendered to (JSON-ready values);
        False if the worker no longer holds that try (nothing is written)."""
        row = await self._pool.fetchrow(
            self._q["set_rendered_fields"], ti_id, worker_id, try_number, rendered
        )
        return row is not None
