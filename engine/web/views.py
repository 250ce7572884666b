"""One function per page: what it reads from the store, as a template context.

Tables are lists of :class:`Column`: a title and how to get a cell from a row. A new field is
one more ``Column`` in a list below (and its column in the store's query): the templates
render whatever columns they are given. A cell is text, a :class:`Link`, or :class:`Squares`
(a run's or a task's state as a colored square).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from engine.security.keys import UnreadableValue
from engine.store import Store
from engine.store.models import (
    DagOverview,
    FleetTriggerer,
    GridCell,
    OldestWait,
    SchedulerRow,
    TaskTry,
    TriggerClassCount,
    TriggerListing,
    WorkerRow,
)
from engine.web import hooks
from engine.web.graph import MAX_DRAWN_TASKS, graph
from engine.web.paging import Pager, shortened
from engine.web.render import _age, _ms, _when, decoded, masked, pretty

__all__ = [
    "Column",
    "Link",
    "NotFound",
    "Squares",
    "dag_page",
    "dags_page",
    "fleet_page",
    "run_page",
    "task_page",
    "triggers_page",
]

#: A heartbeat older than this shows the process as stale.
STALE_AFTER_S = 30.0


class NotFound(LookupError):
    """The page names something that does not exist (404)."""


@dataclass(frozen=True)
class Link:
    text: str
    href: str
    kind: str = "link"


@dataclass(frozen=True)
class Square:
    title: str
    state: str
    href: str


@dataclass(frozen=True)
class Squares:
    items: list[Square]
    kind: str = "squares"


@dataclass(frozen=True)
class Column:
    title: str
    cell: Callable[[Any], Any]
    #: Right-aligned (numbers).
    numeric: bool = False


@dataclass
class Table:
    columns: Sequence[Column]
    rows: Sequence[Any]
    #: CSS class of each row (e.g. stale), from the row.
    row_class: Callable[[Any], str] = field(default=lambda _row: "")

    def cells(self, row: Any) -> list[tuple[Column, Any]]:
        return [(c, c.cell(row)) for c in self.columns]


def url(path: str, **params: Any) -> str:
    """A page's address with its query parameters (None ones left out)."""
    query = urlencode({k: v for k, v in params.items() if v is not None})
    return f"{path}?{query}" if query else path


def dag_url(dag_id: str) -> str:
    return url("/dag", dag_id=dag_id)


def run_url(dag_id: str, run_id: str) -> str:
    return url("/run", dag_id=dag_id, run_id=run_id)


def task_url(dag_id: str, run_id: str, task_id: str) -> str:
    return url("/task", dag_id=dag_id, run_id=run_id, task_id=task_id)


def _stale(row: Any) -> str:
    return "stale" if row.heartbeat_age_s > STALE_AFTER_S else ""


def _process(row: Any) -> str:
    return f"{row.hostname} [{row.pid}]"


# -- Fleet ----------------------------------------------------------------------------------

SCHEDULER_COLUMNS: list[Column] = [
    Column("id", lambda r: r.id, numeric=True),
    Column("host [pid]", _process),
    Column("version", lambda r: r.version or "-"),
    Column("heartbeat", lambda r: _age(r.heartbeat_age_s) + " ago"),
    Column("started", lambda r: _when(r.started_at)),
]

WORKER_COLUMNS: list[Column] = [
    Column("id", lambda r: r.id, numeric=True),
    Column("host [pid]", _process),
    Column("version", lambda r: r.version or "-"),
    Column("heartbeat", lambda r: _age(r.heartbeat_age_s) + " ago"),
    Column("slots used / capacity", lambda r: f"{r.running} / {r.slots}", numeric=True),
    Column("started", lambda r: _when(r.started_at)),
]


def _blocked(r: FleetTriggerer) -> str:
    if not r.blocked_loops:
        return "0"
    worst = f" (worst: {r.worst_blocker}, {_ms(r.worst_block_ms)})" if r.worst_blocker else ""
    return f"{r.blocked_loops}{worst}"


