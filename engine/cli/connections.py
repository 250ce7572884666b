"""``deferral connections``: connections stored in the database, beside ``DEFERRAL_CONN_*``.

Triggers and tasks look a connection id up where they run: the environment first
(``DEFERRAL_CONN_<ID>``), then the engine's own (``deferral``: its database), then these. A
stored connection's password and extra are encrypted with the engine's keys; listings show
``***`` for the password and mask secrets in the extra."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

import click
import msgspec
from rich.markup import escape
from rich.table import Table

from engine import masking
from engine.cli.common import TEXT, _json, _run, _settings, _usage_exit, console, err_console
from engine.cli.listing import cell, clip, print_table, wide_option
from triggers.connections import Connection, conn_env_name

if TYPE_CHECKING:
    from engine.store import Store
    from engine.store.variables import StoredConnection

__all__ = ["connections"]


class ListedConnection(msgspec.Struct, frozen=True, kw_only=True):
    """A connection in ``connections list --json`` / ``get --json`` (keys in the table's
    column order)."""

    conn_id: str
    conn_type: str | None
    host: str | None
    port: int | None
    schema: str | None
    login: str | None
    #: ``***`` when the connection has one (null: none).
    password: str | None
    #: The extra object, secrets masked.
    extra: dict[str, Any]
    description: str | None
    #: Where tasks find it: ``database``, or ``environment`` when DEFERRAL_CONN_<ID> is set
    #: (which wins over the database).
    source: str
    #: The connection as a URL, its password masked.
    uri: str


def _listed(conn: Connection, source: str, *, show_password: bool = False) -> ListedConnection:
    password = conn.password
    if password is not None and not show_password:
        password = masking.MASK
    uri = conn.get_uri()
    if not show_password:
        uri = masking.masked_url(uri)
        if conn.password:
            uri = uri.replace(conn.password, masking.MASK)
    extra = conn.extra_dejson if show_password else masking.redact(conn.extra_dejson)
    return ListedConnection(
        conn_id=conn.conn_id,
        conn_type=conn.conn_type,
        host=conn.host,
        port=conn.port,
        schema=conn.schema,
        login=conn.login,
        password=password,
        extra=extra,
        description=conn.description,
        source=source,
        uri=uri,
    )


def _conn_id(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from engine.store.variables import check_id

    try:
        return check_id(value, "connection id")
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


async def _with_store(ctx: click.Context, work: Any) -> Any:
    from engine.store import open_store

    store: Store = await open_store(_settings(ctx))
    try:
        return await work(store)
    finally:
        await store.close()


def _not_found(conn_id: str) -> None:
    err_console.print(
        f"[red]error[/]: no stored connection {escape(conn_id)!r} (deferral connections list "
        "shows them)",
        highlight=False,
        soft_wrap=True,
    )
    sys.exit(1)


@click.group()
def connections() -> None:
    """Add, list, get and delete connections stored in the database (passwords and extras
    encrypted); DEFERRAL_CONN_<ID> in a process's environment still wins."""


