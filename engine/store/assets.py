"""The store's asset methods: assets as DAG files declare them, their events, and the runs
their events trigger (the SQL: assets.sql; the schema: migration 0024_assets.sql).

Every writer of events inserts into ``deferral_asset_events`` and nothing else: a task's
success through ``finish_tasks`` (in the same statement), anyone else through
:meth:`AssetQueries.record_asset_events`. A trigger on that table queues each event for the
DAGs scheduled on its asset, in the writer's transaction, and wakes the schedulers
(``NOTIFY deferral_assets``); a scheduler's pass turns queued events into runs
(:meth:`AssetQueries.create_asset_runs`). A mixin of :class:`engine.store.Store`.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from engine.store.core import in_tx, structs
from engine.store.models import (
    AssetEventRow,
    AssetRecord,
    AssetRow,
    AssetRunCreated,
    AssetWatcherRow,
    NewAssetEvent,
    RecordedAssetEvent,
)

if TYPE_CHECKING:
    import asyncpg

    from engine.security.keys import Keyring

__all__ = ["CHANNEL_ASSETS", "AssetConflict", "AssetQueries"]

log = logging.getLogger(__name__)

#: Asset events were queued for a DAG: the schedulers look for runs to create (a signal only).
CHANNEL_ASSETS = "deferral_assets"

#: DAGs whose asset-triggered runs one statement creates.
ASSET_RUNS_BATCH = 500


class AssetConflict(ValueError):
    """A DAG declares an asset that another active DAG declares differently (the same name
    with another uri, or the same uri under another name)."""


def _renamed(row: Any) -> dict[str, Any]:
    out = dict(row)
    if "created_at" in out:
        out["timestamp"] = out.pop("created_at")
    if "asset_group" in out:
        out["group"] = out.pop("asset_group")
    return out


def _log_dropped(events: Sequence[NewAssetEvent], written: Sequence[RecordedAssetEvent]) -> None:
    """Say which events were not written (their asset is unknown: no active DAG declared it
    yet, or its DAG's assets were refused), by asset and source."""
    left = Counter(w.asset for w in written)
    for e in events:
        if left[e.asset]:
            left[e.asset] -= 1
            continue
        source = (
            f"task {e.source_dag_id}.{e.source_task_id}[{e.source_map_index}] of run "
            f"{e.source_run_id}"
            if e.source_dag_id is not None
            else f"{e.source_kind} {e.source_name or ''}".rstrip()
        )
        log.warning("an event of unknown asset %r from %s is not recorded", e.asset, source)


def _declared(asset: AssetRecord) -> str | None:
    """A digest of what a DAG declares of an asset beyond its name and uri (group, extra,
    watchers with their unencrypted kwargs); None for a bare declaration."""
    if asset.group == "asset" and not asset.extra and not asset.watchers:
        return None
    what = [asset.group, asset.extra, [[n, c, k.hex()] for n, c, k in asset.watchers]]
    return hashlib.sha256(msgspec.json.encode(what, order="deterministic")).hexdigest()


def _conflict(dag_id: str, c: Any) -> AssetConflict:
    if c["declared"]:
        return AssetConflict(
            f"DAG {dag_id} declares asset {c['name']!r} with another group, extra or watchers "
            f"than DAG {c['other_dag']}: declare an asset's group, extra and watchers in one "
            "DAG (or the same in each; a DAG may use the asset bare: Asset(name))"
        )
    return AssetConflict(
        f"DAG {dag_id} declares asset {c['name']!r} differently from DAG "
        f"{c['other_dag']}, which declares asset {c['other_name']!r} with uri "
        f"{c['other_uri']!r}: an asset's name and uri must each name one asset"
    )


class AssetQueries:
    """Asset methods of the store (``self._pool``, ``self._q`` and ``self.keyring`` are the
    store's)."""

    _pool: asyncpg.Pool
    _q: dict[str, str]
    keyring: Keyring

    async def record_dag_assets(self, dag_id: str, assets: Sequence[AssetRecord]) -> None:
        """Record the assets DAG ``dag_id`` uses as its file declares them, with their watchers
        (kwargs encrypted), replacing what was recorded of the DAG's use of assets; one
        transaction. An asset's group, extra and watchers are those of the DAGs that declare
        them: a DAG that declares an asset bare (default group, no extra, no watchers)
        leaves what another active DAG declared. :class:`AssetConflict` (nothing written)
        when another active DAG declares one of them differently (another uri, or another
        group, extra or watchers, neither bare)."""
        declared = [_declared(a) for a in assets]
        names = [a.name for a in assets]
        async with self._pool.acquire() as conn, in_tx(conn):
            if names:
                clashes = await conn.fetch(
                    self._q["asset_conflicts"], dag_id, names, [a.uri for a in assets], declared
                )
                if clashes:
                    raise _conflict(dag_id, clashes[0])
            elsewhere = {
                r["asset"]
                for r in await conn.fetch(self._q["assets_declared_elsewhere"], dag_id, names)
            }
            # what this DAG sets: all but what it uses bare while another DAG declares it
            sets = [
                d is not None or a.name not in elsewhere
                for a, d in zip(assets, declared, strict=True)
            ]
            if names:
                await conn.execute(
                    self._q["upsert_assets"],
                    names,
                    [a.uri for a in assets],
                    [a.group if s else None for a, s in zip(assets, sets, strict=True)],
                    [a.extra if s else None for a, s in zip(assets, sets, strict=True)],
                )
            pairs = [
                (a.name, role, d) for a, d in zip(assets, declared, strict=True) for role in a.roles
            ]
            await conn.execute(
                self._q["set_dag_assets"],
                dag_id,
                [p[0] for p in pairs],
                [p[1] for p in pairs],
                [p[2] for p in pairs],
            )
            watchers = [(a.name, *w) for a in assets for w in a.watchers]
            await conn.execute(
                self._q["set_asset_watchers"],
                [a.name for a, s in zip(assets, sets, strict=True) if s],
                [w[0] for w in watchers],
                [w[1] for w in watchers],
                [w[2] for w in watchers],
                [self.keyring.encrypt(w[3]) for w in watchers],
            )

    async def forget_dag_fingerprint(self, dag_id: str) -> None:
        """The next scan writes DAG ``dag_id`` again (its assets could not be recorded)."""
        await self._pool.execute(self._q["forget_dag_fingerprint"], dag_id)

    async def record_asset_events(
        self, events: Sequence[NewAssetEvent], conn: Any = None
    ) -> list[RecordedAssetEvent]:
        """Record asset events in one statement (``conn``: in that connection's transaction);
        the ones written, in the order given (an event of an unknown asset is not written).
        They are queued for the DAGs scheduled on their assets in the same transaction."""
        if not events:
            return []
        rows = await (conn or self._pool).fetch(
            self._q["record_asset_events"],
            [e.asset for e in events],
            [e.extra for e in events],
            [e.source_kind for e in events],
            [e.source_name for e in events],
            [e.source_dag_id for e in events],
            [e.source_run_id for e in events],
            [e.source_task_id for e in events],
            [e.source_map_index for e in events],
        )
        written = [RecordedAssetEvent(r["id"], r["asset"], r["created_at"]) for r in rows]
        if len(written) < len(events):
            _log_dropped(events, written)
        return written

    async def create_asset_runs(
        self, batch: int = ASSET_RUNS_BATCH, conn: Any = None
    ) -> list[AssetRunCreated]:
        """Create the asset-triggered runs whose DAGs' conditions hold over their queued
        events, as queued runs (one per DAG: its queued events collapse into it); the caller
        admits them (``start_queued_runs``). ``conn``: on that connection (tests).

        Two statements in one transaction: the first locks the DAGs that look ready (SKIP
        LOCKED), the second judges them again and makes the runs. One statement would judge
        on a snapshot taken before its locks: a scheduler that locked a DAG just after
        another committed a run of it would consume what is left (a run whose condition
        does not hold, or one more than max_active_runs)."""
        if conn is None:
            async with self._pool.acquire() as own:
                return await self.create_asset_runs(batch, own)
        async with in_tx(conn):
            locked = await conn.fetch(self._q["lock_asset_ready_dags"], batch)
            if not locked:
                return []
            rows = await conn.fetch(self._q["create_asset_runs"], [r["dag_id"] for r in locked])
        return structs(rows, AssetRunCreated)

    async def run_asset_events(self, dag_run_ids: Sequence[int]) -> list[AssetEventRow]:
        """The events that triggered these runs, oldest first per run."""
        if not dag_run_ids:
            return []
        rows = await self._pool.fetch(self._q["run_asset_events"], list(dag_run_ids))
        return [AssetEventRow(**_renamed(r)) for r in rows]

    async def triggering_asset_events(self, dag_id: str, run_id: str) -> list[AssetEventRow]:
        """The events that triggered run ``run_id`` of DAG ``dag_id``, oldest first."""
        rows = await self._pool.fetch(self._q["triggering_asset_events"], dag_id, run_id)
        return [AssetEventRow(**_renamed(r)) for r in rows]

    async def runs_asset_events(
        self, runs: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], list[AssetEventRow]]:
        """The events that triggered each of these runs ((dag_id, run_id) pairs), oldest
        first; runs not triggered by assets are left out."""
        if not runs:
            return {}
        rows = await self._pool.fetch(
            self._q["runs_asset_events"], [r[0] for r in runs], [r[1] for r in runs]
        )
        found: dict[tuple[str, str], list[AssetEventRow]] = {}
        for r in rows:
            data = _renamed(r)
            key = (data.pop("dag_id"), data.pop("run_id"))
            found.setdefault(key, []).append(AssetEventRow(**data))
        return found

    async def list_assets(self, *, everything: bool = False) -> list[AssetRow]:
        """The assets some active DAG uses (``everything``: every recorded one), by name."""
        rows = await self._pool.fetch(self._q["list_assets"], everything)
        return [AssetRow(**_renamed(r)) for r in rows]

    async def asset_exists(self, name: str) -> bool:
        return await self._pool.fetchrow(self._q["get_asset"], name) is not None

    async def asset_events(self, name: str, limit: int = 100) -> list[AssetEventRow]:
        """The latest ``limit`` events of asset ``name``, newest first."""
        rows = await self._pool.fetch(self._q["asset_events"], name, limit)
        return [AssetEventRow(**_renamed(r)) for r in rows]

    async def asset_watchers(self) -> list[AssetWatcherRow]:
        """The watchers of the assets some active DAG uses, their kwargs decrypted."""
        rows = await self._pool.fetch(self._q["asset_watchers"])
        return [
            AssetWatcherRow(
                r["asset"], r["name"], r["classpath"], self.keyring.decrypt(r["kwargs"])
            )
            for r in rows
        ]

    async def queued_asset_events(self, dag_id: str | None = None) -> list[tuple[str, str, int]]:
        """The events queued for a DAG (None: every DAG), not consumed by a run yet:
        (dag_id, asset, event id)."""
        rows = await self._pool.fetch(self._q["queued_asset_events"], dag_id)
        return [(r["dag_id"], r["asset"], r["event_id"]) for r in rows]
