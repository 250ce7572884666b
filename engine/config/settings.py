"""The settings table: every setting, its type, default and ``#:`` documentation, and the
checks of values (see :mod:`engine.config`)."""

from __future__ import annotations

import zoneinfo
from pathlib import Path
from typing import Any

import msgspec
import platformdirs

from engine.config.urls import database_url_problem
from engine.masking import masked_url, redact

__all__ = ["SECRET_SETTINGS", "ConfigError", "Settings"]

DEFAULT_WORKER_SLOTS = 16
DEFAULT_TRIGGERER_CAPACITY = 1000
DEFAULT_TRIGGERER_LEASE_S = 10.0
DEFAULT_POLL_INTERVAL_S = 1.0
DEFAULT_OUTCOME_LINGER_S = 0.01
DEFAULT_CLAIM_BATCH = 5000
DEFAULT_BLOCKED_LOOP_S = 0.2
DEFAULT_TRIGGERER_MAX_BLOCK_S = 5.0
DEFAULT_DAG_FILE_PROCESSOR_TIMEOUT_S = 30.0
DEFAULT_DAG_RESCAN_INTERVAL_S = 10.0
DEFAULT_HOME = platformdirs.user_data_dir("deferral")
#: The first metrics port of ``deferral standalone`` when ``metrics_port`` is unset.
STANDALONE_METRICS_PORT = 9464
DEFAULT_LOG_RETENTION_DAYS = 30.0
#: Trigger classes a metric labels by their own value (engine.runtime.metrics.DEFAULT_MAX_SERIES).
DEFAULT_METRICS_MAX_SERIES = 100
DEFAULT_LOG_MAX_LINES_PER_S = 1000
DEFAULT_LOG_MAX_TOTAL_BYTES = 10 << 20
DEFAULT_LOG_MAX_LINE_BYTES = 64 << 10
DEFAULT_LOG_BUFFER_BYTES = 32 << 20
#: The largest encoded XCom value (a return value or a push) a task may store.
DEFAULT_XCOM_MAX_BYTES = 1 << 20
DEFAULT_CALLBACK_TIMEOUT_S = 60.0
DEFAULT_MAX_MAP_LENGTH = 1024


#: Settings whose values are secrets: never shown, also not in an error about them.
SECRET_SETTINGS = frozenset({"database_url", "fernet_key", "webhook_token"})


