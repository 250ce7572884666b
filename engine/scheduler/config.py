"""``SchedulerConfig``: everything a scheduler is configured with, in one frozen value built
from the settings in one place (:meth:`SchedulerConfig.from_settings`). Its collaborators
(the store, the DAG bag, the metrics) are not configuration: the constructor takes them
apart."""

from __future__ import annotations

import msgspec

from engine.config import DEFAULT_DAG_RESCAN_INTERVAL_S, DEFAULT_LOG_RETENTION_DAYS, Settings

__all__ = ["SchedulerConfig"]


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How a scheduler runs; each field's default is the default of its setting (named in
    its comment). Built with :meth:`from_settings` by the engine's processes; tests give a
    few fields as keyword arguments of ``Scheduler`` (the others keep their defaults)."""

    #: Seconds between two passes at most, and between two rounds of the duties run every
    #: pass (setting ``scheduler_interval_s``).
    interval_s: float = 1.0
    #: A worker silent this long is dead (setting ``zombie_threshold_s``).
    zombie_threshold_s: float = 30.0
    #: How late a deferral deadline may be before the scheduler ends it (setting
    #: ``timeout_backstop_grace_s``).
    timeout_backstop_grace_s: float = 5.0
    #: Seconds between two scans of the DAGs folder (setting ``dag_rescan_interval_s``).
    dag_rescan_interval_s: float = DEFAULT_DAG_RESCAN_INTERVAL_S
    #: Log lines older than this many days are deleted; 0: kept forever (setting
    #: ``log_retention_days``).
    log_retention_days: float = DEFAULT_LOG_RETENTION_DAYS

    @classmethod
    def from_settings(cls, settings: Settings) -> SchedulerConfig:
        """The scheduler's config the settings give."""
        return cls(
            interval_s=settings.scheduler_interval_s,
            zombie_threshold_s=settings.zombie_threshold_s,
            timeout_backstop_grace_s=settings.timeout_backstop_grace_s,
            dag_rescan_interval_s=settings.dag_rescan_interval_s,
            log_retention_days=settings.log_retention_days,
        )