TRIGGERER_COLUMNS: list[Column] = [
    Column("id", lambda r: r.id, numeric=True),
    Column("host [pid]", _process),
    Column("version", lambda r: r.version or "-"),
    Column(
        "heartbeat",
        lambda r: _age(r.heartbeat_age_s) + " ago" + (" (lease expired)" if r.expired else ""),
    ),
    Column("triggers held / capacity", lambda r: f"{r.held} / {r.capacity}", numeric=True),
    Column("loop lag p99", lambda r: _ms(r.loop_lag_p99_ms), numeric=True),
    Column("blocked loops (worst trigger class)", _blocked),
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
            ("Schedulers", Table(SCHEDULER_COLUMNS, schedulers, _stale)),
            ("Workers", Table(WORKER_COLUMNS, workers, _stale)),
            ("Triggerers", Table(TRIGGERER_COLUMNS, triggerers, _stale)),
        ],
    }


# -- DAGs -------------------------------------------------------------------------------------


def _last_runs(d: DagOverview) -> Squares:
    return Squares(
        [
            Square(f"{r.run_id}: {r.state}", r.state, run_url(d.dag_id, r.run_id))
            for r in d.last_runs
        ]
    )


#: The DAGs list. (Schedule, paused and next run join here once the DAGs carry them.)
def _next_run(d: DagOverview) -> str:
    if not d.is_active:
        return "none: no longer in the DAGs folder"
    return "" if d.is_paused else _when(d.next_dagrun)


DAG_COLUMNS: list[Column] = [
    Column("DAG", lambda d: Link(d.dag_id, dag_url(d.dag_id))),
    Column("schedule", lambda d: d.schedule or "None"),
    Column("paused", lambda d: "yes" if d.is_paused else "no"),
    Column("next run", _next_run),
    Column("tasks", lambda d: d.tasks, numeric=True),
    Column("last runs (newest first)", _last_runs),
    Column("description", lambda d: d.description or ""),
    Column("file", lambda d: d.fileloc),
]


async def dags_page(store: Store) -> dict[str, Any]:
    dags = await store.dags_overview()
    return {"title": "DAGs", "dags": Table(DAG_COLUMNS, dags)}


RUN_COLUMNS: list[Column] = [
    Column("run", lambda r: Link(r.run_id, run_url(r.dag_id, r.run_id))),
    Column("state", lambda r: Squares([Square(r.state, r.state, run_url(r.dag_id, r.run_id))])),
    Column("logical date", lambda r: _when(r.logical_date)),
    Column("tasks", lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r.task_counts.items()))),
    Column("created", lambda r: _when(r.created_at)),
    Column("ended", lambda r: _when(r.ended_at)),
]


#: The DAG's tasks, listed (paged) when its graph is too large to draw.
TASK_COLUMNS: list[Column] = [
    Column("task", lambda t: str(t["task_id"])),
    Column("upstream", lambda t: shortened([str(u) for u in t.get("upstream", [])])),
    Column("trigger rule", lambda t: t.get("trigger_rule", "")),
    Column("pool", lambda t: t.get("pool", "")),
    Column("retries", lambda t: t.get("retries", ""), numeric=True),
]


async def dag_page(store: Store, dag_id: str, page: int | None = None) -> dict[str, Any]:
    dag = await store.get_dag(dag_id)
    if dag is None:
        raise NotFound(f"no DAG {dag_id!r}")
    runs = await store.dag_runs(dag_id)
    tasks = None
    pager = None
    if len(dag.tasks) > MAX_DRAWN_TASKS:
        pager = Pager.of(page, len(dag.tasks), lambda n: url("/dag", dag_id=dag_id, page=n))
        tasks = Table(TASK_COLUMNS, dag.tasks[pager.offset : pager.offset + pager.size])
    return {
        "title": f"DAG {dag_id}",
        "dag": dag,
        "runs": Table(RUN_COLUMNS, runs),
        "graph": graph(dag.tasks),
        "tasks": tasks,
        "pager": pager,
    }


