"""``WorkerConfig``: everything a worker is configured with, in one frozen value built from
the settings in one place (:meth:`WorkerConfig.from_settings`). The worker's collaborators
(its store, DAG bag and metrics) are not configuration: the constructor takes them apart."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from engine.config import (
    DEFAULT_CALLBACK_TIMEOUT_S,
    DEFAULT_MAX_MAP_LENGTH,
    DEFAULT_OUTCOME_LINGER_S,
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_WORKER_SLOTS,
    DEFAULT_XCOM_MAX_BYTES,
    Settings,
)
from engine.security.allow import TriggerAllowList
from engine.usercode.loglimits import LogLimits
from engine.worker.isolation import DEFAULT_KILL_GRACE_S
from operators.base import DEFAULT_QUEUE

__all__ = ["WorkerConfig"]


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How a worker runs; each field's default is the default of its setting (named in its
    comment). Built with :meth:`from_settings` by the engine's processes; tests give a few
    fields as keyword arguments of ``Worker`` (the others keep their defaults)."""

    #: Tries run at once (setting ``worker_slots``).
    slots: int = DEFAULT_WORKER_SLOTS
    #: The queues whose tasks the worker claims (setting ``worker_queues``).
    queues: tuple[str, ...] = (DEFAULT_QUEUE,)
    #: Running tasks across all workers at once; 0: no limit (setting ``parallelism``).
    parallelism: int = 0
    #: The claim loop's polling backstop to LISTEN (setting ``worker_poll_interval_s``).
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    #: Between two heartbeats (setting ``worker_heartbeat_s``).
    heartbeat_s: float = 5.0
    #: How long an outcome write waits for more while writes follow closely; 0: never
    #: (setting ``worker_outcome_linger_s``).
    outcome_linger_s: float = DEFAULT_OUTCOME_LINGER_S
    #: How long running tries may finish after a stop (setting ``worker_shutdown_grace_s``).
    shutdown_grace_s: float = 30.0
    #: The trigger allow-list checked at defer time (setting ``trigger_allow``); None admits
    #: every classpath.
    allow: Callable[[str], bool] | None = None
    #: What a sensor created with ``deferrable=None`` does (setting ``default_deferrable``).
    default_deferrable: bool = False
    #: How long an isolated try's child has to exit once asked, before it is killed.
    isolation_kill_grace_s: float = DEFAULT_KILL_GRACE_S
    #: The bounds of the stored log lines (settings ``log_*``); None: their defaults.
    log_limits: LogLimits | None = None
    #: The largest return value or pushed XCom, encoded (setting ``xcom_max_bytes``).
    xcom_max_bytes: int = DEFAULT_XCOM_MAX_BYTES
    #: How long a callback may run (setting ``callback_timeout_s``).
    callback_timeout_s: float = DEFAULT_CALLBACK_TIMEOUT_S
    #: The most instances of one mapped task (setting ``max_map_length``).
    max_map_length: int = DEFAULT_MAX_MAP_LENGTH

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.outcome_linger_s < 0:
            raise ValueError(f"outcome_linger_s must be >= 0, got {self.outcome_linger_s}")
        if not self.queues:
            raise ValueError("queues must name at least one queue")
        if not isinstance(self.queues, tuple):  # (a list given as a keyword argument)
            msgspec.structs.force_setattr(self, "queues", tuple(self.queues))

    @classmethod
    def from_settings(cls, settings: Settings) -> WorkerConfig:
        """The worker's config the settings give."""
        return cls(
            slots=settings.worker_slots,
            queues=settings.worker_queues,
            parallelism=settings.parallelism,
            poll_interval_s=settings.worker_poll_interval_s,
            heartbeat_s=settings.worker_heartbeat_s,
            outcome_linger_s=settings.worker_outcome_linger_s,
            shutdown_grace_s=settings.worker_shutdown_grace_s,
            allow=TriggerAllowList.from_settings(settings),
            default_deferrable=settings.default_deferrable,
            log_limits=LogLimits.from_settings(settings),
            xcom_max_bytes=settings.xcom_max_bytes,
            callback_timeout_s=settings.callback_timeout_s,
            max_map_length=settings.max_map_length,
        )
