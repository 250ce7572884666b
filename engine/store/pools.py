"""Pools: what they hold, and creating, resizing and deleting them (the CLI's ``pools``
commands). A reader of :class:`engine.store.Store`; the claim's admission reads them in SQL."""

from __future__ import annotations

from engine.store.core import StoreCore, one, structs
from engine.store.models import PoolRow
from operators.defaults import DEFAULT_POOL

__all__ = ["PoolInUse", "PoolNotFound", "PoolQueries"]


class PoolNotFound(LookupError):
    """No pool of that name."""


class PoolInUse(ValueError):
    """A pool that unfinished task instances name cannot be deleted."""


class PoolQueries(StoreCore):
    """The statements of pools."""

    async def list_pools(self, name: str | None = None) -> list[PoolRow]:
        """Every pool (or the one named) with what it holds."""
        return structs(await self._pool.fetch(self._q["list_pools"], name), PoolRow)

    async def set_pool(
        self,
        name: str,
        slots: int,
        *,
        include_deferred: bool | None = None,
        description: str | None = None,
    ) -> bool:
        """Create or change a pool (``None``: keep that field; a new pool: no deferred tasks
        counted, no description); wakes the workers. Returns whether it was created."""
        if not name or not name.strip():
            raise ValueError("a pool needs a non-empty name")
        if slots < 0:
            raise ValueError(f"pool {name}: slots must be >= 0, got {slots}")
        row = await one(self._pool, self._q["set_pool"], name, slots, include_deferred, description)
        return bool(row["created"])

    async def ensure_pool(self, name: str, slots: int) -> None:
        await self._pool.execute(self._q["ensure_pool"], name, slots)

    async def delete_pool(self, name: str) -> None:
        """Delete a pool; raises PoolNotFound, or PoolInUse while unfinished task instances or
        tasks of active DAGs name it (the default pool is never deleted)."""
        if name == DEFAULT_POOL:
            raise PoolInUse(
                f"pool {name} is the pool of every task that names none: it cannot be "
                "deleted (resize it with deferral pools set)"
            )
        row = await one(self._pool, self._q["delete_pool"], name)
        if not row["found"]:
            raise PoolNotFound(f"no pool named {name!r} (deferral pools list shows them)")
        if row["deleted"]:
            return
        if row["in_use"]:
            raise PoolInUse(
                f"pool {name} is used by {row['in_use']} task instance(s) not finished yet: "
                "delete it once they end (or clear them), or resize it instead"
            )
        dags = list(row["dag_ids"])
        shown = ", ".join(dags[:10]) + (f" and {len(dags) - 10} more" if len(dags) > 10 else "")
        raise PoolInUse(
            f"pool {name} is named by tasks of active DAG(s) {shown}: their next runs would fail "
            "for want of it; change those tasks' pool (or remove the DAG files) first, or resize "
            "the pool instead"
        )