# -- Run ----------------------------------------------------------------------------------------


def _duration(c: GridCell) -> str:
    return "-" if c.duration_s is None else _age(c.duration_s)


GRID_COLUMNS: list[Column] = [
    Column("task", lambda c: c.task_id),
    Column("state", lambda c: Squares([Square(c.state, c.state, "")])),
    Column("try", lambda c: c.try_number, numeric=True),
    Column("started", lambda c: _when(c.started_at)),
    Column("ended", lambda c: _when(c.ended_at)),
    Column("duration", _duration, numeric=True),
    Column("upstream", lambda c: shortened(c.upstream)),
]


async def run_page(
    store: Store, dag_id: str, run_id: str, *, state: str | None = None, page: int | None = None
) -> dict[str, Any]:
    """The run, its tasks a page at a time (those in ``state`` only, when given) and its graph
    (summarized for a large DAG)."""
    run = await store.get_dag_run(dag_id, run_id)
    if run is None:
        raise NotFound(f"no run {run_id!r} of DAG {dag_id!r}")
    counts = await store.run_task_counts(run.id)
    shown = sum(counts.values()) if state is None else counts.get(state, 0)
    pager = Pager.of(
        page, shown, lambda n: url("/run", dag_id=dag_id, run_id=run_id, state=state, page=n)
    )
    cells = await store.run_task_grid(run.id, state=state, limit=pager.size, offset=pager.offset)
    dag = await store.get_dag(dag_id)
    every = None
    if dag is None or sum(counts.values()) <= MAX_DRAWN_TASKS:
        every = await store.run_task_grid(run.id)
    columns = [
        Column("task", lambda c: Link(c.task_id, task_url(dag_id, run_id, c.task_id))),
        *GRID_COLUMNS[1:],
    ]
    return {
        "title": f"Run {run_id}",
        "run": run,
        "conf": pretty(masked(run.conf)),
        "grid": Table(columns, cells),
        "pager": pager,
        "state": state,
        "states": [
            (s, n, url("/run", dag_id=dag_id, run_id=run_id, state=s))
            for s, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        ],
        "all_href": run_url(dag_id, run_id),
        "graph": graph(
            dag.tasks
            if dag
            else [{"task_id": c.task_id, "upstream": c.upstream} for c in every or []],
            {c.task_id: c.state for c in every or []},
            lambda task_id: task_url(dag_id, run_id, task_id),
            counts=counts,
        ),
    }


# -- Task try -------------------------------------------------------------------------------------


