"""One settings struct, read from ``deferral.toml`` and ``DEFERRAL_*`` environment variables.

Precedence, lowest first: defaults below, the ``[deferral]`` table of the file named by
``DEFERRAL_CONFIG`` (or ``./deferral.toml`` when it exists), environment variables
(``DEFERRAL_WORKER_SLOTS=8``), then command-line flags.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import platformdirs

__all__ = ["ConfigError", "Settings", "load_settings", "masked_url"]

DEFAULT_WORKER_SLOTS = 16
DEFAULT_TRIGGERER_CAPACITY = 1000
DEFAULT_TRIGGERER_LEASE_S = 10.0
DEFAULT_POLL_INTERVAL_S = 1.0
DEFAULT_CLAIM_BATCH = 5000
DEFAULT_BLOCKED_LOOP_S = 0.2
DEFAULT_TRIGGERER_MAX_BLOCK_S = 5.0
DEFAULT_DAG_FILE_PROCESSOR_TIMEOUT_S = 30.0
DEFAULT_DAG_RESCAN_INTERVAL_S = 10.0
DEFAULT_LOG_RETENTION_DAYS = 30.0


def masked_url(url: str) -> str:
    """A database URL with its password replaced by ``***`` (for messages and listings)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user, colon, _password = creds.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{host}"


