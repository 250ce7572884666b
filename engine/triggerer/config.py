"""``TriggererConfig``: everything a triggerer is configured with, in one frozen value built
from the settings in one place (:meth:`TriggererConfig.from_settings`). Its collaborators
(the store, the metrics) are not configuration: the constructor takes them apart."""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec

from engine.config import (
    DEFAULT_BLOCKED_LOOP_S,
    DEFAULT_CLAIM_BATCH,
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_TRIGGERER_CAPACITY,
    DEFAULT_TRIGGERER_LEASE_S,
    DEFAULT_TRIGGERER_MAX_BLOCK_S,
    Settings,
)
from engine.security.allow import TriggerAllowList
from engine.usercode.loglimits import LogLimits
from operators.base import DEFAULT_QUEUE

__all__ = ["TriggererConfig"]


class TriggererConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How a triggerer runs; each field's default is the default of its setting (named in
    its comment). Built with :meth:`from_settings` by the engine's processes; tests give a
    few fields as keyword arguments of ``Triggerer`` (the others keep their defaults)."""

    #: Triggers run at once (setting ``triggerer_capacity``).
    capacity: int = DEFAULT_TRIGGERER_CAPACITY
    #: The lease on the database clock (setting ``triggerer_lease_s``).
    lease_s: float = DEFAULT_TRIGGERER_LEASE_S
    #: The claim loop's polling backstop to LISTEN (setting ``triggerer_poll_interval_s``).
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    #: Triggers claimed per statement (setting ``triggerer_claim_batch``).
    claim_batch: int = DEFAULT_CLAIM_BATCH
    #: A longer block of the loop is logged (setting ``triggerer_blocked_loop_s``).
    blocked_loop_s: float = DEFAULT_BLOCKED_LOOP_S
    #: How long a trigger's ``cleanup()`` may take (setting ``triggerer_cleanup_timeout_s``).
    cleanup_timeout_s: float = 5.0
    #: Cancel a trigger after this many blocks; 0: never (setting
    #: ``triggerer_cancel_blocking_after``).
    cancel_blocking_after: int = 0
    #: A trigger blocking the loop longer fails its tasks (setting ``triggerer_max_block_s``).
    max_block_s: float = DEFAULT_TRIGGERER_MAX_BLOCK_S
    #: The trigger allow-list checked at start (setting ``trigger_allow``); None admits every
    #: classpath.
    allow: Callable[[str], bool] | None = None
    #: Trigger modules in this folder are imported again when their file changes (setting
    #: ``dags_folder``); None watches nothing.
    dags_folder: str | os.PathLike[str] | None = None
    #: The trigger queues whose triggers the triggerer claims (setting ``triggerer_queues``).
    queues: tuple[str, ...] = (DEFAULT_QUEUE,)
    #: The bounds of the stored log lines (settings ``log_*``); None: their defaults.
    log_limits: LogLimits | None = None

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if not self.queues:
            raise ValueError("queues must name at least one queue")
        if not isinstance(self.queues, tuple):  # (a list given as a keyword argument)
            msgspec.structs.force_setattr(self, "queues", tuple(self.queues))

    @classmethod
    def from_settings(cls, settings: Settings) -> TriggererConfig:
        """The triggerer's config the settings give."""
        return cls(
            capacity=settings.triggerer_capacity,
            lease_s=settings.triggerer_lease_s,
            poll_interval_s=settings.triggerer_poll_interval_s,
            claim_batch=settings.triggerer_claim_batch,
            blocked_loop_s=settings.triggerer_blocked_loop_s,
            cleanup_timeout_s=settings.triggerer_cleanup_timeout_s,
            cancel_blocking_after=settings.triggerer_cancel_blocking_after,
            max_block_s=settings.triggerer_max_block_s,
            allow=TriggerAllowList.from_settings(settings),
            dags_folder=settings.dags_folder,
            queues=settings.triggerer_queues,
            log_limits=LogLimits.from_settings(settings),
        )
