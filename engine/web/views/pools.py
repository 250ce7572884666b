"""The Pools page (every pool and what it holds, each count a link to those tasks) and a
pool's tasks: those running in it, deferred in it, or due and waiting for its admission."""

from __future__ import annotations

from functools import partial
from typing import Any

from engine.store import Store
from engine.store.models import PoolTask
from engine.web import hooks
from engine.web.paging import Pager
from engine.web.render import _when
from engine.web.views.common import Column, Link, NotFound, Table, state_square, task_url, url

__all__ = ["POOL_GROUPS", "pool_page", "pools_page"]

#: What a pool's counts are made of: (task states, due ones only), as ``pools list`` counts
#: them: running (and queued) tries hold slots, deferred ones may, queued ones wait for one.
POOL_GROUPS: dict[str, tuple[tuple[str, ...], bool]] = {
    "running": (("running", "queued"), False),
    "deferred": (("deferred",), False),
    "queued": (("scheduled", "up_for_retry", "up_for_reschedule"), True),
}


def pool_url(name: str, group: str) -> str:
    return url("/pool", name=name, tasks=group)


def _pool_cell(pool: dict[str, Any], key: str) -> Any:
    value = pool[key]
    if key in POOL_GROUPS:
        return Link(str(value), pool_url(str(pool["name"]), key))
    if key == "name":
        return Link(str(value), pool_url(str(value), "running"))
    return value


async def pools_page(store: Store) -> dict[str, Any]:
    rows = await hooks.pools(store)
    if rows is None:
        raise NotFound("this build has no pools")
    columns = [
        Column(key, partial(_pool_cell, key=key), numeric=isinstance(value, int))
        for key, value in (rows[0].items() if rows else ())
    ]
    return {"title": "Pools", "pools": Table(columns, rows)}


def _since(t: PoolTask) -> str:
    return _when(t.started_at if t.state in ("running", "queued") else t.run_after)


POOL_TASK_COLUMNS: list[Column] = [
    Column(
        "task",
        lambda t: Link(
            f"{t.dag_id} / {t.run_id} / {t.task_id}", task_url(t.dag_id, t.run_id, t.task_id)
        ),
    ),
    Column("state", lambda t: state_square(t.state)),
    Column("try", lambda t: t.try_number, numeric=True),
    Column("pool slots", lambda t: t.pool_slots, numeric=True),
    Column("priority", lambda t: t.priority, numeric=True),
    Column("since", _since),
    Column(
        "worker / trigger",
        lambda t: (
            f"worker {t.worker_id}"
            if t.worker_id is not None
            else (f"trigger {t.trigger_id}" if t.trigger_id is not None else "-")
        ),
    ),
]


async def pool_page(
    store: Store, name: str, group: str = "running", page: int | None = None
) -> dict[str, Any]:
    """Pool ``name``'s tasks of ``group`` (running, deferred, queued), a page at a time."""
    pools = await store.list_pools(name)
    if not pools:
        raise NotFound(f"no pool {name!r}")
    states, due_only = POOL_GROUPS[group]
    total = await store.count_pool_tasks(name, states, due_only=due_only)
    pager = Pager.of(page, total, lambda n: url("/pool", name=name, tasks=group, page=n))
    tasks = await store.pool_tasks(
        name, states, due_only=due_only, limit=pager.size, offset=pager.offset
    )
    return {
        "title": f"Pool {name}",
        "pool": pools[0],
        "group": group,
        "groups": [(g, pool_url(name, g)) for g in POOL_GROUPS],
        "tasks": Table(POOL_TASK_COLUMNS, tasks),
        "pager": pager,
    }
