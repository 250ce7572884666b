"""The store's XCom methods: what tasks hand to each other.

A task's return value (key ``return_value``) is its task instance's ``result``, written with
its outcome in one statement (``finish_tasks``, or a trigger's ``fire_triggers``); the values
it pushes under other keys are rows of ``deferral_xcom`` written by :meth:`XComStore.push_xcom`,
each belonging to the try that pushed it. Values are stored encrypted, as results are, and
come out of here still encoded (``triggers.base.decode_value`` reads them): decoding is the
reader's business. A mixin of :class:`engine.store.Store`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from engine.security.keys import Keyring, UnreadableValue

if TYPE_CHECKING:
    import asyncpg

__all__ = ["RETURN_KEY", "XComRow", "XComStore"]

log = logging.getLogger("engine.store")

#: The key of a task's return value.
RETURN_KEY = "return_value"


class XComRow(msgspec.Struct, frozen=True):
    """One stored XCom: the task it belongs to, its key and its encoded (decrypted) value."""

    task_id: str
    key: str
    value: bytes
    #: The mapped instance it belongs to (-1: an unmapped task's).
    map_index: int = -1


class XComStore:
    """XCom methods of the store (``self._pool``, ``self._q`` and ``self.keyring`` are the
    store's)."""

    _pool: asyncpg.Pool
    _q: dict[str, str]
    keyring: Keyring

    async def push_xcom(
        self,
        ti_id: int,
        worker_id: int,
        try_number: int,
        values: Sequence[tuple[str, bytes]],
    ) -> bool:
        """Store the encoded ``values`` (key, value) try ``try_number`` pushed, in one
        statement, if worker ``worker_id`` still holds that try; False if it does not
        (nothing is written)."""
        if not values:
            return True
        rows = await self._pool.fetch(
            self._q["xcom_push"],
            ti_id,
            worker_id,
            try_number,
            [k for k, _ in values],
            [self.keyring.encrypt(v) for _, v in values],
        )
        return len(rows) == len(values)

    async def pull_xcom(
        self, dag_id: str, run_id: str, task_ids: Sequence[str] | None, key: str
    ) -> list[XComRow]:
        """The encoded values under ``key`` of ``task_ids`` (None: any task) of one run, from
        each task instance's current try, the latest first (a mapped task's instances after,
        by map index); tasks without one are left out. A value no configured key opens raises
        :class:`UnreadableValue`."""
        rows = await self._pool.fetch(
            self._q["xcom_pull"],
            dag_id,
            run_id,
            None if task_ids is None else list(task_ids),
            key,
        )
        return [
            XComRow(r["task_id"], key, self.keyring.decrypt(r["value"]), r["map_index"])
            for r in rows
        ]

    async def xcom_of_tasks(self, ti_ids: Sequence[int]) -> dict[int, dict[str, bytes]]:
        """The values task instances pushed under keys of their own in their current tries
        (their return values are their results), by task instance and key; a value no key
        opens is left out (logged)."""
        if not ti_ids:
            return {}
        found: dict[int, dict[str, bytes]] = {}
        for r in await self._pool.fetch(self._q["xcom_of_tasks"], list(ti_ids)):
            try:
                value = self.keyring.decrypt(r["value"])
            except UnreadableValue as exc:
                log.warning("task instance %s: XCom %r not shown: %s", r["ti_id"], r["key"], exc)
                continue
            found.setdefault(r["ti_id"], {})[r["key"]] = value
        return found

    async def xcom_of_task(
        self, dag_id: str, run_id: str, task_id: str, map_index: int = -1
    ) -> dict[str, bytes] | None:
        """Every XCom of one task instance's current try (its return value included), by key;
        None when there is no such task instance (``map_index``: which mapped instance).
        Raises :class:`UnreadableValue` for a value no configured key opens."""
        rows = await self._pool.fetch(self._q["xcom_of_task"], dag_id, run_id, task_id, map_index)
        if not rows:
            return None
        return {r["key"]: self.keyring.decrypt(r["value"]) for r in rows if r["key"] is not None}

    async def task_map_indexes(self, dag_id: str, run_id: str, task_id: str) -> list[int]:
        """The map indexes of a task's instances in one run, in order: ``[-1]`` for a task
        not mapped (or not expanded yet); empty when there is no such task instance."""
        rows = await self._pool.fetch(self._q["task_map_indexes"], dag_id, run_id, task_id)
        return [r["map_index"] for r in rows]

    async def rotate_xcom_keys(self, counts: dict[str, int], *, batch_size: int = 500) -> None:
        """Re-encrypt the pushed XCom values with the primary key (see ``rotate_keys``)."""
        await rotate_xcom(self, counts, batch_size=batch_size)


async def rotate_xcom(core: Any, counts: dict[str, int], *, batch_size: int = 500) -> None:
    """Re-encrypt the pushed XCom values with the primary key, in batches, each write
    conditional on the ciphertext read (``rotate_keys`` calls it; ``core``: the store)."""
    pool, queries, keyring = core._pool, core._q, core.keyring
    last: tuple[int, str] = (0, "")
    while True:
        rows = await pool.fetch(queries["rotation_xcom"], *last, batch_size)
        if not rows:
            return
        last = (rows[-1]["ti_id"], rows[-1]["key"])
        ids, keys, olds, news = [], [], [], []
        for r in rows:
            if keyring.is_current(r["value"]):
                counts["current"] += 1
                continue
            try:
                new = keyring.reencrypt(r["value"])
            except UnreadableValue:
                counts["unreadable"] += 1
                continue
            ids.append(r["ti_id"])
            keys.append(r["key"])
            olds.append(r["value"])
            news.append(new)
        if ids:
            done = await pool.fetch(queries["rotate_xcom_values"], ids, keys, olds, news)
            counts["rewritten"] += len(done)
            counts["changed"] += len(ids) - len(done)
