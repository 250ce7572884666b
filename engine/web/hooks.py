"""What other parts of the engine fill in on the status page. Each hook returns None when this
build has nothing to say; the page then leaves the field out (or says so).

``why_not_running`` and ``pools`` are filled in by admission (pools, ``tasks why``);
``try_xcoms`` reads the XComs a try pushed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.masking import redact_text

if TYPE_CHECKING:
    from engine.store import Store
    from engine.store.models import LogLine, TaskTry

__all__ = [
    "pools",
    "set_dag_paused",
    "task_log_lines",
    "trigger_log_lines",
    "try_trigger_logs",
    "try_xcoms",
    "why_not_running",
]

#: Lines of a task's or trigger's log shown on a page, from the first (the CLI shows them all).
LOG_PAGE_LINES = 500
#: Triggers a try waited on whose lines the task page shows (the latest ones; the CLI shows
#: every one: ``deferral triggers logs ID``).
TRIGGER_LOGS_SHOWN = 5


async def why_not_running(store: Store, ti: TaskTry) -> str | None:
    """The "why not running" answer for a task instance (``deferral tasks why``); None for
    one that runs or has ended (the page shows its state). The parallelism and when a worker
    counts as gone are read from this process's settings (environment and file), as the
    command reads them."""
    from engine.client.why import waiting_reasons
    from engine.config import ConfigError, Settings, load_settings

    try:
        settings = load_settings()
    except ConfigError:
        settings = Settings()  # (the page still answers, with the default limits)
    return (await waiting_reasons(store, [ti.id], settings)).get(ti.id)


async def task_log_lines(
    store: Store, ti: TaskTry, *, try_number: int | None = None
) -> list[str] | None:
    """The log of the task's try ``try_number`` (None: its latest), oldest line first (up to
    ``LOG_PAGE_LINES``)."""
    logs = await store.task_logs(ti.dag_id, ti.run_id, ti.name, try_number, limit=LOG_PAGE_LINES)
    return [_line(line) for line in logs.lines]


async def try_xcoms(store: Store, ti: TaskTry, try_number: int) -> list[tuple[str, str]] | None:
    """The XComs try ``try_number`` of the task pushed, (key, value shown as indented JSON,
    secrets masked) each, by key; its return value is the result, shown as such. None for an
    earlier try: a new try starts without the XComs of the one before, which are not kept (the
    page leaves the section out)."""
    from engine.client.xcoms import shown
    from engine.security.keys import UnreadableValue
    from engine.web.render import pretty

    if try_number != ti.try_number:
        return None
    try:
        found = await store.xcom_of_task(ti.dag_id, ti.run_id, ti.task_id, ti.map_index)
    except UnreadableValue as exc:
        return [("(unreadable)", str(exc))]
    return [
        (key, pretty(shown(key, raw)))
        for key, raw in sorted((found or {}).items())
        if key != "return_value"
    ]


async def trigger_log_lines(store: Store, trigger_id: int) -> list[str] | None:
    """What a trigger logged, while it waits and after it fired, oldest line first (up to
    ``LOG_PAGE_LINES``)."""
    logs = await store.trigger_logs(trigger_id, limit=LOG_PAGE_LINES)
    return [_line(line) for line in logs.lines]


async def try_trigger_logs(
    store: Store, ti: TaskTry, try_number: int, *, besides: int | None = None
) -> list[tuple[int, list[str]]]:
    """The lines of the triggers try ``try_number`` of the task waited on and that logged,
    (trigger id, its lines) each, also after they fired, the latest :data:`TRIGGER_LOGS_SHOWN`
    of them; not trigger ``besides`` (the one the page shows as the current wait)."""
    logs = await store.task_logs(ti.dag_id, ti.run_id, ti.name, try_number, limit=0)
    shown = []
    # (The latest few: a try that deferred again and again would cost a read each.)
    for trigger_id in logs.trigger_ids[-TRIGGER_LOGS_SHOWN:]:
        if trigger_id != besides:
            lines = await trigger_log_lines(store, trigger_id)
            shown.append((trigger_id, lines or []))
    return shown


def _line(line: LogLine) -> str:
    stamp = line.at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    # (Stored masked; masked again for lines stored before a secret was known here.)
    return f"{stamp} {line.level:<7} {line.logger}: {redact_text(line.message)}"


async def pools(store: Store) -> list[dict[str, object]] | None:
    """The pools, one dict each (name, slots, running, queued, ...: shown as columns in this
    order), or None when this build has no pools (the Pools page is then not offered).

    The columns are those of ``deferral pools list``: running and deferred in pool slots,
    queued in tasks due and waiting to be admitted, open the slots left (negative once a pool
    is shrunk below what runs in it)."""
    return [
        {
            "name": p.name,
            "slots": p.slots,
            "running": p.running,
            "queued": p.queued,
            "deferred": p.deferred,
            "open": p.open,
            "include_deferred": "yes" if p.include_deferred else "no",
            "description": p.description or "",
        }
        for p in await store.list_pools()
    ]


async def set_dag_paused(store: Store, dag_id: str, paused: bool) -> bool | None:
    """Pause or unpause a DAG: True when done, False when no such DAG."""
    return await store.set_dag_paused(dag_id, paused)
