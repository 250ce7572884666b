"""``deferral triggers``: inspect triggers and triggerers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
from rich.table import Table

from engine.cli.common import _json, _run, _settings, console

if TYPE_CHECKING:
    from engine.store.models import TriggererRow, TriggerRow


@click.group()
def triggers() -> None:
    """Inspect triggers and triggerers."""


@triggers.command("list")
@click.option("--limit", type=click.IntRange(min=0), default=10_000, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@click.pass_context
def triggers_list(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List waiting triggers, their owner and how many tasks wait on each."""
    settings = _settings(ctx)

    async def main() -> tuple[list[TriggerRow], list[TriggererRow]]:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            return await store.list_triggers(limit), await store.list_triggerers()
        finally:
            await store.close()

    rows, triggerers_ = _run(main)
    if as_json:
        _json(rows)
        return
    table = Table("id", "classpath", "triggerer", "waiting", "timeout_at")
    for row in rows:
        table.add_row(
            str(row.id),
            row.classpath,
            str(row.triggerer_id or "-"),
            str(row.waiting),
            str(row.timeout_at or ""),
        )
    console.print(table)
    summary = Table("triggerer", "host", "pid", "capacity", "held", "lease")
    for t in triggerers_:
        summary.add_row(
            str(t.id),
            t.hostname,
            str(t.pid),
            str(t.capacity),
            str(t.held),
            "expired" if t.expired else "live",
        )
    console.print(summary)


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
