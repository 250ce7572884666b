"""The store's methods for asset watchers on the triggerer (the SQL: watchers.sql; the schema:
migration 0025_watchers.sql). A mixin of :class:`engine.store.Store`.

A watcher (declared by the DAG files, ``deferral_asset_watchers``) runs as a trigger row:
:meth:`WatcherQueries.sync_watchers` keeps one row per watcher of an asset an active, unpaused
DAG is scheduled on (DAG scans and a scheduler duty call it); triggerers claim, lease, fence
and adopt those rows like any trigger, read the cursor a claimed watcher starts from
(:meth:`WatcherQueries.claimed_watchers`) and write its events with its cursor in one fenced
statement (:meth:`WatcherQueries.record_watcher_events`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.store.core import in_tx, off_loop, structs
from engine.store.models import (
    ClaimedWatcher,
    WatcherFault,
    WatcherItem,
    WatcherState,
    WatcherSync,
)

if TYPE_CHECKING:
    import asyncpg

    from engine.security.keys import Keyring

__all__ = ["WatcherQueries", "watcher_key"]


def watcher_key(asset: str, name: str, classpath: str, kwargs: bytes) -> str:
    """The digest naming a watcher's trigger row: its asset, name and trigger as declared
    (encoded kwargs before encryption, so re-encrypting the same trigger keeps it)."""
    digest = hashlib.sha256()
    for part in (asset.encode(), name.encode(), classpath.encode(), kwargs):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


class WatcherQueries:
    """Watcher methods of the store (``self._pool``, ``self._q`` and ``self.keyring`` are the
    store's)."""

    _pool: asyncpg.Pool
    _q: dict[str, str]
    keyring: Keyring

    async def sync_watchers(self) -> WatcherSync:
        """Make the watchers' trigger rows match the declarations: a row for each watcher of
        an asset an active, unpaused DAG is scheduled on (not of one only tasks' outlets
        write, as in Airflow; a new row when its trigger changed, its cursor then forgotten),
        none for the others; one transaction."""
        async with self._pool.acquire() as conn, in_tx(conn):
            await conn.execute(self._q["watcher_sync_lock"])
            rows = await conn.fetch(self._q["watcher_declarations"])
            keys = await off_loop(self.keyring, self._keys, list(rows))
            start: list[tuple[str, str, str, bytes, str]] = []
            stop: list[int] = []
            for row, key in zip(rows, keys, strict=True):
                running = row["trigger_id"] is not None
                if not row["active"] or key is None:
                    if running:
                        stop.append(row["trigger_id"])
                    continue
                if running and row["trigger_key"] == key:
                    continue
                if running:
                    stop.append(row["trigger_id"])
                start.append((row["asset"], row["name"], row["classpath"], row["kwargs"], key))
            result = await conn.fetchrow(
                self._q["sync_watcher_triggers"],
                [s[0] for s in start],
                [s[1] for s in start],
                [s[2] for s in start],
                [s[3] for s in start],
                [s[4] for s in start],
                stop,
            )
        assert result is not None
        return WatcherSync(stopped=result["stopped"], started=result["started"])

    def _keys(self, rows: list[Any]) -> list[str | None]:
        """Each declaration's digest (None: its kwargs open with no configured key; it is
        not run)."""
        keys: list[str | None] = []
        for row in rows:
            try:
                kwargs = self.keyring.decrypt(row["kwargs"])
            except Exception:
                keys.append(None)
                continue
            keys.append(watcher_key(row["asset"], row["name"], row["classpath"], kwargs))
        return keys

    async def claimed_watchers(
        self, triggerer_id: int, trigger_ids: Sequence[int]
    ) -> list[ClaimedWatcher]:
        """Of triggers this triggerer claimed, the ones that run watchers, with the cursor
        each starts from."""
        if not trigger_ids:
            return []
        rows = await self._pool.fetch(self._q["claimed_watchers"], triggerer_id, list(trigger_ids))
        return structs(rows, ClaimedWatcher)

    async def record_watcher_events(
        self, triggerer_id: int, items: Sequence[WatcherItem]
    ) -> set[int]:
        """Write watchers' events with their cursors in one statement, only for the triggers
        this triggerer still owns with each item's fence; the trigger ids written."""
        if not items:
            return set()
        rows = await self._pool.fetch(
            self._q["record_watcher_events"],
            triggerer_id,
            [i.trigger_id for i in items],
            [i.fence for i in items],
            [i.extra for i in items],
            [i.is_event for i in items],
            [i.cursor for i in items],
            [i.has_cursor for i in items],
            [i.seq for i in items],
        )
        return {r["trigger_id"] for r in rows}

    async def watcher_failed(self, triggerer_id: int, fault: WatcherFault) -> bool:
        """Record that a watcher's trigger raised (fenced); False: not this triggerer's."""
        row = await self._pool.fetchrow(
            self._q["watcher_failed"],
            triggerer_id,
            fault.trigger_id,
            fault.fence,
            fault.error,
            fault.retry_in_s,
            fault.restart,
        )
        return row is not None

    async def watcher_states(self) -> list[WatcherState]:
        """Every declared watcher and what runs it now."""
        rows = await self._pool.fetch(self._q["watcher_states"])
        return structs(rows, WatcherState)
