"""The store: the one public class, :class:`Store`, made of one reader class per part of the
engine (engine/store/__init__.py lists them); connecting it is here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import asyncpg

from engine.runtime.retry import with_db_retry
from engine.security.keys import Keyring
from engine.store.assets import AssetQueries
from engine.store.callbacks import CallbackQueries
from engine.store.connection import CONNECT_ATTEMPTS, Listener, create_pool
from engine.store.endpoints import Endpoints
from engine.store.fleetstats import FleetStats
from engine.store.importerrors import ImportErrors
from engine.store.logstore import LogQueries
from engine.store.overrides import OverrideQueries
from engine.store.pools import PoolQueries
from engine.store.rotation import RotationQueries
from engine.store.runs import RunQueries
from engine.store.runselect import RunSelection
from engine.store.schedules import ScheduleQueries
from engine.store.status import StatusQueries
from engine.store.tasks import TaskQueries
from engine.store.triggers import TriggerQueries
from engine.store.variables import VariableQueries
from engine.store.watchers import WatcherQueries
from engine.store.why import WhyQueries
from engine.store.xcom import XComStore

__all__ = ["Store"]


class Store(
    TaskQueries,
    TriggerQueries,
    OverrideQueries,
    RunQueries,
    ScheduleQueries,
    PoolQueries,
    StatusQueries,
    LogQueries,
    WhyQueries,
    RotationQueries,
    VariableQueries,
    ImportErrors,
    Endpoints,
    RunSelection,
    FleetStats,
    XComStore,
    CallbackQueries,
    AssetQueries,
    WatcherQueries,
):
    """A pool of connections and one method per named query (or per transaction of them),
    each defined by the reader class of its part of the engine."""

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        pool_size: int = 8,
        migrate: bool = True,
        on_connect: Callable[[asyncpg.Connection], Any] | None = None,
        keyring: Keyring | None = None,
        warm: bool = False,
    ) -> Store:
        """``on_connect`` also runs for each new pooled connection (benchmarks attach a query
        logger with it). ``keyring``: the encryption keys (none: values stored in plaintext,
        and encrypted ones cannot be read); processes get theirs from ``open_store``.
        ``warm``: the pool's connections are all opened now and kept (``create_pool``)."""
        pool = await create_pool(url, pool_size=pool_size, on_connect=on_connect, warm=warm)
        store = cls(pool, url, keyring)
        if migrate:
            try:
                await with_db_retry("migrate", store.migrate, attempts=CONNECT_ATTEMPTS)
            except BaseException:
                await store.close()
                raise
        return store

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def listener(self, *channels: str) -> Listener:
        """A connection of its own that LISTENs on ``channels`` (connect it first)."""
        return Listener(self.url, channels)
