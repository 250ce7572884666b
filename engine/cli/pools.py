"""``deferral pools``: the named slot counts that admission keeps tasks within.

A task holds ``pool_slots`` of its pool while running and, in a pool that includes deferred
tasks, while deferred too; a task whose pool is full stays ``scheduled``. ``default_pool``
(128 slots) is the pool of every task that names none: it can be resized, never deleted."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click
import msgspec
from rich.markup import escape
from rich.table import Table

from engine.cli.common import TEXT, _json, _run, _settings, _usage_exit, console, err_console
from engine.cli.listing import cell, print_table, wide_option

if TYPE_CHECKING:
    from engine.store.models import PoolRow

#: The most slots a pool can have (the column is a PostgreSQL integer).
MAX_SLOTS = 2**31 - 1


class ListedPool(msgspec.Struct, frozen=True, kw_only=True):
    """A pool in ``pools list --json`` (keys in the table's column order)."""

    name: str
    slots: int
    running: int
    queued: int
    deferred: int
    open: int
    include_deferred: bool
    description: str | None


def listed_pool(row: PoolRow) -> ListedPool:
    return ListedPool(
        name=row.name,
        slots=row.slots,
        running=row.running,
        queued=row.queued,
        deferred=row.deferred,
        open=row.open,
        include_deferred=row.include_deferred,
        description=row.description,
    )


def _pool_name(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A pool name is what tasks give as ``pool=``: blank is refused (tasks refuse it too)."""
    if not value.strip():
        raise click.BadParameter("a pool needs a non-empty name", ctx=ctx, param=param)
    return value


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


@click.group()
def pools() -> None:
    """Create, resize, list and delete pools (slots that limit how many tasks run at once)."""


@pools.command("set")
@click.argument("name", type=TEXT, callback=_pool_name)
@click.option(
    "--slots",
    type=click.IntRange(min=0, max=MAX_SLOTS),
    required=True,
    help="Slots of the pool; 0 admits nothing. Shrinking it stops nothing that runs: the "
    "pool admits again once below it.",
)
@click.option(
    "--include-deferred/--no-include-deferred",
    default=None,
    help="Whether the pool's deferred tasks hold their slots too (isolates sensors). "
    "Default: unchanged (a new pool: no).",
)
@click.option(
    "--description", type=TEXT, help="What the pool is for. Default: unchanged (a new pool: none)."
)
@click.pass_context
def pools_set(
    ctx: click.Context,
    name: str,
    slots: int,
    include_deferred: bool | None,
    description: str | None,
) -> None:
    """Create pool NAME, or change its slots (and, when given, whether it counts deferred
    tasks and its description). Workers waiting on the pool are woken: a pool grown admits at
    once."""
    settings = _settings(ctx)

    async def main() -> tuple[bool, list[PoolRow]]:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            created = await store.set_pool(
                name, slots, include_deferred=include_deferred, description=description
            )
            return created, await store.list_pools(name)
        finally:
            await store.close()

    try:
        created, rows = _run(main)
    except ValueError as exc:
        _usage_exit(str(exc))
    for row in rows:
        console.print(
            f"pool [bold]{escape(row.name)}[/] {'created' if created else 'set'}: "
            f"{row.slots} slots, {row.running} running, {row.open} open; deferred tasks "
            f"{'counted' if row.include_deferred else 'not counted'}",
            highlight=False,
            soft_wrap=True,
        )


@pools.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@wide_option
@click.pass_context
def pools_list(ctx: click.Context, as_json: bool, wide: bool) -> None:
    """List the pools and what each holds: running (slots of running tasks), queued (due tasks
    waiting to be admitted), deferred (slots of deferred tasks), open (slots left: deferred
    tasks count only with include_deferred; negative once a pool is shrunk below what runs in
    it).

    --json keys: name, slots, running, queued, deferred, open, include_deferred, description.
    """
    settings = _settings(ctx)

    async def main() -> list[PoolRow]:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            return await store.list_pools()
        finally:
            await store.close()

    listed = [listed_pool(row) for row in _run(main)]
    if as_json:
        _json(listed)
        return
    table = Table(
        "name", "slots", "running", "queued", "deferred", "open", "include_deferred",
        "description",
    )  # fmt: skip
    for p in listed:
        table.add_row(
            cell(p.name),
            cell(p.slots),
            cell(p.running),
            cell(p.queued),
            cell(p.deferred),
            cell(p.open),
            cell(_yes_no(p.include_deferred)),
            cell(p.description),
        )
    print_table(table, wide=wide, empty="no pools")


@pools.command("delete")
@click.argument("name", type=TEXT, callback=_pool_name)
@click.pass_context
def pools_delete(ctx: click.Context, name: str) -> None:
    """Delete pool NAME. Refused while a task instance that has not finished names it (a run
    of it would fail at its claim), and for default_pool.

    Exit codes: 0 deleted, 1 refused (in use, or default_pool), 2 no such pool.
    """
    from engine.store import PoolInUse, PoolNotFound

    settings = _settings(ctx)

    async def main() -> None:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            await store.delete_pool(name)
        finally:
            await store.close()

    try:
        _run(main)
    except PoolNotFound as exc:
        _usage_exit(str(exc.args[0] if exc.args else exc))
    except PoolInUse as exc:
        err_console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    console.print(f"pool [bold]{escape(name)}[/] deleted", highlight=False, soft_wrap=True)
