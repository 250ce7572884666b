"""A task instance's page: its tries (a selector, the latest by default) and the try shown:
state, times, duration, what its templated fields rendered to, its result and error, its log;
for the latest try also what it waits on (its trigger, or why it is not running)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from engine.store import Store, TaskTry
from engine.store.models import TryRecord
from engine.web import hooks
from engine.web.paging import shortened
from engine.web.render import _age, _when, decoded, masked, pretty
from engine.web.views.common import NotFound, dag_url, run_url, state_square, task_url
from engine.web.views.tries import duration_s, latest_tries, spans

__all__ = ["TrySelector", "task_page"]


class TrySelector:
    """The tries of a task instance as links, the one shown marked."""

    def __init__(self, ti: TaskTry, tries: list[TryRecord], shown: int) -> None:
        self.shown = shown
        self.items = [
            (t.try_number, t.state, task_url(ti.dag_id, ti.run_id, ti.name, t.try_number))
            for t in tries
        ]


def _rendered(fields: dict[str, Any] | None) -> list[tuple[str, str]]:
    """What the templated fields rendered to at the start of the try, secrets masked: text as
    it is (a command reads as one), other values as JSON."""
    shown: dict[str, Any] = masked(fields or {})
    return [(k, v if isinstance(v, str) else pretty(v)) for k, v in shown.items()]


def _deadline(at: dt.datetime | None, kind: str | None, now: dt.datetime) -> str:
    if at is None:
        return "none"
    left = (at - now).total_seconds()
    when = f"in {_age(left)}" if left >= 0 else f"{_age(-left)} ago"
    return f"{_when(at)} ({when}{', ' + kind if kind else ''})"


def _spans(record: TryRecord | None) -> str:
    """The try's spans in words: ``queued 2.0 s, running 1.5 s, deferred 3 min, ...``."""
    if record is None:
        return "-"
    found = spans(record)
    return ", ".join(f"{s.kind} {_age((s.end - s.start).total_seconds())}" for s in found) or "-"


def _latest_fields(ti: TaskTry, record: TryRecord | None) -> list[tuple[str, Any]]:
    return [
        ("state", state_square(ti.state)),
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
        ("duration", _age(duration_s(record)) if record else "-"),
        ("spans", _spans(record)),
        ("worker", ti.worker_id if ti.worker_id is not None else "-"),
        (
            "execution timeout",
            "-" if ti.execution_timeout_s is None else f"{ti.execution_timeout_s:g} s",
        ),
    ]


def _earlier_fields(record: TryRecord) -> list[tuple[str, Any]]:
    return [
        ("state", state_square(record.state)),
        ("try", record.try_number),
        ("due since", _when(record.queued_at)),
        ("started", _when(record.started_at)),
        ("last deferred", _when(record.deferred_at)),
        ("trigger fired", _when(record.fired_at)),
        ("ended", _when(record.ended_at)),
        ("duration", _age(duration_s(record))),
        ("spans", _spans(record)),
    ]


def _deferral(ti: TaskTry) -> list[tuple[str, Any]]:
    waiting_since = ti.trigger_created_at
    triggerer = (
        f"{ti.triggerer_hostname} [{ti.triggerer_pid}] (triggerer {ti.triggerer_id})"
        if ti.triggerer_id is not None
        else "none yet (waiting to be claimed)"
    )
    return [
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


async def _mapped_address(store: Store, dag_id: str, run_id: str, name: str) -> None:
    """NotFound saying which instances there are, for an address that names none of a
    mapped task's (TASK alone, TASK[7] out of range, TASK[x])."""
    from engine.client.mapaddr import BadAddress, check_instance, parse_task

    try:
        task_id, index = parse_task(name)
        await check_instance(store, dag_id, run_id, task_id, index)
    except BadAddress as exc:
        raise NotFound(str(exc)) from None


async def task_page(
    store: Store, dag_id: str, run_id: str, task_id: str, try_number: int | None = None
) -> dict[str, Any]:
    """The task instance's page, showing try ``try_number`` (None: the latest)."""
    ti = await store.task_try(dag_id, run_id, task_id)
    if ti is None:
        await _mapped_address(store, dag_id, run_id, task_id)
        raise NotFound(f"no task {task_id!r} in run {run_id!r} of DAG {dag_id!r}")
    tries = latest_tries(await store.task_tries(dag_id, run_id, task_id))
    by_number = {t.try_number: t for t in tries}
    latest = try_number is None or try_number == ti.try_number
    if not latest and try_number not in by_number:
        known = f"tries 1 to {ti.try_number}" if ti.try_number else "no try yet"
        raise NotFound(f"task {task_id!r} of run {run_id!r} has no try {try_number} ({known})")
    shown = ti.try_number if latest else int(try_number or 0)
    record = by_number.get(shown)
    context: dict[str, Any] = {
        "title": f"Task {task_id}",
        "ti": ti,
        "run_href": run_url(dag_id, run_id),
        "dag_href": dag_url(dag_id),
        "latest_href": task_url(dag_id, run_id, task_id),
        "tries": TrySelector(ti, tries, shown),
        "latest": latest,
        "shown_try": shown,
        "xcoms": await hooks.try_xcoms(store, ti, shown),
    }
    if latest:
        trigger_id = ti.trigger_id if ti.state == "deferred" else None
        return context | {
            "fields": _latest_fields(ti, record),
            "rendered": _rendered(ti.rendered_fields),
            "result": None if ti.result is None else pretty(masked(decoded(ti.result))),
            "error": ti.error,
            "deferral": _deferral(ti) if ti.state == "deferred" else None,
            "why": await hooks.why_not_running(store, ti),
            "log_lines": await hooks.task_log_lines(store, ti),
            "trigger_lines": (
                await hooks.trigger_log_lines(store, trigger_id) if trigger_id else None
            ),
            "waited_triggers": await hooks.try_trigger_logs(
                store, ti, ti.try_number, besides=trigger_id
            ),
        }
    assert record is not None
    return context | {
        "fields": _earlier_fields(record),
        "rendered": _rendered(record.rendered_fields),
        "result": None,
        "error": record.error,
        "deferral": None,
        "why": None,
        "log_lines": await hooks.task_log_lines(store, ti, try_number=shown),
        "trigger_lines": None,
        "waited_triggers": await hooks.try_trigger_logs(store, ti, shown),
    }