class ConfigError(ValueError):
    """A setting has a value the engine cannot use."""


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting of the engine. Durations are in seconds, as their names say."""

    #: PostgreSQL URL; when empty the embedded server under ``home`` is used.
    database_url: str | None = None
    #: Folder for the embedded database and other local state.
    home: str = platformdirs.user_data_dir("deferral")
    #: Folder of DAG files; also put on sys.path so trigger classes there import.
    dags_folder: str | None = None
    #: How long importing one DAG file may take (in a child process) before it is an error.
    dag_file_processor_timeout_s: float = DEFAULT_DAG_FILE_PROCESSOR_TIMEOUT_S
    #: How often the scheduler scans the DAGs folder for new, changed and removed files.
    dag_rescan_interval_s: float = DEFAULT_DAG_RESCAN_INTERVAL_S
    log_level: str = "INFO"
    #: "text" or "json".
    log_format: str = "text"
    #: Size of each process's connection pool.
    pool_size: int = 8
    #: Event loop of the engine's processes: "uvloop" or "asyncio".
    event_loop: str = "uvloop"

    #: Fernet keys that encrypt trigger kwargs, resume kwargs, events and results at rest,
    #: comma-separated: the first encrypts, all decrypt (``deferral keys generate``).
    fernet_key: str | None = None
    #: File holding the keys (one a line, first = primary), instead of ``fernet_key``. Default
    #: with the embedded database: ``<home>/fernet.key``, created (mode 0600) on first use.
    fernet_key_file: str | None = None
    #: With an external database and no key, store plaintext (with a warning) instead of
    #: refusing to start. For development only.
    insecure_dev: bool = False

    worker_slots: int = DEFAULT_WORKER_SLOTS
    worker_poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    worker_heartbeat_s: float = 5.0
    worker_shutdown_grace_s: float = 30.0

    triggerer_capacity: int = DEFAULT_TRIGGERER_CAPACITY
    triggerer_lease_s: float = DEFAULT_TRIGGERER_LEASE_S
    triggerer_poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    triggerer_claim_batch: int = DEFAULT_CLAIM_BATCH
    triggerer_blocked_loop_s: float = DEFAULT_BLOCKED_LOOP_S
    triggerer_cleanup_timeout_s: float = 5.0
    #: Cancel a trigger that blocks the event loop this many times, failing its tasks (0: never).
    triggerer_cancel_blocking_after: int = 0
    #: A trigger that blocks the event loop longer than this fails its tasks at once (written
    #: from another thread, so no triggerer starts it again). The lease is kept meanwhile.
    triggerer_max_block_s: float = DEFAULT_TRIGGERER_MAX_BLOCK_S

    scheduler_interval_s: float = 1.0
    zombie_threshold_s: float = 30.0
    #: How late a deferral deadline may be before the scheduler ends it (no triggerer alive).
    timeout_backstop_grace_s: float = 5.0

    #: Per-trigger and per-try log lines older than this many days are deleted by the
    #: scheduler (in small batches); 0 keeps them forever.
    log_retention_days: float = DEFAULT_LOG_RETENTION_DAYS

    #: Sensors defer by default (``deferrable=None``), like Airflow's ``default_deferrable``.
    #: The worker hands it to operators at run time, in ``context["default_deferrable"]``.
    default_deferrable: bool = False

    #: Patterns (fnmatch, full match) of the trigger classpaths and the import paths given to
    #: triggers (``PythonTrigger``'s ``check``) that workers and triggerers accept. Unset: the
    #: built-in ``triggers.*`` and the modules of the DAGs folder. In the environment: a
    #: comma-separated list (``DEFERRAL_TRIGGER_ALLOW="triggers.*,myproj.triggers.*"``).
    trigger_allow: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        positive = {
            "pool_size": self.pool_size,
            "dag_file_processor_timeout_s": self.dag_file_processor_timeout_s,
            "dag_rescan_interval_s": self.dag_rescan_interval_s,
            "worker_slots": self.worker_slots,
            "worker_poll_interval_s": self.worker_poll_interval_s,
            "worker_heartbeat_s": self.worker_heartbeat_s,
            "triggerer_capacity": self.triggerer_capacity,
            "triggerer_lease_s": self.triggerer_lease_s,
            "triggerer_poll_interval_s": self.triggerer_poll_interval_s,
            "triggerer_claim_batch": self.triggerer_claim_batch,
            "triggerer_blocked_loop_s": self.triggerer_blocked_loop_s,
            "triggerer_max_block_s": self.triggerer_max_block_s,
            "scheduler_interval_s": self.scheduler_interval_s,
            "zombie_threshold_s": self.zombie_threshold_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"setting {name} must be > 0, got {value!r}")
        if not self.log_retention_days >= 0 or self.log_retention_days == float("inf"):
            raise ConfigError(
                "setting log_retention_days must be a finite number >= 0 (0: keep forever), "
                f"got {self.log_retention_days!r}"
            )
        if self.event_loop not in ("uvloop", "asyncio"):
            raise ConfigError(
                f"setting event_loop must be 'uvloop' or 'asyncio', not {self.event_loop!r}"
            )
        for pattern in self.trigger_allow or ():
            if not pattern.strip() or pattern != pattern.strip():
                raise ConfigError(
                    "setting trigger_allow: every pattern must be a non-empty string without "
                    f"surrounding spaces, got {pattern!r}"
                )
        if self.log_format not in ("text", "json"):
            raise ConfigError(
                f"setting log_format must be 'text' or 'json', not {self.log_format!r}"
            )

    def __repr__(self) -> str:
        # Keys and passwords must not reach a log or a traceback through a repr of the settings.
        def shown(name: str, value: object) -> str:
            if name == "fernet_key" and value:
                return "'<hidden>'"
            if name == "database_url" and isinstance(value, str):
                return repr(masked_url(value))
            return repr(value)

        fields = (
            f"{name}={shown(name, value)}" for name, value in msgspec.structs.asdict(self).items()
        )
        return f"Settings({', '.join(fields)})"

    def replace(self, **changes: Any) -> Settings:
        """A copy with the given settings changed (``None`` values are ignored)."""
        return msgspec.structs.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser()


#: Settings that are lists; their environment variables hold comma-separated items.
_LIST_SETTINGS = frozenset({"trigger_allow"})


def _split_list(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


def _from_file(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    table = data.get("deferral", data)
    if not isinstance(table, dict):
        raise ConfigError(f"config file {path}: [deferral] must be a table")
    return table


def load_settings(environ: dict[str, str] | None = None, **overrides: Any) -> Settings:
    """Read settings from file and environment; ``overrides`` (flags) win."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config_file = env.get("DEFERRAL_CONFIG")
    if config_file:
        values.update(_from_file(Path(config_file)))
    elif Path("deferral.toml").is_file():
        values.update(_from_file(Path("deferral.toml")))
    fields = set(Settings.__struct_fields__)
    for key, raw in env.items():
        if not key.startswith("DEFERRAL_"):
            continue
        name = key.removeprefix("DEFERRAL_").lower()
        if name in fields and raw != "":
            values[name] = _split_list(raw) if name in _LIST_SETTINGS else raw
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(values, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid setting: {exc}") from None
