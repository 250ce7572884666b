"""Key rotation (``deferral keys rotate``): every stored value re-encrypted with the primary
key, online. A reader of :class:`engine.store.Store`."""

from __future__ import annotations

from typing import Any

from engine.runtime.crashpoints import crash_point
from engine.security.keys import UnreadableValue
from engine.store.core import StoreCore
from engine.store.xcom import rotate_xcom

__all__ = ["RotationQueries"]


class RotationQueries(StoreCore):
    """The statements of key rotation."""

    async def rotate_keys(self, *, batch_size: int = 500) -> dict[str, int]:
        """Re-encrypt every stored value with the primary key, in batches of short
        transactions, while the engine runs: each write is conditional on the ciphertext that
        was read, so a value a process changed meanwhile is left alone (it was written with
        that process's primary key). Returns counts: ``rewritten``, ``current`` (already
        under the primary key), ``changed`` (skipped: changed meanwhile) and ``unreadable``
        (no configured key opens them; left as they are)."""
        counts = {"rewritten": 0, "current": 0, "changed": 0, "unreadable": 0}
        last = 0
        while True:
            rows = await self._pool.fetch(self._q["rotation_triggers"], last, batch_size)
            if not rows:
                break
            last = rows[-1]["id"]
            ids, olds, news = [], [], []
            for r in rows:
                new = self._rotated(r["kwargs"], counts)
                if new is not None:
                    ids.append(r["id"])
                    olds.append(r["kwargs"])
                    news.append(new)
            if ids:
                done = await self._pool.fetch(self._q["rotate_trigger_kwargs"], ids, olds, news)
                counts["rewritten"] += len(done)
                counts["changed"] += len(ids) - len(done)
                crash_point("keys.rotate.after_batch")
        last = 0
        while True:
            rows = await self._pool.fetch(self._q["rotation_task_instances"], last, batch_size)
            if not rows:
                break
            last = rows[-1]["id"]
            columns: list[list[Any]] = [[] for _ in range(7)]
            for r in rows:
                pairs = []
                for name in ("next_kwargs", "next_event", "result"):
                    old = r[name]
                    new = None if old is None else self._rotated(old, counts)
                    pairs.append((old, new) if new is not None else (None, None))
                if any(new is not None for _, new in pairs):
                    columns[0].append(r["id"])
                    for i, (old, new) in enumerate(pairs):
                        columns[1 + 2 * i].append(old)
                        columns[2 + 2 * i].append(new)
            if columns[0]:
                wanted = sum(v is not None for col in columns[2::2] for v in col)
                done = await self._pool.fetch(self._q["rotate_task_values"], *columns)
                rewritten = sum(r["rewritten"] for r in done)
                counts["rewritten"] += rewritten
                counts["changed"] += wanted - rewritten
                crash_point("keys.rotate.after_batch")
        await rotate_xcom(self, counts, batch_size=batch_size)
        return counts

    def _rotated(self, value: bytes, counts: dict[str, int]) -> bytes | None:
        """``value`` under the primary key, or None when it needs no rewrite (counted)."""
        if self.keyring.is_current(value):
            counts["current"] += 1
            return None
        try:
            return self.keyring.reencrypt(value)
        except UnreadableValue:
            counts["unreadable"] += 1
            return None