class ConfigError(ValueError):
    """A setting has a value the engine cannot use."""


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting of the engine. Durations are in seconds, as their names say.

    Each field's ``#:`` comment is its row of docs/reference/settings.md; a last line
    ``Default: ...`` says what the default is when the value below is computed or unset."""

    #: PostgreSQL URL (`postgresql://USER:PASSWORD@HOST:PORT/DATABASE`; `postgres://` too).
    #: Unset: the embedded server under `home`, shared by every process on the machine. Its
    #: password is masked wherever the engine shows values.
    database_url: str | None = None
    #: Folder for the embedded database (`pgdata/`), the demo's log and, when neither
    #: `--config` nor `DEFERRAL_CONFIG` names a file and the current folder has none, the
    #: settings file `deferral.toml`.
    #: Default: per-user data folder (`~/.local/share/deferral`)
    home: str = DEFAULT_HOME
    #: Folder of DAG files. It is put first on `sys.path` of workers and triggerers, so trigger
    #: classes defined there import by classpath. `deferral scheduler`, `worker` and
    #: `standalone` refuse to start without one (exit 2, naming `--dags` and
    #: `DEFERRAL_DAGS_FOLDER`) and log the folder they use; `deferral triggerer` starts with a
    #: warning (it can still run the built-in `triggers.*`). **Reserved names:** a module or
    #: package at the top of the folder named like one of the engine's packages (`engine`,
    #: `triggers`, `operators`, `benchmarks`) or a standard library module (`json.py`,
    #: `email/`) is not imported: Python would find the engine's or the standard library's
    #: module instead. It is reported as an import error naming the file and what to rename it
    #: to (`my_triggers.py`).
    dags_folder: str | None = None
    #: How long importing one DAG file may take. A new or changed file is imported first in a
    #: child process; one that overruns this (or calls `sys.exit()`, raises
    #: `KeyboardInterrupt`, ends the process) is an import error naming the file and the cause,
    #: and only files that imported cleanly there are imported by the worker or scheduler. A
    #: file that overran is tried again once it changes. The scheduler scans its folder beside
    #: its scheduling loop: a slow file delays the recording of DAGs, never a scheduling pass.
    dag_file_processor_timeout_s: float = DEFAULT_DAG_FILE_PROCESSOR_TIMEOUT_S
    #: How often the scheduler scans the DAGs folder for new, changed and removed files, in a
    #: task of its own beside the scheduling loop. A file is imported again only when its
    #: content changed (its modification time, size or inode, then its SHA-256), and a DAG is
    #: written to the database only when what is recorded of it changed (a hash of it): a scan
    #: of an unchanged folder costs a `stat` per file. Each
    #: import error is logged once per change of its file (a short line, the traceback under
    #: it), followed by a line saying when the next scan is. `deferral dags trigger` without
    #: `--dags`, for a DAG the database does not know yet, asks the running scheduler to scan
    #: at once and waits for it.
    dag_rescan_interval_s: float = DEFAULT_DAG_RESCAN_INTERVAL_S
    #: `DEBUG`, `INFO`, `WARNING` or `ERROR`. Unset, commands other than the engine's
    #: processes (`scheduler`, `worker`, `triggerer`, `standalone`, `webserver`, `demo`,
    #: `bench`) log warnings and errors only: `deferral -v ...` shows their INFO lines, `-vv`
    #: DEBUG.
    log_level: str = "INFO"
    #: Process logs: `text` for people (one line per record: time, level, `kind[pid]`, logger,
    #: the bound ids in brackets, the message) or `json` for machines (one object per line
    #: with `ts`, `level`, `process`, `pid`, `logger`, `msg` and the bound ids as fields:
    #: `trigger` and `classpath` in a trigger's lines, `dag`, `run`, `task`, `attempt` in a
    #: task's).
    log_format: str = "text"
    #: Connections in each process's pool (workers and triggerers open them all at start and keep
    #: them).
    pool_size: int = 8
    #: Event loop of the engine's processes: `uvloop` or `asyncio`.
    event_loop: str = "uvloop"

    #: Port of the process's metrics server: Prometheus `/metrics`, `/livez` and `/readyz`
    #: (see [metrics and health](../howto/metrics.md)); the flag `--metrics-port` of
    #: `deferral scheduler`, `worker` and `triggerer`. Unset: no server; 0: a free port
    #: (`deferral status` shows it); `--no-metrics`: no server whatever this says. `deferral
    #: standalone` serves them by default, its scheduler, worker and triggerer on this port
    #: and the next two (0: three free ports).
    #: Default: unset (`deferral standalone`: 9464)
    metrics_port: int | None = None
    #: Address the metrics server listens on; `0.0.0.0` to be scraped and probed from other
    #: machines (a container's probes, a Prometheus elsewhere).
    metrics_host: str = "127.0.0.1"
    #: The most trigger classes a metric labelled by class (`deferral_trigger_starts_total`,
    #: ...) counts under their own label value, per process; further classes, and classes the
    #: allow-list `trigger_allow` refuses, are counted under `trigger_class="other"` (see
    #: [cardinality](../howto/metrics.md#cardinality)).
    metrics_max_series: int = DEFAULT_METRICS_MAX_SERIES

    #: Fernet keys that encrypt trigger kwargs, resume kwargs, events and results at rest,
    #: comma-separated: the first encrypts, all decrypt. Make one with `deferral keys
    #: generate`; see [encryption at rest](../explanation/security.md#encryption-at-rest).
    #: Never logged.
    fernet_key: str | None = None
    #: A file of keys (one a line, first = primary), used when `fernet_key` is unset. The
    #: embedded default is created with mode 0600 on first use.
    #: Default: unset; with the embedded database `<home>/fernet.key`
    fernet_key_file: str | None = None
    #: With an external database and no key, store plaintext (warned once) instead of refusing
    #: to start. Also the global flag `deferral --insecure-dev`. Development only.
    insecure_dev: bool = False

    #: Task instances a worker runs at once (`deferral worker --slots`).
    worker_slots: int = DEFAULT_WORKER_SLOTS
    #: How often an idle worker polls for runnable tasks when no notification came (the
    #: backstop to LISTEN/NOTIFY).
    worker_poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    #: How often a worker heartbeats itself and all its running tasks (one statement, on a
    #: connection of its own: a heartbeat unanswered after twice this, at least 2 s, is given
    #: up and sent again on a new connection). Keep it well under half of
    #: `zombie_threshold_s`.
    worker_heartbeat_s: float = 5.0
    #: While a worker's task outcomes follow each other closely, how long the next write of
    #: them waits for more to share its statement: fewer statements and commits under a
    #: steady stream, for an end up to this much later (see
    #: [the path of a deferral](../explanation/architecture.md#the-path-of-a-deferral), step
    #: 7). A lone outcome on an idle worker is written at once; `0` never waits.
    worker_outcome_linger_s: float = DEFAULT_OUTCOME_LINGER_S
    #: After SIGTERM, how long running tasks may finish before the worker exits; tasks still
    #: running are reaped and retried per their policy.
    worker_shutdown_grace_s: float = 30.0
    #: The queues whose tasks a worker runs (`deferral worker --queues gpu,default`); a task's
    #: `queue` (default `default`) names the one it goes to. In the environment:
    #: comma-separated.
    worker_queues: tuple[str, ...] = ("default",)
    #: Running tasks across all workers at once, enforced by the database at each claim (every
    #: worker should be given the same value); `0`: no limit but the workers' slots and the
    #: pools. See [admission](../explanation/admission.md).
    parallelism: int = 0

    #: Triggers one triggerer runs at once (`deferral triggerer --capacity`); the rest wait
    #: unowned as backlog.
    triggerer_capacity: int = DEFAULT_TRIGGERER_CAPACITY
    #: A triggerer's lease on the database clock, renewed every third of it. It is renewed by
    #: a thread with a connection of its own, whose session also holds the triggerer's
    #: advisory lock: when the process dies, the other triggerers see the lock free and adopt
    #: its triggers within a fraction of a second (when it lapses otherwise).
    triggerer_lease_s: float = DEFAULT_TRIGGERER_LEASE_S
    #: How often a triggerer looks for unowned triggers when no notification came.
    triggerer_poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    #: Triggers claimed per statement.
    triggerer_claim_batch: int = DEFAULT_CLAIM_BATCH
    #: The trigger queues whose triggers a triggerer runs (`deferral triggerer --queues`); a
    #: task's `trigger_queue` (default `default`) names the one its triggers go to. In the
    #: environment: comma-separated.
    triggerer_queues: tuple[str, ...] = ("default",)
    #: A callback that blocks the triggerer's loop longer than this is logged with the trigger
    #: that ran it.
    triggerer_blocked_loop_s: float = DEFAULT_BLOCKED_LOOP_S
    #: How long a trigger's `cleanup()` may take before it is abandoned.
    triggerer_cleanup_timeout_s: float = 5.0
    #: Cancel a trigger after it has blocked the loop this many times, failing its task with
    #: that reason; `0` never cancels (the block is only logged).
    triggerer_cancel_blocking_after: int = 0
    #: A trigger that blocks the triggerer's loop longer than this fails its tasks at once,
    #: with an error naming the trigger and the limit; the failure is written from the lease
    #: thread, so no triggerer starts it again. The lease is renewed while the loop is blocked,
    #: for up to this plus twice `triggerer_lease_s`.
    triggerer_max_block_s: float = DEFAULT_TRIGGERER_MAX_BLOCK_S

    #: How often the scheduler runs its housekeeping (it is also woken by notifications).
    scheduler_interval_s: float = 1.0
    #: A running task whose worker has not heartbeated for this long is failed (retries
    #: apply). Silence counts only while the scheduler itself reaches the database: a gap of
    #: more than half of this between its probes (the database hung or restarted, the network
    #: was cut, the scheduler was paused) starts the count again. Triggers nobody waits on are
    #: dropped once this old (the scheduler looks every half of it).
    zombie_threshold_s: float = 30.0
    #: How late a deferral deadline may be before the scheduler ends the deferral itself
    #: (normally the triggerer does it on time with a loop timer).
    timeout_backstop_grace_s: float = 5.0

    #: The address ``deferral webserver`` (the status page) listens on; any other address than
    #: the loopback one exposes it to the network.
    webserver_host: str = "127.0.0.1"
    #: The status page's port (``deferral webserver --port``; ``deferral standalone
    #: --webserver-port`` starts it there too). 0: a free port, printed once bound and listed
    #: by `deferral status`.
    webserver_port: int = 8793
    #: The token of the asset webhook (`POST /api/assets/NAME/events` on the status page),
    #: sent as `Authorization: Bearer TOKEN`. Unset: the webhook refuses every request. Never
    #: logged.
    webhook_token: str | None = None

    #: Per-trigger and per-try log lines older than this many days are deleted by the
    #: scheduler (in small batches); 0 keeps them forever.
    log_retention_days: float = DEFAULT_LOG_RETENTION_DAYS
    #: Lines one trigger or one task try may store a second (more exactly: between two writes
    #: of its process's log writer, about a second apart). In a second in which it logs more,
    #: the oldest of them are dropped, and a line `N lines dropped` stands in their place. See
    #: [logs](../howto/logs.md#bounds-what-a-flood-leaves).
    log_max_lines_per_s: int = DEFAULT_LOG_MAX_LINES_PER_S
    #: Bytes of log text (UTF-8) one task try stores in all, counted across its executions
    #: (deferrals, reschedules) and workers. Past it, its later lines are dropped and one line
    #: `N lines dropped` says how many, written when the try ends.
    #: Default: `10485760` (10 MiB)
    log_max_try_bytes: int = DEFAULT_LOG_MAX_TOTAL_BYTES
    #: Bytes of log text (UTF-8) one trigger stores in all, as `log_max_try_bytes` for a try:
    #: past it, one line `N lines dropped`, written when the trigger ends.
    #: Default: `10485760` (10 MiB)
    log_max_trigger_bytes: int = DEFAULT_LOG_MAX_TOTAL_BYTES
    #: A stored log line longer than this many bytes (UTF-8) is cut there and ends with
    #: `[... N bytes cut]`.
    #: Default: `65536` (64 KiB)
    log_max_line_bytes: int = DEFAULT_LOG_MAX_LINE_BYTES
    #: Memory a worker or a triggerer gives the log lines waiting to be written, all its tries
    #: or triggers together (each line counts its text and about 200 bytes more). Past it, the
    #: oldest waiting lines of the same try or trigger make room, or the new line is dropped;
    #: the next write says how many went (`N lines dropped`). At least `log_max_line_bytes`
    #: plus 1 KiB.
    #: Default: `33554432` (32 MiB)
    log_buffer_bytes: int = DEFAULT_LOG_BUFFER_BYTES

    #: Sensors created with `deferrable=None` defer (like Airflow's `default_deferrable`); the
    #: worker hands it to them at run time, in `context["default_deferrable"]` (a sensor that
    #: cannot defer, such as a `PythonSensor` without `async_check`, waits in its `mode`).
    default_deferrable: bool = False

    #: The time zone of naive dates a DAG file gives (`start_date`, `end_date`, the events of
    #: an `EventsTimetable`): an IANA name (`Europe/Amsterdam`) or `UTC`. A DAG whose
    #: `start_date` is naive runs its cron schedule in this zone. (Airflow's
    #: `[core] default_timezone`.)
    default_timezone: str = "UTC"
    #: Which timetable a cron string (and a preset such as `@daily`) makes: `true`, data
    #: intervals (a run per interval, created when it ends, logical date its start: Airflow
    #: 2's behaviour); `false`, `CronTriggerTimetable` (a run each time the cron fires,
    #: logical date that moment: Airflow 3's default). A DAG can pass either timetable as its
    #: `schedule` whatever this says. See [schedules](../howto/schedules.md).
    create_cron_data_intervals: bool = True

    #: The largest XCom value a task may store, in bytes once encoded: its return value and
    #: each `xcom_push`. A larger one fails the task, naming the task, the key, the size and
    #: this setting (nothing of it is written). For larger data, write it to object storage
    #: and pass its path.
    #: Default: `1048576` (1 MiB)
    xcom_max_bytes: int = DEFAULT_XCOM_MAX_BYTES
    #: The most instances one mapped task (`expand`) may have. A task expanded over more
    #: values fails, naming the task, the count and this setting.
    #: Default: `1024`
    max_map_length: int = DEFAULT_MAX_MAP_LENGTH

    #: How long a callback (`on_failure_callback`, a DAG's, a deadline alert's ...) may run on
    #: a worker, in seconds. One that runs longer is given up, logged with the try's lines and
    #: changes nothing (a `def` callback's thread cannot be stopped and runs on). See
    #: [alerting](../howto/alerting.md).
    #: Default: `60`
    callback_timeout_s: float = DEFAULT_CALLBACK_TIMEOUT_S

    #: Patterns of the trigger classpaths, and of the import paths given to triggers
    #: (`PythonTrigger`'s `check`, `HttpTrigger`'s `response_check`), that workers accept at
    #: defer time and triggerers at start; full match, fnmatch syntax (`*` spans dots).
    #: Setting it replaces the default. In the environment: comma-separated. A refused trigger
    #: fails its task with a message naming this setting. See
    #: [security](../explanation/security.md#code-execution-from-the-database).
    #: Default: built-in `triggers.*` and the modules of the DAGs folder
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
            "metrics_max_series": self.metrics_max_series,
            "log_max_lines_per_s": self.log_max_lines_per_s,
            "log_max_try_bytes": self.log_max_try_bytes,
            "log_max_trigger_bytes": self.log_max_trigger_bytes,
            "log_max_line_bytes": self.log_max_line_bytes,
            "xcom_max_bytes": self.xcom_max_bytes,
            "callback_timeout_s": self.callback_timeout_s,
            "max_map_length": self.max_map_length,
        }
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"setting metrics_port must be a port number (0-65535), got {self.metrics_port}"
            )
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"setting {name} must be > 0, got {value!r}")
        if self.worker_outcome_linger_s < 0:
            raise ConfigError(
                "setting worker_outcome_linger_s must be >= 0 (0: write at once), got "
                f"{self.worker_outcome_linger_s!r}"
            )
        if self.parallelism < 0:
            raise ConfigError(
                f"setting parallelism must be >= 0 (0: no limit), got {self.parallelism!r}"
            )
        for name, queues in (
            ("worker_queues", self.worker_queues),
            ("triggerer_queues", self.triggerer_queues),
        ):
            if not queues or any(not q.strip() or "," in q for q in queues):
                raise ConfigError(
                    f"setting {name} must name at least one queue, each a non-empty name "
                    f"without ',', got {list(queues)!r}"
                )
        if not self.log_retention_days >= 0 or self.log_retention_days == float("inf"):
            raise ConfigError(
                "setting log_retention_days must be a finite number >= 0 (0: keep forever), "
                f"got {self.log_retention_days!r}"
            )
        if self.log_buffer_bytes < self.log_max_line_bytes + 1024:
            raise ConfigError(
                "setting log_buffer_bytes must be at least log_max_line_bytes + 1024 "
                f"({self.log_max_line_bytes + 1024}), got {self.log_buffer_bytes!r}"
            )
        if self.event_loop not in ("uvloop", "asyncio"):
            raise ConfigError(
                f"setting event_loop must be 'uvloop' or 'asyncio', not {self.event_loop!r}"
            )
        if not self.default_timezone.strip():
            raise ConfigError("setting default_timezone must name a time zone (UTC, Europe/...)")
        if self.default_timezone.strip().upper() != "UTC":
            try:
                zoneinfo.ZoneInfo(self.default_timezone.strip())
            except (zoneinfo.ZoneInfoNotFoundError, ValueError):
                raise ConfigError(
                    f"setting default_timezone: unknown time zone {self.default_timezone!r} "
                    "(an IANA name: Europe/Amsterdam, America/New_York, or UTC)"
                ) from None
        for pattern in self.trigger_allow or ():
            if not pattern.strip() or pattern != pattern.strip():
                raise ConfigError(
                    "setting trigger_allow: every pattern must be a non-empty string without "
                    f"surrounding spaces, got {pattern!r}"
                )
        if not 0 <= self.webserver_port <= 65535:
            raise ConfigError(
                f"setting webserver_port must be 0-65535, got {self.webserver_port!r}"
            )
        if self.log_format not in ("text", "json"):
            raise ConfigError(
                f"setting log_format must be 'text' or 'json', not {self.log_format!r}"
            )
        if self.database_url:
            problem = database_url_problem(self.database_url)
            if problem:
                raise ConfigError(
                    "setting database_url must be a PostgreSQL URL "
                    f"(postgresql://USER:PASSWORD@HOST:PORT/DATABASE): {problem} (the value "
                    "is not shown: it may hold a password)"
                )

    def __repr__(self) -> str:
        # Keys and passwords must not reach a log or a traceback through a repr of the settings.
        def shown(name: str, value: object) -> str:
            if name == "fernet_key" and value:
                return "'<hidden>'"
            if name == "database_url" and isinstance(value, str):
                return repr(masked_url(value))
            return repr(redact(value))

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
