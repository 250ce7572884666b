"""The Triggers page: the triggers by class and by triggerer (how many, the tasks waiting on
them, the oldest wait), the triggerers' blocked-loop reports, the oldest waits, and the
triggers themselves, filtered by class, owner and age."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.store import Store
from engine.store.models import FleetTriggerer, OldestWait, TriggerGroup, TriggerListing
from engine.web.render import _age, _ms, _when
from engine.web.views.common import Column, Link, Table, task_url, url
from engine.web.views.fleet import blocked_loops

__all__ = ["TriggerFilter", "triggers_page"]


@dataclass(frozen=True)
class TriggerFilter:
    classpath: str | None = None
    triggerer: int | None = None
    min_age_s: float | None = None


@dataclass
class Totals:
    """Triggers summed over the groups of a class or a triggerer."""

    key: Any
    triggers: int = 0
    held: int = 0
    waiting: int = 0
    oldest_age_s: float | None = None
    classes: set[str] = field(default_factory=set)
    #: The triggerer's row (None: unowned, or a triggerer no longer registered).
    triggerer: FleetTriggerer | None = None
    #: Triggerers whose loop this class blocked longest: "triggerer 3 (450.0 ms)".
    blocked: list[str] = field(default_factory=list)

    def add(self, g: TriggerGroup) -> None:
        self.triggers += g.triggers
        self.held += g.triggers if g.triggerer_id is not None else 0
        self.waiting += g.waiting
        self.oldest_age_s = max(self.oldest_age_s or 0.0, g.oldest_age_s)
        self.classes.add(g.classpath)


def _by_class(groups: Sequence[TriggerGroup], health: Sequence[FleetTriggerer]) -> list[Totals]:
    totals: dict[str, Totals] = {}
    for g in groups:
        totals.setdefault(g.classpath, Totals(g.classpath)).add(g)
    for t in health:
        if t.worst_blocker:
            row = totals.setdefault(t.worst_blocker, Totals(t.worst_blocker))
            row.blocked.append(f"triggerer {t.id} ({_ms(t.worst_block_ms)})")
    return sorted(totals.values(), key=lambda t: (-t.triggers, str(t.key)))


def _by_triggerer(groups: Sequence[TriggerGroup], health: Sequence[FleetTriggerer]) -> list[Totals]:
    totals: dict[int | None, Totals] = {t.id: Totals(t.id, triggerer=t) for t in health}
    for g in groups:
        totals.setdefault(g.triggerer_id, Totals(g.triggerer_id)).add(g)
    return sorted(totals.values(), key=lambda t: (t.key is None, t.key or 0))


def _owner_name(t: Totals) -> Any:
    if t.key is None:
        return Link("unowned (waiting for a triggerer)", url("/triggers", triggerer=0))
    r = t.triggerer
    text = f"{t.key} ({r.hostname} [{r.pid}])" if r else f"{t.key} (no longer registered)"
    return Link(text, url("/triggers", triggerer=t.key))


def _oldest(t: Totals) -> str:
    return "-" if t.oldest_age_s is None else _age(t.oldest_age_s)


CLASS_COLUMNS: list[Column] = [
    Column("classpath", lambda c: Link(c.key, url("/triggers", classpath=c.key))),
    Column("triggers", lambda c: c.triggers, numeric=True),
    Column("held", lambda c: c.held, numeric=True),
    Column("waiting tasks", lambda c: c.waiting, numeric=True),
    Column("oldest wait", _oldest, numeric=True),
    Column("blocked a loop longest on", lambda c: ", ".join(c.blocked) or "-"),
]

TRIGGERER_COLUMNS: list[Column] = [
    Column("triggerer", _owner_name),
    Column(
        "triggers / capacity",
        lambda t: f"{t.triggers} / {t.triggerer.capacity}" if t.triggerer else t.triggers,
        numeric=True,
    ),
    Column("classes", lambda t: len(t.classes), numeric=True),
    Column("waiting tasks", lambda t: t.waiting, numeric=True),
    Column("oldest wait", _oldest, numeric=True),
    Column("loop lag p99", lambda t: _ms(t.triggerer.loop_lag_p99_ms) if t.triggerer else "-"),
    Column(
        "blocked loops (worst trigger class)",
        lambda t: blocked_loops(t.triggerer) if t.triggerer else "-",
    ),
]

BLOCK_COLUMNS: list[Column] = [
    Column(
        "triggerer",
        lambda t: Link(f"{t.id} ({t.hostname} [{t.pid}])", url("/triggers", triggerer=t.id)),
    ),
    Column("blocked loops", lambda t: t.blocked_loops, numeric=True),
    Column("longest block's trigger class", lambda t: t.worst_blocker or "-"),
    Column("longest block", lambda t: _ms(t.worst_block_ms), numeric=True),
    Column("loop lag p99", lambda t: _ms(t.loop_lag_p99_ms), numeric=True),
]


def _owner(r: TriggerListing | OldestWait) -> str:
    if r.triggerer_id is None:
        return "unowned"
    host = getattr(r, "triggerer_hostname", None)
    pid = getattr(r, "triggerer_pid", None)
    return f"{r.triggerer_id}" + (f" ({host} [{pid}])" if host else "")


TRIGGER_COLUMNS: list[Column] = [
    Column("id", lambda r: r.id, numeric=True),
    Column("classpath", lambda r: Link(r.classpath, url("/triggers", classpath=r.classpath))),
    Column("triggerer", _owner),
    Column("waiting tasks", lambda r: r.waiting, numeric=True),
    Column("age", lambda r: _age(r.age_s), numeric=True),
    Column("deadline", lambda r: _when(r.timeout_at)),
]

OLDEST_COLUMNS: list[Column] = [
    Column(
        "task",
        lambda w: Link(
            f"{w.dag_id} / {w.run_id} / {w.task_id}", task_url(w.dag_id, w.run_id, w.task_id)
        ),
    ),
    Column("trigger", lambda w: w.trigger_id, numeric=True),
    Column("classpath", lambda w: w.classpath),
    Column("triggerer", _owner),
    Column("waiting", lambda w: _age(w.age_s), numeric=True),
    Column("deadline", lambda w: _when(w.trigger_timeout_at)),
]


async def triggers_page(store: Store, flt: TriggerFilter) -> dict[str, Any]:
    triggers = await store.triggers_page(
        classpath=flt.classpath, triggerer_id=flt.triggerer, min_age_s=flt.min_age_s
    )
    groups = await store.trigger_groups()
    health = await store.triggerer_health()
    oldest = await store.oldest_waits()
    return {
        "title": "Triggers",
        "filter": flt,
        "triggers": Table(TRIGGER_COLUMNS, triggers),
        "counts": Table(CLASS_COLUMNS, _by_class(groups, health)),
        "owners": Table(TRIGGERER_COLUMNS, _by_triggerer(groups, health)),
        "blocks": Table(BLOCK_COLUMNS, [t for t in health if t.blocked_loops]),
        "oldest": Table(OLDEST_COLUMNS, oldest),
    }
