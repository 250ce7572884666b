"""What every ``deferral`` command shares: argument types, the settings, running a
coroutine with the database errors a user can act on, JSON output."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import asyncpg
import click
import msgspec
from rich.markup import escape

from engine.cli.pipes import PipeConsole, is_closed_pipe
from engine.config import ConfigError, Settings
from engine.masking import redact_text
from engine.runtime.runner import run_async
from engine.store.embedded import EmbeddedServerError

T = TypeVar("T")
console = PipeConsole()
err_console = PipeConsole(stderr=True)
log = logging.getLogger("engine.cli")


class _Text(click.ParamType):  # type: ignore[type-arg]
    """A string the database and the logs can hold: no NUL character and, unless it names a
    file, valid UTF-8 (bytes that are not UTF-8 reach Python as lone surrogates). Rejected here
    with a usage error naming the argument, rather than as a database error or a traceback."""

    name = "text"

    def __init__(self, *, utf8: bool = True) -> None:
        self.utf8 = utf8

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            value = str(value)
        problem = _text_problem(value, utf8=self.utf8)
        if problem:
            self.fail(problem, param, ctx)
        return value


def _text_problem(value: str, *, utf8: bool = True) -> str | None:
    if "\x00" in value:
        return "must not contain a NUL character"
    if utf8:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "is not valid UTF-8 text"
    return None


def _json_text_problem(value: Any) -> str | None:
    """The first string (key or value) of a decoded JSON document that jsonb cannot hold."""
    if isinstance(value, str):
        return _text_problem(value)
    if isinstance(value, dict):
        items: list[Any] = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        items = value
    else:
        return None
    return next((p for p in map(_json_text_problem, items) if p), None)


class _Seconds(click.FloatRange):
    """A duration in seconds: a finite number > 0 (FloatRange alone lets nan through)."""

    def __init__(self) -> None:
        super().__init__(min=0, min_open=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{seconds} is not a finite number of seconds", param, ctx)
        return seconds


class _Folder(click.Path):
    """An existing folder; a NUL in the name is a usage error (os.stat raises ValueError)."""

    def __init__(self) -> None:
        super().__init__(file_okay=False, exists=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and "\x00" in value:
            self.fail("must not contain a NUL character", param, ctx)
        return super().convert(value, param, ctx)


TEXT = _Text()
PATH_TEXT = _Text(utf8=False)
SECONDS = _Seconds()


def _settings(ctx: click.Context) -> Settings:
    settings: Settings = ctx.obj["settings"]
    return settings


def _run(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    ctx = click.get_current_context(silent=True)
    settings: Settings | None = ctx.obj["settings"] if ctx is not None and ctx.obj else None
    try:
        return run_async(fn, *args, loop=settings.event_loop if settings else "uvloop")
    except ConfigError as exc:
        err_console.print(f"[red]error[/]: {escape(redact_text(str(exc)))}", highlight=False)
        sys.exit(2)
    except (OSError, asyncpg.PostgresError, EmbeddedServerError) as exc:
        if is_closed_pipe(exc):
            raise  # not the database's: the reader of the output left (engine.cli.pipes)
        where = (
            "DEFERRAL_DATABASE_URL"
            if settings is not None and settings.database_url
            else "the embedded server"
        )
        err_console.print(
            f"[red]error[/]: cannot use the database ({where}): {type(exc).__name__}: "
            f"{escape(redact_text(str(exc)))}"
        )
        sys.exit(2)


def _dags_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--dags`` of the process commands."""
    return click.option(
        "--dags",
        "dags_folder",
        envvar="DEFERRAL_DAGS_FOLDER",
        type=_Folder(),
        help="Folder of DAG files (also on sys.path for trigger classes). The scheduler, "
        "worker and standalone refuse to start without one (exit 2); the triggerer warns.",
    )(fn)


def _parse_dags_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--dags`` of the commands that parse the folder themselves (``dags ...``)."""
    return click.option(
        "--dags",
        "dags_folder",
        envvar="DEFERRAL_DAGS_FOLDER",
        type=_Folder(),
        help="Folder of DAG files to parse (and record) first.",
    )(fn)


def _usage_exit(problem: str) -> NoReturn:
    err_console.print(f"[red]error[/]: {escape(problem)}", highlight=False, soft_wrap=True)
    sys.exit(2)


def check_dags_folder(settings: Settings) -> None:
    """Exit 2 when the DAGs folder the settings name (perhaps in deferral.toml, which click
    does not check) is not an existing folder."""
    folder = settings.dags_folder
    if folder and not Path(folder).expanduser().is_dir():
        _usage_exit(f"the DAGs folder {folder} (setting dags_folder) is not an existing folder")


def require_dags_folder(settings: Settings, command: str) -> None:
    """Exit 2 unless the settings name an existing DAGs folder (``--dags``,
    ``DEFERRAL_DAGS_FOLDER`` or ``dags_folder`` in deferral.toml); log the folder used. A
    scheduler, worker or standalone without one would start and then fail every run."""
    if not settings.dags_folder:
        _usage_exit(
            f"deferral {command} needs a DAGs folder: pass --dags FOLDER or set "
            "DEFERRAL_DAGS_FOLDER (or dags_folder in deferral.toml)"
        )
    check_dags_folder(settings)
    log.info("%s: DAGs folder %s", command, Path(settings.dags_folder).expanduser().resolve())


def _json(rows: Sequence[object]) -> None:
    """Rows (structs or dicts) as one JSON array of objects."""
    click.echo(msgspec.json.encode(rows).decode())


def decode_result(raw: bytes | None) -> Any:
    from triggers.base import decode_value

    return None if raw is None else decode_value(raw)


async def migrate(settings: Settings) -> list[int]:
    from engine.store import open_store

    store = await open_store(settings, migrate=False)
    try:
        return await store.migrate()
    finally:
        await store.close()
