"""The ``deferral`` command: the root group. Each group of commands lives in a module of
its own in this package and is added here."""

from __future__ import annotations

import sys
from typing import Any

import click

from engine.cli.common import PATH_TEXT, TEXT
from engine.cli.pipes import EXIT_CLOSED_PIPE, is_closed_pipe, silence_stdout
from engine.config import DEFAULT_SOURCE, ConfigError, Loaded, load, register_setting_secrets
from engine.dags import defaults as dag_defaults
from engine.masking import register_environment
from engine.runtime import logs
from engine.version import __version__
from triggers.base import import_object

_COMMANDLINE = click.core.ParameterSource.COMMANDLINE

#: The commands that run the engine's processes: their log lines (INFO by default) are their
#: output. Every other command logs warnings and errors only unless asked (``-v``).
PROCESS_COMMANDS = frozenset(
    {"scheduler", "worker", "triggerer", "standalone", "webserver", "demo", "bench"}
)


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

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        """(``--help`` and ``--version`` print while the arguments are parsed.)"""
        try:
            return super().make_context(info_name, args, parent, **extra)
        except Exception as exc:
            if not is_closed_pipe(exc):
                raise
        silence_stdout()
        raise click.exceptions.Exit(EXIT_CLOSED_PIPE)

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; a closed pipe (``deferral ... | head -1``) ends it quietly: no
        message, exit 141 (as a process killed by SIGPIPE), whichever command it was."""
        try:
            return super().invoke(ctx)
        except Exception as exc:
            if not is_closed_pipe(exc):
                raise
        silence_stdout()
        ctx.exit(EXIT_CLOSED_PIPE)


@click.group(
    cls=_LazyGroup,
    lazy={"bench": "benchmarks.cli.bench"},
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, "--version", prog_name="deferral")
@click.option(
    "--config",
    "config",
    envvar="DEFERRAL_CONFIG",
    type=PATH_TEXT,
    help="Settings file (default: ./deferral.toml, else deferral.toml in the home folder).",
)
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
    "-v",
    "--verbose",
    count=True,
    help="Show the engine's INFO lines (starting the embedded server, migrations, ...); -vv: "
    "DEBUG. Commands other than the processes log warnings and errors only by default.",
)
@click.option(
    "--insecure-dev",
    is_flag=True,
    default=None,
    help="With an external database and no key, store plaintext (development only).",
)
@click.pass_context
def cli(
    ctx: click.Context,
    config: str | None,
    database_url: str | None,
    home: str | None,
    log_level: str | None,
    log_format: str | None,
    verbose: int,
    insecure_dev: bool | None,
) -> None:
    """deferral: tasks that wait hand their wait to a triggerer and free their worker slot."""
    given: dict[str, Any] = {
        "database_url": database_url,
        "home": home,
        "log_level": log_level,
        "log_format": log_format,
        "insecure_dev": insecure_dev or None,
    }
    # Values click read from DEFERRAL_* variables are left to the settings loader, which
    # reads the same variables: their source is then the variable, not a flag.
    flags = {
        name: value
        for name, value in given.items()
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    }
    try:
        loaded = load(
            config=config if ctx.get_parameter_source("config") is _COMMANDLINE else None,
            **flags,
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    settings = loaded.settings
    # Known secrets are masked in everything this command shows and logs (the processes it
    # starts are commands too, and register their own).
    register_environment()
    register_setting_secrets(settings)
    logs.configure_logging(_log_level(loaded, verbose, ctx.invoked_subcommand), settings.log_format)
    # DAG files this command reads are declared with its settings (default_timezone, ...).
    try:
        dag_defaults.configure(settings)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    ctx.obj = {"settings": settings, "loaded": loaded}


def _log_level(loaded: Loaded, verbose: int, command: str | None) -> str:
    """The level this command logs at: ``-v`` INFO, ``-vv`` DEBUG; else the setting
    ``log_level`` when it was set (flag, variable, file), or its default (INFO) for the
    engine's processes and WARNING for every other command: a listing prints what it lists,
    not that the embedded server started and stopped."""
    if verbose:
        return "DEBUG" if verbose > 1 else "INFO"
    if loaded.sources.get("log_level", DEFAULT_SOURCE) != DEFAULT_SOURCE:
        return loaded.settings.log_level
    return loaded.settings.log_level if command in PROCESS_COMMANDS else "WARNING"


def _add_commands() -> None:
    from engine.cli import (
        assets,
        config,
        connections,
        dags,
        dags_list,
        db,
        demo,
        health,
        keys,
        overrides,
        pools,
        processes,
        runs,
        status,
        tasks,
        tasks_logs,
        tasks_test,
        tasks_xcom,
        triggers,
        variables,
        webserver,
    )

    del dags_list, tasks_logs  # (imported for their commands, added to dags and tasks)
    tasks.tasks.add_command(tasks_test.tasks_test)
    tasks.tasks.add_command(tasks_xcom.tasks_xcom)
    for command in overrides.tasks_commands():
        tasks.tasks.add_command(command)
    for command in overrides.runs_commands():
        runs.runs.add_command(command)

    for command in (
        processes.scheduler,
        processes.worker,
        processes.triggerer,
        processes.standalone,
        dags.dags,
        runs.runs,
        tasks.tasks,
        triggers.triggers,
        pools.pools,
        assets.assets,
        variables.variables,
        connections.connections,
        db.db,
        demo.demo,
        keys.keys,
        webserver.webserver,
        config.config,
        health.health,
        status.status,
    ):
        cli.add_command(command)


_add_commands()


def main() -> None:
    try:
        cli(prog_name="deferral")
    except SystemExit as exc:
        code = exc.code
    else:  # (click's standalone mode always exits)
        code = 0
    # What is still buffered is written now, while a closed pipe can still be met quietly
    # (at the interpreter's exit it would print "Exception ignored ... BrokenPipeError").
    try:
        sys.stdout.flush()
    except Exception as exc:
        if not is_closed_pipe(exc):
            raise
        silence_stdout()
        code = EXIT_CLOSED_PIPE
    sys.exit(code)
