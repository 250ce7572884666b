"""Where the engine's processes listen, for ``deferral status``: a scheduler's, worker's or
triggerer's metrics server, a webserver's status page. A process records its address once it
listens (:func:`advertised`), keeps the row alive with a heartbeat and removes it when it
stops; a process that died leaves a row whose heartbeat ages, which readers leave out.

The schedulers, workers and triggerers have registration rows of their own (with their
heartbeats); an endpoint row is matched to them by host and pid. Mixed into
:class:`engine.store.store.Store`."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator

import anyio
import msgspec

from engine.runtime.keepalive import KeepAlive
from engine.store.core import StoreCore
from engine.store.models.endpoints import EndpointRow
from engine.version import __version__

__all__ = [
    "ENDPOINT_HEARTBEAT_S",
    "ENDPOINT_STALE_S",
    "EndpointRow",
    "Endpoints",
    "advertised",
]

log = logging.getLogger(__name__)

#: How often a process renews its endpoint's row.
ENDPOINT_HEARTBEAT_S = 30.0
#: A row not renewed for this long is a process that died: readers leave it out.
ENDPOINT_STALE_S = 3 * ENDPOINT_HEARTBEAT_S


class Endpoints(StoreCore):
    """Store methods for the endpoints. Expects the Store's pool and queries."""

    async def register_endpoint(self, kind: str, process: str, url: str) -> int:
        """This process listens on ``url``; returns the row's id."""
        endpoint_id: int = await self._pool.fetchval(
            self._q["register_endpoint"],
            kind,
            process,
            socket.gethostname(),
            os.getpid(),
            __version__,
            url,
        )
        return endpoint_id

    async def heartbeat_endpoint(self, endpoint_id: int) -> bool:
        """Renew the row; False when it is gone (it is then registered again)."""
        return await self._pool.fetchval(self._q["heartbeat_endpoint"], endpoint_id) is not None

    async def unregister_endpoint(self, endpoint_id: int) -> None:
        await self._pool.execute(self._q["unregister_endpoint"], endpoint_id)

    async def endpoints(self, max_age_s: float = ENDPOINT_STALE_S) -> list[EndpointRow]:
        """The endpoints renewed within ``max_age_s`` seconds."""
        rows = await self._pool.fetch(self._q["list_endpoints"], max_age_s)
        return msgspec.convert([dict(r) for r in rows], list[EndpointRow])


@contextlib.asynccontextmanager
async def advertised(store: Endpoints, kind: str, process: str, url: str) -> AsyncIterator[None]:
    """Within the block, ``url`` is recorded as where this ``process`` listens (``kind``:
    metrics or webserver), renewed every :data:`ENDPOINT_HEARTBEAT_S`. Best effort: a database
    that cannot be reached is retried in the background, never a reason to stop."""
    endpoint: list[int] = []

    async def beat() -> None:
        if not endpoint or not await store.heartbeat_endpoint(endpoint[0]):
            endpoint[:] = [await store.register_endpoint(kind, process, url)]

    keep = KeepAlive(
        f"recording the {kind} address {url}",
        beat,
        interval_s=ENDPOINT_HEARTBEAT_S,
        max_backoff_s=ENDPOINT_HEARTBEAT_S,
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(keep.run)
        try:
            yield
        finally:
            keep.stop()
            tg.cancel_scope.cancel()
            if endpoint:
                with anyio.move_on_after(2, shield=True):
                    try:
                        await store.unregister_endpoint(endpoint[0])
                    except Exception as exc:  # it ages out: readers leave it out
                        log.debug("could not remove the %s address: %s", kind, exc)
