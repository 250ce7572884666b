"""``deferral variables``: values tasks read at run time (``Variable.get``, ``{{ var.value.x }}``).

Values are stored encrypted with the engine's keys (``deferral keys rotate`` re-encrypts them).
A task looks a key up in its environment first (``DEFERRAL_VAR_<KEY>``), then here."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import msgspec
from rich.markup import escape
from rich.table import Table

from engine import masking
from engine.cli.common import TEXT, _json, _run, _settings, _usage_exit, console, err_console
from engine.cli.listing import cell, clip, fmt_time, print_table, wide_option

if TYPE_CHECKING:
    from engine.config import Settings
    from engine.store import Store
    from engine.store.variables import VariableRow

__all__ = ["variables"]


class ListedVariable(msgspec.Struct, frozen=True, kw_only=True):
    """A Variable in ``variables list --json`` (keys in the table's column order)."""

    key: str
    #: The value; ``***`` for a Variable marked secret or whose key is named like a secret.
    value: str
    is_secret: bool
    description: str | None
    updated_at: str


def _shown_value(row: VariableRow) -> str:
    if row.is_secret or masking.is_sensitive_key(row.key):
        return masking.MASK
    return str(masking.redact_text(row.value))


def _key(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from engine.store.variables import check_id

    try:
        return check_id(value, "Variable key")
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


async def _with_store(settings: Settings, work: Any) -> Any:
    from engine.store import open_store

    store: Store = await open_store(settings)
    try:
        return await work(store)
    finally:
        await store.close()


def _not_found(key: str) -> None:
    err_console.print(
        f"[red]error[/]: no Variable {escape(key)!r} (deferral variables list shows them)",
        highlight=False,
        soft_wrap=True,
    )
    sys.exit(1)


@click.group()
def variables() -> None:
    """Set, get, list and delete Variables (values tasks read with Variable.get and
    {{ var.value.KEY }}), stored encrypted."""


@variables.command("set")
@click.argument("key", type=TEXT, callback=_key)
@click.argument("value", type=TEXT)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="VALUE is JSON (checked, stored as compact JSON text): read it back with "
    "Variable.get(KEY, deserialize_json=True) or {{ var.json.KEY }}.",
)
@click.option("--description", type=TEXT, help="What the Variable is for (default: unchanged).")
@click.option(
    "--secret/--no-secret",
    default=None,
    help="Mask the value wherever the engine shows it (listings, task logs, rendered "
    "fields), whatever the key is called. Keys named like a secret (api_token, password, ...) "
    "are masked anyway. Default: unchanged (a new Variable: no).",
)
@click.pass_context
def variables_set(
    ctx: click.Context,
    key: str,
    value: str,
    as_json: bool,
    description: str | None,
    secret: bool | None,
) -> None:
    """Create Variable KEY or replace its value. VALUE - reads the value from stdin."""
    if value == "-":
        value = sys.stdin.read()
    if as_json:
        try:
            value = json.dumps(json.loads(value), separators=(",", ":"), ensure_ascii=False)
        except ValueError as exc:
            _usage_exit(f"--json: VALUE is not JSON: {exc}")
    settings = _settings(ctx)

    async def work(store: Store) -> bool:
        created: bool = await store.set_variable(
            key, value, description=description, is_secret=secret
        )
        return created

    created = _run(_with_store, settings, work)
    console.print(
        f"Variable [bold]{escape(key)}[/] {'created' if created else 'set'}",
        highlight=False,
        soft_wrap=True,
    )


@variables.command("get")
@click.argument("key", type=TEXT, callback=_key)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Decode the value as JSON and print it as JSON (exit 1 if it is not JSON).",
)
@click.option("--default", "default", type=TEXT, help="Print this when there is no such Variable.")
@click.pass_context
def variables_get(ctx: click.Context, key: str, as_json: bool, default: str | None) -> None:
    """Print the value of Variable KEY as stored (a secret one too: this is how scripts read
    it). Exit 1 when there is none and no --default."""
    settings = _settings(ctx)

    async def work(store: Store) -> VariableRow | None:
        return await store.get_variable(key)

    row = _run(_with_store, settings, work)
    if row is None:
        if default is None:
            _not_found(key)
        click.echo(default)
        return
    if not as_json:
        click.echo(row.value)
        return
    try:
        decoded = json.loads(row.value)
    except ValueError as exc:
        err_console.print(f"[red]error[/]: Variable {escape(key)!r} is not JSON: {exc}")
        sys.exit(1)
    click.echo(json.dumps(decoded, ensure_ascii=False))


