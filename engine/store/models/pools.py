"""Pools as engine/store/pools.py returns them."""

from __future__ import annotations

import msgspec

__all__ = [
    "PoolRow",
]


class PoolRow(msgspec.Struct, frozen=True, kw_only=True):
    """A pool and what it holds: ``running`` (running tries, and tries told to stop that have
    not stopped yet) and ``deferred`` in pool slots, ``queued``
    runnable tasks waiting for admission, ``open`` slots left (deferred ones count only with
    ``include_deferred``; negative once the pool is shrunk below what runs in it)."""

    name: str
    slots: int
    include_deferred: bool
    description: str | None
    running: int
    queued: int
    deferred: int
    open: int
