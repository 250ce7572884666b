"""The Fleet page: every scheduler, worker and triggerer, their load and the backlog."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.store import Store
from engine.store.models import FleetTriggerer, SchedulerRow, WorkerRow
from engine.web.render import _age, _ms, _when
from engine.web.views.common import Column, Table, process_name, stale

__all__ = ["blocked_loops", "fleet_page"]

SCHEDULER_COLUMNS: list[Column] = [
    Column("id", lambda r: r.id, numeric=True),
    Column("host [pid]", process_name),
    Column("version", lambda r: r.version or "-"),
    Column("heartbeat", lambda r: _age(r.heartbeat_age_s) + " ago"),
    Column("started", lambda r: _when(r.started_at)),
]

WORKER_COLUMNS: list[Column] = [
    Column("id", lambda r: r.id, numeric=True),
    Column("host [pid]", process_name),
    Column("version", lambda r: r.version or "-"),
    Column("heartbeat", lambda r: _age(r.heartbeat_age_s) + " ago"),
    Column("slots used / capacity", lambda r: f"{r.running} / {r.slots}", numeric=True),
    Column("started", lambda r: _when(r.started_at)),
]


def blocked_loops(r: FleetTriggerer) -> str:
    """How often a triggerer's loop was blocked, and by which trigger class longest."""
    if not r.blocked_loops:
        return "0"
    worst = f" (worst: {r.worst_blocker}, {_ms(r.worst_block_ms)})" if r.worst_blocker else ""
    return f"{r.blocked_loops}{worst}"


TRIGGERER_COLUMNS: list[Column] = [
    Column("id", lambda r: r.id, numeric=True),
    Column("host [pid]", process_name),
    Column("version", lambda r: r.version or "-"),
    Column(
        "heartbeat",
        lambda r: _age(r.heartbeat_age_s) + " ago" + (" (lease expired)" if r.expired else ""),
    ),
    Column("triggers held / capacity", lambda r: f"{r.held} / {r.capacity}", numeric=True),
    Column("loop lag p99", lambda r: _ms(r.loop_lag_p99_ms), numeric=True),
    Column("blocked loops (worst trigger class)", blocked_loops),
    Column("started", lambda r: _when(r.started_at)),
]


async def fleet_page(store: Store) -> dict[str, Any]:
    fleet = await store.fleet()
    schedulers: Sequence[SchedulerRow] = fleet.schedulers
    workers: Sequence[WorkerRow] = fleet.workers
    triggerers: Sequence[FleetTriggerer] = fleet.triggerers
    return {
        "title": "Fleet",
        "backlog": fleet.backlog,
        "slots": (sum(w.running for w in workers), sum(w.slots for w in workers)),
        "held": (sum(t.held for t in triggerers), sum(t.capacity for t in triggerers)),
        "sections": [
            ("Schedulers", Table(SCHEDULER_COLUMNS, schedulers, stale)),
            ("Workers", Table(WORKER_COLUMNS, workers, stale)),
            ("Triggerers", Table(TRIGGERER_COLUMNS, triggerers, stale)),
        ],
    }