@variables.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@wide_option
@click.pass_context
def variables_list(ctx: click.Context, as_json: bool, wide: bool) -> None:
    """List the Variables: key, value (*** for secret ones), is_secret, description, when
    last set.

    --json keys: key, value, is_secret, description, updated_at.
    """
    settings = _settings(ctx)

    async def work(store: Store) -> list[VariableRow]:
        return await store.list_variables()

    rows = _run(_with_store, settings, work)
    listed = [
        ListedVariable(
            key=row.key,
            value=_shown_value(row),
            is_secret=row.is_secret,
            description=row.description,
            updated_at=row.updated_at.isoformat(),
        )
        for row in rows
    ]
    if as_json:
        _json(listed)
        return
    if not listed:
        console.print("no Variables (deferral variables set KEY VALUE makes one)", highlight=False)
        return
    table = Table("key", "value", "is_secret", "description", "updated")
    for v, row in zip(listed, rows, strict=True):
        table.add_row(
            cell(v.key),
            cell(clip(v.value, wide=wide)),
            cell("yes" if v.is_secret else "no"),
            cell(v.description),
            cell(fmt_time(row.updated_at)),
        )
    print_table(table, wide=wide)


@variables.command("delete")
@click.argument("key", type=TEXT, callback=_key)
@click.pass_context
def variables_delete(ctx: click.Context, key: str) -> None:
    """Delete Variable KEY. Exit 1 when there is none."""
    settings = _settings(ctx)

    async def work(store: Store) -> bool:
        deleted: bool = await store.delete_variable(key)
        return deleted

    if not _run(_with_store, settings, work):
        _not_found(key)
    console.print(f"Variable [bold]{escape(key)}[/] deleted", highlight=False, soft_wrap=True)


@variables.command("import")
@click.argument("path", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.pass_context
def variables_import(ctx: click.Context, path: Path) -> None:
    """Set every Variable of a JSON file: one object, key to value (as `airflow variables
    export` writes it). A value that is not a string is stored as its JSON text."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        _usage_exit(f"{path}: not a JSON file: {exc}")
    if not isinstance(data, dict):
        _usage_exit(f"{path}: the JSON must be one object, key to value")
    from engine.store.variables import check_id

    values: dict[str, str] = {}
    for key, value in data.items():
        try:
            check_id(key, "Variable key")
        except ValueError as exc:
            _usage_exit(f"{path}: {exc}")
        values[key] = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    settings = _settings(ctx)

    async def work(store: Store) -> int:
        for key, value in values.items():
            await store.set_variable(key, value)
        return len(values)

    count = _run(_with_store, settings, work)
    console.print(f"{count} Variable(s) set from {escape(str(path))}", highlight=False)


@variables.command("export")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.pass_context
def variables_export(ctx: click.Context, path: Path) -> None:
    """Write every Variable to a JSON file (one object, key to value; a value that is JSON is
    written decoded). PATH - writes to stdout. The values are written as they are, secret ones
    too: keep the file safe."""
    settings = _settings(ctx)

    async def work(store: Store) -> list[VariableRow]:
        return await store.list_variables()

    out: dict[str, Any] = {}
    for row in _run(_with_store, settings, work):
        try:
            out[row.key] = json.loads(row.value)
        except ValueError:
            out[row.key] = row.value
    text = json.dumps(out, indent=2, ensure_ascii=False) + "\n"
    if str(path) == "-":
        click.echo(text, nl=False)
        return
    path.write_text(text)
    path.chmod(0o600)
    err_console.print(f"wrote {len(out)} Variable(s) to {escape(str(path))} (mode 0600)")
