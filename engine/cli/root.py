"""The ``deferral`` command: the root group. Each group of commands lives in a module of
its own in this package and is added here."""

from __future__ import annotations

from typing import Any

import click

from engine import __version__, logs
from engine.cli.common import PATH_TEXT, TEXT
from engine.config import ConfigError, load_settings
from triggers.base import import_object


class _LazyGroup(click.Group):
    """A command group some of whose commands are imported by path when first used: the
    benchmarks (``deferral bench``) are not part of the runtime, which never imports them at
    import time (an import-linter contract and tests/test_layers.py say so)."""

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            command = import_object(
                self.lazy[cmd_name],
                "command",
                accept=lambda obj: isinstance(obj, click.Command),
                wanted="a click command",
            )
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(
    cls=_LazyGroup,
    lazy={"bench": "benchmarks.cli.bench"},
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, "--version", prog_name="deferral")
@click.option(
    "--database-url",
    envvar="DEFERRAL_DATABASE_URL",
    type=TEXT,
    help="PostgreSQL URL (default: the embedded server).",
)
@click.option(
    "--home", envvar="DEFERRAL_HOME", type=PATH_TEXT, help="Folder for the embedded database."
)
@click.option(
    "--log-level", envvar="DEFERRAL_LOG_LEVEL", type=TEXT, help="DEBUG, INFO, WARNING, ERROR."
)
@click.option("--log-format", envvar="DEFERRAL_LOG_FORMAT", type=click.Choice(["text", "json"]))
@click.option(
    "--insecure-dev",
    is_flag=True,
    default=None,
    help="With an external database and no key, store plaintext (development only).",
)
@click.pass_context
def cli(
    ctx: click.Context,
    database_url: str | None,
    home: str | None,
    log_level: str | None,
    log_format: str | None,
    insecure_dev: bool | None,
) -> None:
    """deferral: tasks that wait hand their wait to a triggerer and free their worker slot."""
    try:
        settings = load_settings(
            database_url=database_url,
            home=home,
            log_level=log_level,
            log_format=log_format,
            insecure_dev=insecure_dev or None,
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    logs.configure_logging(settings.log_level, settings.log_format)
    ctx.obj = {"settings": settings}


def _add_commands() -> None:
    from engine.cli import dags, db, demo, keys, processes, tasks, tasks_logs, triggers

    del tasks_logs  # (imported for its command, which it adds to the tasks group)

    for command in (
        processes.scheduler,
        processes.worker,
        processes.triggerer,
        processes.standalone,
        dags.dags,
        tasks.tasks,
        triggers.triggers,
        db.db,
        demo.demo,
        keys.keys,
    ):
        cli.add_command(command)


_add_commands()


def main() -> None:
    cli(prog_name="deferral")
