"""The store's callback requests (migration 0022): what a worker claims to run a callback.

Requests are written by triggers in the transaction of the outcome they follow (a task
instance's, a run's end, a deadline alert's timer firing), never by a method here. A worker
claims them with a lease (:meth:`CallbackQueries.claim_callbacks`), runs them and deletes them
(:meth:`CallbackQueries.finish_callback`); a worker that dies holding one loses it to another
once its row is reaped or its lease passes. A mixin of :class:`engine.store.Store`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.store.core import structs
from engine.store.models.callbacks import CallbackRequest, ClaimedCallback

if TYPE_CHECKING:
    import asyncpg

__all__ = ["CallbackQueries"]


class CallbackQueries:
    """Callback request methods of the store (``self._pool`` and ``self._q`` are the store's)."""

    _pool: asyncpg.Pool
    _q: dict[str, str]

    async def claim_callbacks(
        self, worker_id: int, queues: Sequence[str], limit: int, *, lease_s: float
    ) -> list[ClaimedCallback]:
        """Claim up to ``limit`` callback requests of ``queues`` (or of no queue: a run's) for
        ``worker_id``, each held for ``lease_s`` seconds."""
        rows = await self._pool.fetch(
            self._q["claim_callbacks"], worker_id, list(queues), limit, lease_s
        )
        return structs(rows, ClaimedCallback)

    async def finish_callback(self, request_id: int, worker_id: int) -> bool:
        """The request ran (or was given up): delete it, if ``worker_id`` still holds it."""
        rows = await self._pool.fetch(self._q["finish_callback"], request_id, worker_id)
        return bool(rows)

    async def list_callback_requests(self) -> list[CallbackRequest]:
        """The requests not run yet, oldest first."""
        return structs(await self._pool.fetch(self._q["list_callback_requests"]), CallbackRequest)
