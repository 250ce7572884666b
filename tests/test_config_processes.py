"""Each process's config (``WorkerConfig``, ``TriggererConfig``, ``SchedulerConfig``) is
built from the settings in one place, carries every setting that concerns the process, and
its fields are the keyword arguments the process's constructor accepts (any other name is a
TypeError naming it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from engine.config import Settings
from engine.dags.dagbag import DagBag
from engine.launch.app import make_scheduler, make_triggerer, make_worker
from engine.runtime.metrics import Metrics
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.scheduler import Scheduler
from engine.security.allow import TriggerAllowList
from engine.store import Store
from engine.triggerer import Triggerer
from engine.triggerer.config import TriggererConfig
from engine.usercode.loglimits import LogLimits
from engine.worker.config import WorkerConfig
from engine.worker.worker import Worker

CONFIGS = (WorkerConfig, TriggererConfig, SchedulerConfig)

#: Settings no process config carries, and where each goes instead. A new setting must be
#: wired into a config's ``from_settings`` or be listed here (with where it goes).
NOT_IN_A_PROCESS_CONFIG = {
    "database_url": "the store (open_store)",
    "home": "the embedded server, the settings file",
    "dag_file_processor_timeout_s": "the DAG bag (engine.launch.app.dag_bag)",
    "log_level": "the process's logging (engine.runtime.logs)",
    "log_format": "the process's logging (engine.runtime.logs)",
    "pool_size": "the store's pool",
    "event_loop": "the runner",
    "metrics_port": "the metrics server (run_component)",
    "metrics_host": "the metrics server (run_component)",
    "metrics_max_series": "the process's Metrics",
    "fernet_key": "the store's keyring",
    "fernet_key_file": "the store's keyring",
    "insecure_dev": "the store's keyring",
    "webserver_host": "deferral webserver",
    "webserver_port": "deferral webserver",
    "webhook_token": "deferral webserver (the asset webhook)",
    "default_timezone": "DAG files (engine.dags)",
    "create_cron_data_intervals": "DAG files (engine.dags)",
}


def _plain(config: msgspec.Struct) -> dict[str, Any]:
    """A config's fields, comparable: the allow-list as its patterns and folder."""
    out = msgspec.structs.asdict(config)
    allow = out.get("allow")
    if isinstance(allow, TriggerAllowList):
        out["allow"] = ("allow-list", allow.patterns, allow.dags_folder)
    return out


def _configs(settings: Settings) -> dict[str, dict[str, Any]]:
    return {cls.__name__: _plain(cls.from_settings(settings)) for cls in CONFIGS}


def _another(name: str, value: Any, folder: Path) -> Any:
    """A valid value of the setting ``name`` other than ``value`` (its default)."""
    if name == "dags_folder":
        return str(folder)
    if name == "trigger_allow":
        return ("mine.*",)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, tuple):
        return ("elsewhere",)
    raise AssertionError(f"give this test another value for the new setting {name!r}")


def test_every_setting_reaches_a_process_config_or_is_listed(tmp_path: Path) -> None:
    """Changed alone, every setting changes some process's config, unless it is listed as
    going elsewhere: a new setting nobody wired fails here."""
    fields = Settings.__struct_fields__
    assert set(NOT_IN_A_PROCESS_CONFIG) <= set(fields), "listed settings that no longer exist"
    defaults = Settings()
    before = _configs(defaults)
    unwired = []
    for name in fields:
        if name in NOT_IN_A_PROCESS_CONFIG:
            continue
        value = _another(name, getattr(defaults, name), tmp_path)
        if _configs(defaults.replace(**{name: value})) == before:
            unwired.append(name)
    assert unwired == [], f"settings no process config carries: {unwired}"


