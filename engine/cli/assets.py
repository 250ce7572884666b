"""``deferral assets``: the assets DAG files declare, their events, and emitting one by hand.

An asset event (a task's success with the asset among its outlets, a watcher, the webhook,
``assets emit``) queues a run of every DAG scheduled on the asset; the scheduler creates it
once the DAG's condition holds (docs/howto/assets.md)."""

from __future__ import annotations

import datetime as dt
import getpass
from typing import TYPE_CHECKING, Any

import click
import msgspec
from rich.markup import escape
from rich.table import Table

from engine.cli.common import (
    TEXT,
    _json,
    _json_text_problem,
    _run,
    _settings,
    _usage_exit,
    console,
)
from engine.cli.listing import cell, compact_json, fmt_time, print_table, wide_option

if TYPE_CHECKING:
    from engine.store.models import AssetEventRow, AssetRow

__all__ = ["ListedAsset", "ListedAssetEvent", "assets", "listed_event"]


class ListedAsset(msgspec.Struct, frozen=True, kw_only=True):
    """An asset in ``assets list --json`` (keys in the table's column order)."""

    name: str
    uri: str
    group: str
    #: ``[{"name": ..., "classpath": ..., ...}]``: its watchers (and their triggerer, when
    #: the triggerer's runtime records one).
    watchers: list[dict[str, Any]]
    #: ``{"id", "timestamp", "source_kind"}`` of its latest event (None: none yet).
    last_event: dict[str, Any] | None
    scheduled_dags: list[str]
    producing_dags: list[str]
    extra: dict[str, Any]


class ListedAssetEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An asset event in ``assets events --json`` and ``runs list --json``'s
    ``triggering_asset_events``."""

    id: int
    asset: str
    uri: str
    timestamp: dt.datetime
    extra: dict[str, Any]
    source_kind: str
    source_dag_id: str | None
    source_run_id: str | None
    source_task_id: str | None
    source_map_index: int | None
    source_name: str | None


def listed_asset(row: AssetRow) -> ListedAsset:
    return ListedAsset(
        name=row.name,
        uri=row.uri,
        group=row.group,
        watchers=row.watchers,
        last_event=None
        if row.last_event_id is None
        else {
            "id": row.last_event_id,
            "timestamp": row.last_event_at,
            "source_kind": row.last_event_source,
        },
        scheduled_dags=row.scheduled_dags,
        producing_dags=row.producing_dags,
        extra=row.extra,
    )


def listed_event(row: AssetEventRow) -> ListedAssetEvent:
    return ListedAssetEvent(
        id=row.id,
        asset=row.asset,
        uri=row.uri,
        timestamp=row.timestamp,
        extra=row.extra,
        source_kind=row.source_kind,
        source_dag_id=row.source_dag_id,
        source_run_id=row.source_run_id,
        source_task_id=row.source_task_id,
        source_map_index=row.source_map_index,
        source_name=row.source_name,
    )


def source_text(event: ListedAssetEvent) -> str:
    """Who recorded an event, in a few words: ``task dag/run/task``, ``watcher NAME``, ..."""
    if event.source_kind == "task":
        task = event.source_task_id or "?"
        if event.source_map_index is not None and event.source_map_index >= 0:
            task = f"{task}[{event.source_map_index}]"
        return f"task {event.source_dag_id}/{event.source_run_id}/{task}"
    return event.source_kind + (f" {event.source_name}" if event.source_name else "")


@click.group()
def assets() -> None:
    """List assets and their events, and emit an event by hand."""


@assets.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@click.option("--all", "everything", is_flag=True, help="Also assets no active DAG uses.")
@wide_option
@click.pass_context
def assets_list(ctx: click.Context, as_json: bool, everything: bool, wide: bool) -> None:
    """List the assets the DAGs use: their uri, group, watchers, latest event and the DAGs
    scheduled on them (and those whose tasks update them).

    --json keys: name, uri, group, watchers (a list of {name, classpath, state, triggerer,
    triggerer_id, events, restarts, last_error, last_error_at, retry_at}), last_event
    ({id, timestamp, source_kind}, or null), scheduled_dags, producing_dags, extra.
    """
    settings = _settings(ctx)

    async def main() -> list[AssetRow]:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            return await store.list_assets(everything=everything)
        finally:
            await store.close()

    listed = [listed_asset(row) for row in _run(main)]
    if as_json:
        _json(listed)
        return
    table = Table("name", "uri", "group", "watchers", "last event", "scheduled DAGs", "updated by")
    for a in listed:
        watchers = ", ".join(_watcher_cell(w) for w in a.watchers)
        last = (
            f"#{a.last_event['id']} {fmt_time(a.last_event['timestamp'])} "
            f"({a.last_event['source_kind']})"
            if a.last_event is not None
            else ""
        )
        table.add_row(
            cell(a.name),
            cell(a.uri),
            cell(a.group),
            cell(watchers),
            cell(last),
            cell(", ".join(a.scheduled_dags)),
            cell(", ".join(a.producing_dags)),
        )
    print_table(table, wide=wide, empty="no assets (no DAG declares one)")


def _watcher_cell(w: dict[str, Any]) -> str:
    """A watcher in the table: its name, state and triggerer, and its restarts and last
    error once it failed."""
    where = f" on {w['triggerer']}" if w.get("triggerer") else ""
    text = f"{w.get('name')} ({w.get('state', '?')}{where})"
    if w.get("restarts"):
        error = str(w.get("last_error") or "").strip().splitlines()
        text += f" restarts: {w['restarts']}, last error: {error[-1] if error else '?'}"
    return text


async def _known(store: Any, name: str) -> None:
    if not await store.asset_exists(name):
        raise LookupError(
            f"unknown asset {name!r}: no DAG declares it (deferral assets list shows the "
            "assets the DAGs use)"
        )


@assets.command("events")
@click.argument("name", type=TEXT)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=100_000),
    default=50,
    show_default=True,
    help="The latest events shown.",
)
@wide_option
@click.pass_context
def assets_events(ctx: click.Context, name: str, as_json: bool, limit: int, wide: bool) -> None:
    """List asset NAME's latest events, newest first.

    --json keys: id, asset, uri, timestamp, extra, source_kind, source_dag_id, source_run_id,
    source_task_id, source_map_index, source_name. Exit 2: no such asset.
    """
    settings = _settings(ctx)

    async def main() -> list[AssetEventRow]:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            await _known(store, name)
            return await store.asset_events(name, limit)
        finally:
            await store.close()

    try:
        rows = _run(main)
    except LookupError as exc:
        _usage_exit(str(exc))
    listed = [listed_event(r) for r in rows]
    if as_json:
        _json(listed)
        return
    table = Table("id", "timestamp", "source", "extra")
    for e in listed:
        table.add_row(
            cell(e.id),
            cell(fmt_time(e.timestamp)),
            cell(source_text(e)),
            cell(compact_json(e.extra)),
        )
    print_table(table, wide=wide, empty=f"no events of asset {name}")


def _extra(ctx: click.Context, param: click.Parameter, value: str | None) -> dict[str, Any]:
    """``--extra``: a JSON object."""
    if value is None:
        return {}
    try:
        data = msgspec.json.decode(value)
    except msgspec.DecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", ctx=ctx, param=param) from None
    if not isinstance(data, dict):
        raise click.BadParameter(
            f"must be a JSON object ({{...}}), got {type(data).__name__}", ctx=ctx, param=param
        )
    problem = _json_text_problem(data)
    if problem:
        raise click.BadParameter(problem, ctx=ctx, param=param)
    return data


@assets.command("emit")
@click.argument("name", type=TEXT)
@click.option(
    "--extra",
    type=TEXT,
    callback=_extra,
    help="The event's extra, a JSON object: --extra '{\"rows\": 42}'.",
)
@click.pass_context
def assets_emit(ctx: click.Context, name: str, extra: dict[str, Any]) -> None:
    """Record an event of asset NAME, as a task with NAME among its outlets would: the DAGs
    scheduled on it get their runs once their condition holds. Prints the event's id.

    Exit 2: no such asset, or --extra is not a JSON object.
    """
    from engine.store.models import NewAssetEvent

    settings = _settings(ctx)
    event = NewAssetEvent(asset=name, extra=extra, source_kind="cli", source_name=_who())

    async def main() -> int:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            await _known(store, name)
            written = await store.record_asset_events([event])
            if not written:
                raise LookupError(f"unknown asset {name!r}")
            return written[0].id
        finally:
            await store.close()

    try:
        event_id = _run(main)
    except LookupError as exc:
        _usage_exit(str(exc))
    console.print(
        f"asset event [bold]{event_id}[/] of [bold]{escape(name)}[/] recorded",
        highlight=False,
        soft_wrap=True,
    )


def _who() -> str | None:
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return None