@connections.command("add")
@click.argument("conn_id", type=TEXT, callback=_conn_id)
@click.option(
    "--uri",
    "--conn-uri",
    "uri",
    type=TEXT,
    help="The whole connection as a URL: TYPE://LOGIN:PASSWORD@HOST:PORT/SCHEMA?EXTRA "
    "(percent-encoded; the query becomes the extra).",
)
@click.option("--conn-type", type=TEXT, help="The connection's type (http, postgres, ...).")
@click.option("--host", type=TEXT)
@click.option("--login", type=TEXT)
@click.option("--password", type=TEXT, help="Stored encrypted; listings show ***.")
@click.option("--port", type=click.IntRange(0, 65535))
@click.option("--schema", type=TEXT, help="The database, or the path, of the connection.")
@click.option("--extra", type=TEXT, help="More fields, as a JSON object (stored encrypted).")
@click.option("--description", type=TEXT)
@click.option("--replace", is_flag=True, help="Replace a stored connection of that id.")
@click.pass_context
def connections_add(
    ctx: click.Context,
    conn_id: str,
    uri: str | None,
    conn_type: str | None,
    host: str | None,
    login: str | None,
    password: str | None,
    port: int | None,
    schema: str | None,
    extra: str | None,
    description: str | None,
    replace: bool,
) -> None:
    """Store connection CONN_ID: from --uri, or from --conn-type and the other fields.

    Exit 1 when a connection of that id is stored already (unless --replace).
    """
    from engine.store.variables import ConnectionExists

    fields = {"host": host, "login": login, "password": password, "port": port,
              "schema": schema, "extra": extra}  # fmt: skip
    if uri is not None:
        given = sorted(f"--{k}" for k, v in fields.items() if v is not None)
        if conn_type is not None:
            given.insert(0, "--conn-type")
        if given:
            _usage_exit(
                f"give either --uri or the fields, not both (--uri with {', '.join(given)})"
            )
        try:
            conn = Connection.from_uri(conn_id, uri, description=description)
        except ValueError as exc:
            _usage_exit(f"--uri: {exc}")
    else:
        if not conn_type:
            _usage_exit("give --uri, or --conn-type (with --host, --login, --password, ...)")
        if extra is not None:
            try:
                parsed = json.loads(extra)
            except ValueError as exc:
                _usage_exit(f"--extra is not JSON: {exc}")
            if not isinstance(parsed, dict):
                _usage_exit("--extra must be a JSON object")
            extra = json.dumps(parsed, ensure_ascii=False)
        conn = Connection(
            conn_id=conn_id, conn_type=conn_type, description=description, host=host,
            login=login, password=password, schema=schema, port=port, extra=extra,
        )  # fmt: skip

    async def work(store: Store) -> bool:
        created: bool = await store.add_connection(conn, replace=replace)
        return created

    try:
        created = _run(_with_store, ctx, work)
    except ConnectionExists as exc:
        err_console.print(f"[red]error[/]: {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    shown = _listed(conn, "database")
    console.print(
        f"connection [bold]{escape(conn_id)}[/] {'added' if created else 'replaced'}: "
        f"{escape(shown.uri)}",
        highlight=False,
        soft_wrap=True,
    )
    if os.environ.get(conn_env_name(conn_id)):
        err_console.print(
            f"note: {conn_env_name(conn_id)} is set in this environment; where it is set, it "
            "wins over the stored connection",
            highlight=False,
        )


@connections.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@wide_option
@click.pass_context
def connections_list(ctx: click.Context, as_json: bool, wide: bool) -> None:
    """List the stored connections, passwords shown as ***, secrets in the extra masked.

    --json keys: conn_id, conn_type, host, port, schema, login, password, extra, description,
    source, uri.
    """

    async def work(store: Store) -> list[StoredConnection]:
        return await store.list_connections()

    listed = [_listed(row.connection(), "database") for row in _run(_with_store, ctx, work)]
    if as_json:
        _json(listed)
        return
    if not listed:
        console.print(
            "no stored connections (deferral connections add ID --uri ... makes one)",
            highlight=False,
        )
        return
    table = Table("conn_id", "conn_type", "host", "port", "schema", "login", "password",
                  "extra", "description")  # fmt: skip
    for c in listed:
        table.add_row(
            cell(c.conn_id),
            cell(c.conn_type),
            cell(c.host),
            cell(c.port),
            cell(c.schema),
            cell(c.login),
            cell(c.password),
            cell(clip(json.dumps(c.extra), wide=wide) if c.extra else ""),
            cell(c.description),
        )
    print_table(table, wide=wide)


@connections.command("get")
@click.argument("conn_id", type=TEXT, callback=_conn_id)
@click.option("--json", "as_json", is_flag=True, help="One JSON object (the keys of list --json).")
@click.option("--show-password", is_flag=True, help="Show the password and the extra as they are.")
@click.pass_context
def connections_get(ctx: click.Context, conn_id: str, as_json: bool, show_password: bool) -> None:
    """Show connection CONN_ID as tasks on this machine would find it: DEFERRAL_CONN_<ID> of
    this environment if set, else the stored one (source says which). Exit 1 when neither."""
    env_value = os.environ.get(conn_env_name(conn_id))
    if env_value:
        try:
            text = env_value.strip()
            conn = (Connection.from_json(conn_id, text) if text.startswith("{")
                    else Connection.from_uri(conn_id, text))  # fmt: skip
        except ValueError as exc:
            _usage_exit(f"{conn_env_name(conn_id)}: {exc}")
        shown = _listed(conn, "environment", show_password=show_password)
    else:

        async def work(store: Store) -> StoredConnection | None:
            return await store.get_connection(conn_id)

        row = _run(_with_store, ctx, work)
        if row is None:
            _not_found(conn_id)
            return
        shown = _listed(row.connection(), "database", show_password=show_password)
    if as_json:
        click.echo(msgspec.json.encode(shown).decode())
        return
    for name, value in msgspec.structs.asdict(shown).items():
        if name == "extra":
            value = json.dumps(value, ensure_ascii=False) if value else ""
        console.print(f"{name:<12} {escape('' if value is None else str(value))}",
                      highlight=False, soft_wrap=True)  # fmt: skip


@connections.command("delete")
@click.argument("conn_id", type=TEXT, callback=_conn_id)
@click.pass_context
def connections_delete(ctx: click.Context, conn_id: str) -> None:
    """Delete stored connection CONN_ID. Exit 1 when there is none."""

    async def work(store: Store) -> bool:
        deleted: bool = await store.delete_connection(conn_id)
        return deleted

    if not _run(_with_store, ctx, work):
        _not_found(conn_id)
    console.print(f"connection [bold]{escape(conn_id)}[/] deleted", highlight=False, soft_wrap=True)