async def task_page(store: Store, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
    ti = await store.task_try(dag_id, run_id, task_id)
    if ti is None:
        raise NotFound(f"no task {task_id!r} in run {run_id!r} of DAG {dag_id!r}")
    fields: list[tuple[str, Any]] = [
        ("state", Squares([Square(ti.state, ti.state, "")])),
        ("try", ti.try_number),
        ("retries", ti.retries),
        ("trigger rule", ti.trigger_rule),
        ("upstream", shortened(ti.upstream) or "-"),
        ("priority", ti.priority),
        ("pool", ti.pool),
        ("runnable after", _when(ti.run_after)),
        ("first try started", _when(ti.first_try_at)),
        ("this try started", _when(ti.try_started_at)),
        ("started", _when(ti.started_at)),
        ("ended", _when(ti.ended_at)),
        ("worker", ti.worker_id if ti.worker_id is not None else "-"),
        (
            "execution timeout",
            "-" if ti.execution_timeout_s is None else f"{ti.execution_timeout_s:g} s",
        ),
    ]
    deferral: list[tuple[str, Any]] | None = None
    if ti.state == "deferred":
        waiting_since = ti.trigger_created_at
        triggerer = (
            f"{ti.triggerer_hostname} [{ti.triggerer_pid}] (triggerer {ti.triggerer_id})"
            if ti.triggerer_id is not None
            else "none yet (waiting to be claimed)"
        )
        deferral = [
            ("trigger id", ti.trigger_id),
            ("classpath", ti.trigger_classpath or "-"),
            ("kwargs", pretty(masked(decoded(ti.trigger_kwargs)))),
            ("triggerer", triggerer),
            (
                "waiting since",
                f"{_when(waiting_since)} ({_age((ti.db_now - waiting_since).total_seconds())})"
                if waiting_since
                else "-",
            ),
            ("deadline", _deadline(ti.trigger_timeout_at, ti.deadline_kind, ti.db_now)),
            ("resumes at", ti.next_method or "-"),
        ]
    why = await hooks.why_not_running(store, ti)
    xcoms = await _xcoms(store, dag_id, run_id, task_id)
    log_lines = await hooks.task_log_lines(store, ti)
    trigger_lines = (
        await hooks.trigger_log_lines(store, ti.trigger_id) if ti.trigger_id is not None else None
    )
    return {
        "title": f"Task {task_id}",
        "ti": ti,
        "run_href": run_url(dag_id, run_id),
        "dag_href": dag_url(dag_id),
        "fields": fields,
        "rendered": _rendered(ti),
        "result": None if ti.result is None else pretty(masked(decoded(ti.result))),
        "xcoms": xcoms,
        "deferral": deferral,
        "why": why,
        "log_lines": log_lines,
        "trigger_lines": trigger_lines,
    }


async def _xcoms(store: Store, dag_id: str, run_id: str, task_id: str) -> list[tuple[str, str]]:
    """The XComs of the task's current try (its return value among them), by key, as
    indented JSON with secrets masked; a value no configured key opens says so."""
    try:
        found = await store.xcom_of_task(dag_id, run_id, task_id)
    except UnreadableValue as exc:
        return [("(unreadable)", str(exc))]
    return [(k, pretty(masked({k: decoded(v)})[k])) for k, v in sorted((found or {}).items())]


def _rendered(ti: TaskTry) -> list[tuple[str, str]]:
    """What the task's templated fields rendered to at the start of its latest try, secrets
    masked: text as it is (a command reads as one), other values as JSON."""
    shown: dict[str, Any] = masked(ti.rendered_fields or {})
    return [(k, v if isinstance(v, str) else pretty(v)) for k, v in shown.items()]


def _deadline(at: dt.datetime | None, kind: str | None, now: dt.datetime) -> str:
    if at is None:
        return "none"
    left = (at - now).total_seconds()
    when = f"in {_age(left)}" if left >= 0 else f"{_age(-left)} ago"
    return f"{_when(at)} ({when}{', ' + kind if kind else ''})"


# -- Triggers -------------------------------------------------------------------------------------


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

CLASS_COLUMNS: list[Column] = [
    Column("classpath", lambda c: Link(c.classpath, url("/triggers", classpath=c.classpath))),
    Column("triggers", lambda c: c.triggers, numeric=True),
    Column("held", lambda c: c.held, numeric=True),
    Column("waiting tasks", lambda c: c.waiting, numeric=True),
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


@dataclass(frozen=True)
class TriggerFilter:
    classpath: str | None = None
    triggerer: int | None = None
    min_age_s: float | None = None


async def triggers_page(store: Store, flt: TriggerFilter) -> dict[str, Any]:
    triggers = await store.triggers_page(
        classpath=flt.classpath, triggerer_id=flt.triggerer, min_age_s=flt.min_age_s
    )
    counts: Sequence[TriggerClassCount] = await store.trigger_class_counts()
    oldest = await store.oldest_waits()
    return {
        "title": "Triggers",
        "filter": flt,
        "triggers": Table(TRIGGER_COLUMNS, triggers),
        "counts": Table(CLASS_COLUMNS, counts),
        "oldest": Table(OLDEST_COLUMNS, oldest),
    }
