"""``deferral db``: the database."""

from __future__ import annotations

import click

from engine.cli.common import _run, _settings, console, migrate


@click.group()
def db() -> None:
    """The database."""


@db.command("migrate")
@click.pass_context
def db_migrate(ctx: click.Context) -> None:
    """Create or upgrade the schema."""
    applied = _run(migrate, _settings(ctx))
    console.print(f"applied migrations: {applied}" if applied else "schema is up to date")


@db.command("url")
@click.pass_context
def db_url(ctx: click.Context) -> None:
    """Print the database URL (starting the embedded server if needed)."""
    from engine.store import database_url

    click.echo(database_url(_settings(ctx)))