def test_from_settings_carries_each_setting_to_its_field(tmp_path: Path) -> None:
    settings = Settings(
        dags_folder=str(tmp_path),
        worker_slots=3,
        worker_queues=("gpu", "default"),
        parallelism=7,
        worker_poll_interval_s=0.25,
        worker_heartbeat_s=2.0,
        worker_outcome_linger_s=0.02,
        worker_shutdown_grace_s=11.0,
        default_deferrable=True,
        xcom_max_bytes=4096,
        callback_timeout_s=9.5,
        max_map_length=17,
        triggerer_capacity=12,
        triggerer_lease_s=13.0,
        triggerer_poll_interval_s=0.5,
        triggerer_claim_batch=14,
        triggerer_queues=("slow",),
        triggerer_blocked_loop_s=0.3,
        triggerer_cleanup_timeout_s=6.0,
        triggerer_cancel_blocking_after=2,
        triggerer_max_block_s=7.0,
        scheduler_interval_s=0.75,
        zombie_threshold_s=40.0,
        timeout_backstop_grace_s=8.0,
        dag_rescan_interval_s=20.0,
        log_retention_days=3.0,
        log_max_lines_per_s=50,
        log_max_try_bytes=5000,
        log_max_trigger_bytes=6000,
        log_max_line_bytes=700,
        log_buffer_bytes=9000,
        trigger_allow=("mine.*",),
    )
    limits = LogLimits(
        max_lines_per_s=50,
        max_try_bytes=5000,
        max_trigger_bytes=6000,
        max_line_bytes=700,
        buffer_bytes=9000,
    )
    allow = ("allow-list", ("mine.*",), None)
    assert _plain(WorkerConfig.from_settings(settings)) == {
        "slots": 3,
        "queues": ("gpu", "default"),
        "parallelism": 7,
        "poll_interval_s": 0.25,
        "heartbeat_s": 2.0,
        "outcome_linger_s": 0.02,
        "shutdown_grace_s": 11.0,
        "allow": allow,
        "default_deferrable": True,
        "isolation_kill_grace_s": WorkerConfig().isolation_kill_grace_s,  # not a setting
        "log_limits": limits,
        "xcom_max_bytes": 4096,
        "callback_timeout_s": 9.5,
        "max_map_length": 17,
    }
    assert _plain(TriggererConfig.from_settings(settings)) == {
        "capacity": 12,
        "lease_s": 13.0,
        "poll_interval_s": 0.5,
        "claim_batch": 14,
        "blocked_loop_s": 0.3,
        "cleanup_timeout_s": 6.0,
        "cancel_blocking_after": 2,
        "max_block_s": 7.0,
        "allow": allow,
        "dags_folder": str(tmp_path),
        "queues": ("slow",),
        "log_limits": limits,
    }
    assert _plain(SchedulerConfig.from_settings(settings)) == {
        "interval_s": 0.75,
        "zombie_threshold_s": 40.0,
        "timeout_backstop_grace_s": 8.0,
        "dag_rescan_interval_s": 20.0,
        "log_retention_days": 3.0,
    }


def test_a_config_s_defaults_are_its_settings_defaults() -> None:
    """A process built without settings runs as one built from the default settings (but
    for the allow-list, which admits everything when none is given, and the log bounds,
    None meaning theirs)."""
    for cls in CONFIGS:
        built = _plain(cls.from_settings(Settings()))
        default = _plain(cls())
        for field in ("allow", "log_limits", "dags_folder"):
            built.pop(field, None)
            default.pop(field, None)
        assert built == default, cls.__name__
    assert LogLimits.from_settings(Settings()) == LogLimits()


@pytest.mark.anyio
async def test_the_processes_take_their_config_and_its_fields_as_keywords(
    store: Store, tmp_path: Path
) -> None:
    bag = DagBag(None)
    settings = Settings(dags_folder=str(tmp_path), worker_slots=3, triggerer_capacity=9)
    metrics = Metrics()
    worker = make_worker(store, settings, metrics)
    assert _plain(worker.config) == _plain(WorkerConfig.from_settings(settings))
    assert (worker.slots, worker.metrics) == (3, metrics)
    triggerer = make_triggerer(store, settings, metrics)
    assert _plain(triggerer.config) == _plain(TriggererConfig.from_settings(settings))
    assert triggerer.capacity == 9
    assert make_scheduler(store, settings, metrics).config == SchedulerConfig.from_settings(
        settings
    )
    # A keyword named like a field overrides it, over a config given or the defaults.
    config = WorkerConfig(slots=3, heartbeat_s=2.0)
    over = Worker(store, bag, config, slots=5, queues=["a", "b"], metrics=metrics)
    assert over.config == WorkerConfig(slots=5, heartbeat_s=2.0, queues=("a", "b"))
    assert (over.slots, over.heartbeat_s, over.queues) == (5, 2.0, ("a", "b"))
    assert Triggerer(store, capacity=4, metrics=metrics).config == TriggererConfig(capacity=4)
    assert Scheduler(store, None, interval_s=0.5).config == SchedulerConfig(interval_s=0.5)
    # The config's own checks hold for a keyword too.
    with pytest.raises(ValueError, match="slots must be >= 1, got 0"):
        Worker(store, bag, slots=0, metrics=metrics)
    with pytest.raises(ValueError, match="queues must name at least one queue"):
        Triggerer(store, queues=(), metrics=metrics)


@pytest.mark.anyio
async def test_an_unknown_keyword_is_a_type_error_naming_it(store: Store) -> None:
    metrics = Metrics()
    with pytest.raises(TypeError, match=r"Worker\(\) .* 'slotz': not a field of WorkerConfig"):
        Worker(store, DagBag(None), slotz=3, metrics=metrics)
    with pytest.raises(TypeError, match=r"Triggerer\(\) .* 'lease': not a field of Trigger"):
        Triggerer(store, lease=3.0, metrics=metrics)
    with pytest.raises(TypeError, match=r"Scheduler\(\) .* 'interval'.*\(interval_s, "):
        Scheduler(store, None, interval=1.0)
