"""``deferral config show``: every setting, its value and where the value came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import msgspec
from rich.markup import escape
from rich.table import Table

from engine.cli.common import console
from engine.config import DEFAULT_SOURCE, Loaded, Settings
from engine.masking import redact

#: Where a value derived by ``--effective`` came from.
DERIVED = "derived"


def _shown(name: str, value: Any) -> Any:
    """A value as it may be printed: keys hidden, passwords masked (the database URL's, and
    whatever secret any other value holds: engine.masking)."""
    if name == "fernet_key" and value:
        return "<hidden>"
    if isinstance(value, tuple):
        value = list(value)
    return redact(value)


def _effective(settings: Settings, name: str, value: Any, source: str) -> tuple[Any, str]:
    """What the processes make of a setting that is unset or relative (no database or
    file is touched to find out)."""
    from engine.launch.app import trigger_allow_list
    from engine.security.keys import KEY_FILE_NAME

    home = settings.home_path.resolve()
    if name == "home":
        return str(home), source
    if name == "database_url" and not value:
        return f"(the embedded server in {home / 'pgdata'})", DERIVED
    if name == "dags_folder" and value:
        return str(Path(value).expanduser().resolve()), source
    if (
        name == "fernet_key_file"
        and not value
        and not settings.fernet_key
        and not settings.database_url
    ):
        return str(home / KEY_FILE_NAME), DERIVED
    if name == "trigger_allow" and value is None:
        patterns = list(trigger_allow_list(settings).patterns)
        if settings.dags_folder:
            patterns.append("(the modules of the DAGs folder)")
        return patterns, DERIVED
    return value, source


def rows(loaded: Loaded, *, effective: bool) -> list[dict[str, Any]]:
    """One row per setting: ``setting``, ``value``, ``source``."""
    settings = loaded.settings
    out = []
    for name, value in msgspec.structs.asdict(settings).items():
        source = loaded.sources.get(name, DEFAULT_SOURCE)
        if effective:
            value, source = _effective(settings, name, value, source)
        out.append({"setting": name, "value": _shown(name, value), "source": source})
    return out


@click.group()
def config() -> None:
    """The settings: deferral.toml, DEFERRAL_* variables and flags."""


@click.command()
@click.option(
    "--effective",
    is_flag=True,
    help="Show what the processes derive from unset or relative values (the embedded "
    "database, the key file, the allow-list's patterns).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@click.pass_context
def show(ctx: click.Context, effective: bool, as_json: bool) -> None:
    """Print every setting with its value and where it came from: default, FILE:LINE,
    env DEFERRAL_NAME or flag --name (later ones win, in that order)."""
    loaded: Loaded = ctx.obj["loaded"]
    listed = rows(loaded, effective=effective)
    if as_json:
        click.echo(msgspec.json.encode(listed).decode())
        return
    table = Table("setting", "value", "source", box=None, header_style="bold")
    for row in listed:
        value = row["value"]
        if value is None:
            shown = "unset"
        elif isinstance(value, list):
            shown = ", ".join(value)
        else:
            shown = str(value)
        table.add_row(escape(row["setting"]), escape(shown), escape(row["source"]))
    console.print(f"settings file: {escape(loaded.file or 'none')}", highlight=False)
    console.print(table, highlight=False, soft_wrap=True)


config.add_command(show)
