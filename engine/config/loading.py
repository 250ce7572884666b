"""Reading the settings: defaults, the settings file, ``DEFERRAL_*`` variables and flags, and
where each value came from (see :mod:`engine.config`)."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from engine.config.settings import DEFAULT_HOME, SECRET_SETTINGS, ConfigError, Settings
from engine.masking import redact, register_secret, register_url_password

__all__ = [
    "CONFIG_FILE_NAME",
    "DEFAULT_SOURCE",
    "Loaded",
    "config_file",
    "key_line",
    "load",
    "load_settings",
    "register_setting_secrets",
]


def register_setting_secrets(settings: Settings) -> None:
    """Mask the secrets these settings hold wherever this process shows values: the database
    URL's password and the Fernet keys (engine.masking)."""
    register_url_password(settings.database_url)
    if settings.fernet_key:
        register_secret([k for k in settings.fernet_key.replace("\n", ",").split(",")])


#: Settings that are lists; their environment variables hold comma-separated items.
_LIST_SETTINGS = frozenset({"trigger_allow", "worker_queues", "triggerer_queues"})
#: The file read when neither ``--config`` nor ``DEFERRAL_CONFIG`` names one: in the current
#: folder, else in the home folder (``DEFERRAL_HOME``).
CONFIG_FILE_NAME = "deferral.toml"
#: Where a setting's value came from, when it is its default.
DEFAULT_SOURCE = "default"


def _split_list(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


def key_line(text: str, key: str, table: str | None) -> int | None:
    """The line (1-based) of ``key = ...`` in the TOML ``text``, within ``[table]`` (None: the
    top level, before any table header).

    tomllib reports no positions for the values it decodes, so errors about a value find its
    line by this plain scan: a line whose first token is the key (bare or quoted) followed by
    ``=``, under the table's header. Good enough for the flat tables a settings file has; a
    key written inside an inline table or a multi-line string is not found (None)."""
    current: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("["):
            current = stripped[1 : stripped.find("]")].strip().strip('"')
            continue
        if current != table:
            continue
        name, eq, _ = stripped.partition("=")
        if eq and name.strip().strip('"').strip("'") == key:
            return number
    return None


class _FileValues:
    """The settings of one file, with where each was written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.text = path.read_text()
            data = tomllib.loads(self.text)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        self.table: str | None = "deferral" if "deferral" in data else None
        values = data.get("deferral", data)
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path}: [deferral] must be a table")
        self.values: dict[str, Any] = values

    def where(self, key: str) -> str:
        line = key_line(self.text, key, self.table)
        return f"{self.path}:{line}" if line is not None else str(self.path)


def config_file(
    environ: Mapping[str, str], *, config: str | None = None, home: str | None = None
) -> Path | None:
    """The settings file to read: ``config`` (``--config``), else ``DEFERRAL_CONFIG``, else
    ``./deferral.toml``, else ``deferral.toml`` in the home folder, if they exist. A file that
    is named but missing is an error."""
    named = config or environ.get("DEFERRAL_CONFIG")
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            how = "--config" if config else "DEFERRAL_CONFIG"
            raise ConfigError(f"config file {path} ({how}) does not exist")
        return path
    local = Path(CONFIG_FILE_NAME)
    if local.is_file():
        return local
    folder = Path(home or environ.get("DEFERRAL_HOME") or DEFAULT_HOME).expanduser()
    in_home = folder / CONFIG_FILE_NAME
    return in_home if in_home.is_file() else None


class Loaded(msgspec.Struct, frozen=True):
    """Settings and, for each, where its value came from: ``default``, ``FILE:LINE``,
    ``env DEFERRAL_NAME`` or ``flag --name``."""

    settings: Settings
    sources: dict[str, str]
    file: str | None


_FIELDS = {f.name: f for f in msgspec.structs.fields(Settings)}


def _typed(name: str, value: Any, *, strict: bool, where: str) -> Any:
    """One setting's value converted to its type; a ConfigError naming it and ``where``."""
    field = _FIELDS.get(name)
    if field is None:
        raise ConfigError(f"unknown setting {name!r} ({where})")
    try:
        return msgspec.convert(value, field.type, strict=strict)
    except msgspec.ValidationError as exc:
        problem = str(exc).split(" - at ")[0]
        raise ConfigError(f"setting {name} ({where}): {problem}{_given(name, value)}") from None


#: The longest value an error about a setting quotes.
_SHOWN_CHARS = 80


def _given(name: str, value: Any) -> str:
    """What an error says of the value given (after msgspec's words, which name the type
    expected and the type given): nothing for a secret setting; for others the value, masked
    (engine.masking) and cut short."""
    if name in SECRET_SETTINGS:
        return " (the value is not shown: the setting holds a secret)"
    shown = repr(redact(value))
    if len(shown) > _SHOWN_CHARS:
        shown = shown[: _SHOWN_CHARS - 1] + "…"
    return f": {shown}"


def load(
    environ: Mapping[str, str] | None = None,
    *,
    config: str | None = None,
    flags: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Loaded:
    """Read the settings, lowest first: defaults, the file (:func:`config_file`),
    ``DEFERRAL_*`` environment variables, then ``overrides`` (flags; ``None`` values are
    ignored, ``flags`` names the flag each came from). A value of the wrong type, an unknown
    key in the file or a value out of range is a ConfigError naming the setting and where
    its value came from (the file and line, the variable, the flag)."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    path = config_file(env, config=config, home=overrides.get("home"))
    if path is not None:
        found = _FileValues(path)
        for key, raw in found.values.items():
            where = found.where(key)
            # (The file is typed: "8" for a number is an error, as in the file it is a string.)
            values[key] = _typed(key, raw, strict=True, where=where)
            sources[key] = where
    for key, raw in env.items():
        if not key.startswith("DEFERRAL_"):
            continue
        name = key.removeprefix("DEFERRAL_").lower()
        if name in _FIELDS and raw != "":
            value = _split_list(raw) if name in _LIST_SETTINGS else raw
            values[name] = _typed(name, value, strict=False, where=f"env {key}")
            sources[name] = f"env {key}"
    for name, value in overrides.items():
        if value is None:
            continue
        flag = (flags or {}).get(name, "--" + name.replace("_", "-"))
        values[name] = _typed(name, value, strict=False, where=f"flag {flag}")
        sources[name] = f"flag {flag}"
    try:
        settings = Settings(**values)
    except ConfigError as exc:
        words = str(exc).split()
        culprit = words[1].rstrip(":") if words[0] == "setting" else ""
        if culprit in sources:
            raise ConfigError(f"{exc} ({sources[culprit]})") from None
        raise
    full = {name: sources.get(name, DEFAULT_SOURCE) for name in _FIELDS}
    return Loaded(settings, full, None if path is None else str(path))


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Read settings from file and environment; ``overrides`` (flags) win. (See :func:`load`,
    which also says where each value came from.)"""
    return load(environ, **overrides).settings
