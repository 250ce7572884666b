"""``deferral triggers``: inspect triggers and triggerers.

Trigger kwargs are shown decrypted, with the value of every key that looks secret
(``password``, ``token``, ``Authorization``, ... at any depth, headers included) masked."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

import click
import msgspec
from rich.table import Table

from engine.cli.common import _json, _run, _settings, _usage_exit, console
from engine.cli.listing import (
    cell,
    clip,
    compact_json,
    fmt_time,
    masked_kwargs,
    print_table,
    wide_option,
)

if TYPE_CHECKING:
    from engine.store.models import TriggererRow, TriggerRow, WaitingTask

#: How many of the tasks waiting on each trigger ``triggers list`` names (``waiting`` counts
#: them all; ``triggers show`` names every one).
LISTED_TASKS = 5

#: What a trigger's timeout_at is, by the deadline kind of the task that set it.
_DEADLINES = {
    "trigger_timeout": "the timeout given to defer()",
    "execution_timeout": "the task's execution_timeout",
    "sensor_timeout": "the sensor's timeout",
}


class _Task(msgspec.Struct, frozen=True, kw_only=True):
    dag_id: str
    run_id: str
    task_id: str


class _ListedTrigger(msgspec.Struct, frozen=True, kw_only=True):
    """A trigger in ``triggers list --json``."""

    id: int
    classpath: str
    kwargs: Any
    triggerer_id: int | None
    waiting: int
    tasks: list[_Task]
    timeout_at: dt.datetime | None
    created_at: dt.datetime


class _Triggerer(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    hostname: str | None
    pid: int | None


class _ShownTrigger(msgspec.Struct, frozen=True, kw_only=True):
    """One trigger in ``triggers show --json``."""

    id: int
    classpath: str
    kwargs: Any
    triggerer_id: int | None
    triggerer: _Triggerer | None
    fence: int
    created_at: dt.datetime
    timeout_at: dt.datetime | None
    deadline_kind: str | None
    waiting: int
    tasks: list[_Task]


def _tasks(tasks: list[WaitingTask]) -> list[_Task]:
    return [_Task(dag_id=t.dag_id, run_id=t.run_id, task_id=t.task_id) for t in tasks]


def _named(task: _Task) -> str:
    return f"{task.dag_id}/{task.run_id}/{task.task_id}"


@click.group()
def triggers() -> None:
    """Inspect triggers and triggerers."""


@triggers.command("list")
@click.option("--limit", type=click.IntRange(min=0), default=10_000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@wide_option
@click.pass_context
def triggers_list(ctx: click.Context, limit: int, as_json: bool, wide: bool) -> None:
    """List waiting triggers: kwargs (secrets masked), owner, how many tasks wait on each and
    the first few of them; then the triggerers.

    --json keys: id, classpath, kwargs, triggerer_id, waiting, tasks (the first few waiting
    task instances: dag_id, run_id, task_id), timeout_at, created_at.
    """
    settings = _settings(ctx)

    async def main() -> tuple[list[TriggerRow], list[TriggererRow]]:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            rows = await store.list_triggers(limit, tasks_per_trigger=LISTED_TASKS)
            return rows, await store.list_triggerers()
        finally:
            await store.close()

    rows, triggerers_ = _run(main)
    listed = [
        _ListedTrigger(
            id=row.id,
            classpath=row.classpath,
            kwargs=masked_kwargs(row.kwargs),
            triggerer_id=row.triggerer_id,
            waiting=row.waiting,
            tasks=_tasks(row.tasks),
            timeout_at=row.timeout_at,
            created_at=row.created_at,
        )
        for row in rows
    ]
    if as_json:
        _json(listed)
        return
    table = Table("id", "classpath", "kwargs", "triggerer", "waiting", "tasks", "timeout_at")
    for t in listed:
        named = ", ".join(_named(task) for task in t.tasks)
        if t.waiting > len(t.tasks):
            named += f" (+{t.waiting - len(t.tasks)} more)"
        table.add_row(
            cell(t.id),
            cell(t.classpath),
            cell(clip(compact_json(t.kwargs), wide=wide)),
            cell(t.triggerer_id or "-"),
            cell(t.waiting),
            cell(named),
            cell(fmt_time(t.timeout_at)),
        )
    print_table(table, wide=wide, empty="no waiting triggers")
    summary = Table("triggerer", "host", "pid", "capacity", "held", "lease")
    for r in triggerers_:
        summary.add_row(
            cell(r.id),
            cell(r.hostname),
            cell(r.pid),
            cell(r.capacity),
            cell(r.held),
            "expired" if r.expired else "live",
        )
    print_table(summary, wide=wide, empty="no triggerer running")


@triggers.command("show")
@click.argument("trigger_id", metavar="ID", type=click.IntRange(min=0))
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.pass_context
def triggers_show(ctx: click.Context, trigger_id: int, as_json: bool) -> None:
    """Show one trigger in full: classpath, kwargs (secrets masked), the triggerer running it
    (host and pid) and its fencing token, when it was created, its deadline and which one it
    is, and every task instance waiting on it.

    Exit codes: 0 shown, 2 no such trigger (it may have fired already).
    """
    settings = _settings(ctx)

    async def main() -> TriggerRow | None:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            return await store.get_trigger(trigger_id)
        finally:
            await store.close()

    row = _run(main)
    if row is None:
        _usage_exit(f"no trigger {trigger_id} (it may have fired already)")
    owner_row = None
    if row.triggerer_id is not None:
        owner_row = _Triggerer(
            id=row.triggerer_id, hostname=row.triggerer_hostname, pid=row.triggerer_pid
        )
    shown = _ShownTrigger(
        id=row.id,
        classpath=row.classpath,
        kwargs=masked_kwargs(row.kwargs),
        triggerer_id=row.triggerer_id,
        triggerer=owner_row,
        fence=row.fence,
        created_at=row.created_at,
        timeout_at=row.timeout_at,
        deadline_kind=row.deadline_kind,
        waiting=row.waiting,
        tasks=_tasks(row.tasks),
    )
    if as_json:
        click.echo(msgspec.json.encode(shown).decode())
        return
    if shown.triggerer is None:
        owner = "none (waiting for a triggerer to claim it)"
    else:
        where = f"{shown.triggerer.hostname} pid {shown.triggerer.pid}"
        owner = f"{shown.triggerer.id} ({where if shown.triggerer.hostname else 'gone'})"
    deadline = "none"
    if shown.timeout_at is not None:
        kind = _DEADLINES.get(shown.deadline_kind or "", "")
        deadline = fmt_time(shown.timeout_at) + (f" ({kind})" if kind else "")
    kwargs = "(no configured key opens them)" if row.kwargs is None else compact_json(shown.kwargs)
    for name, value in (
        ("trigger", str(shown.id)),
        ("classpath", shown.classpath),
        ("kwargs", kwargs),
        ("triggerer", owner),
        ("fence", str(shown.fence)),
        ("created_at", fmt_time(shown.created_at)),
        ("timeout_at", deadline),
        ("waiting", str(shown.waiting)),
    ):
        console.print(f"{name + ':':<12}", cell(value), highlight=False, soft_wrap=True)
    table = Table("dag_id", "run_id", "task_id")
    for task in shown.tasks:
        table.add_row(cell(task.dag_id), cell(task.run_id), cell(task.task_id))
    print_table(table, wide=False, empty="no task waits on it")


@triggers.command("logs")
@click.argument("trigger_id", type=click.IntRange(min=1, max=2**63 - 1), metavar="ID")
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="Keep printing new lines until the trigger is gone (fired, timed out) and its last "
    "lines are read; Ctrl-C stops.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line.")
@click.pass_context
def triggers_logs(ctx: click.Context, trigger_id: int, follow: bool, as_json: bool) -> None:
    """Print the lines a trigger logged, while it waits and after it fired."""
    import anyio

    from engine.cli.common import err_console
    from engine.cli.logview import follow_pages, run_following
    from engine.store import TriggerLogs

    settings = _settings(ctx)

    async def main() -> TriggerLogs:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            return await follow_pages(
                lambda after: store.trigger_logs(trigger_id, after),
                lambda page: page.lines,
                lambda page: page.next_seq,
                lambda page: not page.waiting,
                follow=follow,
                as_json=as_json,
            )
        finally:
            with anyio.move_on_after(5, shield=True):
                await store.close()

    last = run_following(main)
    if last is not None and not last.waiting and last.next_seq == 0 and not as_json:
        err_console.print(f"trigger {trigger_id} is not waiting and has no stored lines")
