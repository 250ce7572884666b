"""The store's part of the run selectors (engine/client/runsel.py): the runs an exact id, a
logical date, an id prefix or ``latest`` may name, and the newest run ids to suggest from.
Mixed into :class:`engine.store.store.Store`."""

from __future__ import annotations

import datetime as dt

import asyncpg
import msgspec

from engine.store.core import StoreCore
from engine.store.models.runselect import SelectedRun

__all__ = ["RunSelection", "SelectedRun"]


def _runs(rows: list[asyncpg.Record]) -> list[SelectedRun]:
    return msgspec.convert([dict(r) for r in rows], list[SelectedRun])


class RunSelection(StoreCore):
    """Store methods for the run selectors. Expects the Store's pool and queries; ``dag_id``
    None: any DAG's runs."""

    async def runs_named(self, dag_id: str | None, run_id: str) -> list[SelectedRun]:
        return _runs(await self._pool.fetch(self._q["select_runs_exact"], dag_id, run_id))

    async def latest_run(self, dag_id: str | None) -> SelectedRun | None:
        rows = _runs(await self._pool.fetch(self._q["select_runs_latest"], dag_id))
        return rows[0] if rows else None

    async def runs_dated(
        self, dag_id: str | None, start: dt.datetime, end: dt.datetime, limit: int
    ) -> list[SelectedRun]:
        """Runs whose logical date lies in ``[start, end)``, newest first."""
        rows = await self._pool.fetch(self._q["select_runs_dated"], dag_id, start, end, limit)
        return _runs(rows)

    async def runs_prefixed(self, dag_id: str | None, prefix: str, limit: int) -> list[SelectedRun]:
        rows = await self._pool.fetch(self._q["select_runs_prefixed"], dag_id, prefix, limit)
        return _runs(rows)

    async def recent_runs(self, dag_id: str | None, limit: int) -> list[SelectedRun]:
        return _runs(await self._pool.fetch(self._q["recent_run_ids"], dag_id, limit))
