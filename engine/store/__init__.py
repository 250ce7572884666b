"""PostgreSQL, through asyncpg: the one coordination point of every process."""

from __future__ import annotations

import anyio

from engine.config import Settings
from engine.masking import register_url_password
from engine.security.keys import keyring_from_settings
from engine.store.connection import (
    CHANNEL_DEADLINES,
    CHANNEL_FINISHED,
    CHANNEL_RUNS,
    CHANNEL_STOP,
    CHANNEL_TASKS,
    CHANNEL_TRIGGERS,
    Listener,
)
from engine.store.embedded import EmbeddedServerError, embedded_database_url
from engine.store.models import (
    ClaimedTask,
    ClaimedTrigger,
    Dag,
    DagRun,
    DagRunSummary,
    DagSummary,
    Deferral,
    EndedRun,
    FinishedTask,
    FiredTriggers,
    LoggedTry,
    LogLine,
    MovedTask,
    Override,
    TaskClaim,
    TaskInstance,
    TaskLogs,
    TaskOutcome,
    TaskTry,
    TimedOutTask,
    TriggerClaim,
    TriggererRow,
    TriggerLogs,
    TriggerOutcome,
    TriggerRow,
    TriggerWaiters,
    WaitingTask,
    WorkLeft,
)
from engine.store.overrides import MARK_STATES, VIA_PAGE
from engine.store.pools import PoolInUse, PoolNotFound
from engine.store.runs import DagRunNotFound, UnknownDag
from engine.store.schedules import DuplicateRun
from engine.store.store import Store

__all__ = [
    "CHANNEL_DEADLINES",
    "CHANNEL_FINISHED",
    "CHANNEL_RUNS",
    "CHANNEL_STOP",
    "CHANNEL_TASKS",
    "CHANNEL_TRIGGERS",
    "MARK_STATES",
    "VIA_PAGE",
    "ClaimedTask",
    "ClaimedTrigger",
    "Dag",
    "DagRun",
    "DagRunNotFound",
    "DagRunSummary",
    "DagSummary",
    "Deferral",
    "DuplicateRun",
    "EmbeddedServerError",
    "EndedRun",
    "FinishedTask",
    "FiredTriggers",
    "Listener",
    "LogLine",
    "LoggedTry",
    "MovedTask",
    "Override",
    "PoolInUse",
    "PoolNotFound",
    "Store",
    "TaskClaim",
    "TaskInstance",
    "TaskLogs",
    "TaskOutcome",
    "TaskTry",
    "TimedOutTask",
    "TriggerClaim",
    "TriggerLogs",
    "TriggerOutcome",
    "TriggerRow",
    "TriggerWaiters",
    "TriggererRow",
    "UnknownDag",
    "WaitingTask",
    "WorkLeft",
    "database_url",
    "open_store",
]


def database_url(settings: Settings) -> str:
    """The configured URL, or the embedded server's (started on first use)."""
    url = settings.database_url or embedded_database_url(settings.home_path)
    # Its password is masked wherever this process shows values (also the embedded server's,
    # generated on first use).
    register_url_password(url)
    return url


async def open_store(settings: Settings, *, migrate: bool = True) -> Store:
    """Connect (starting the embedded server if needed) and bring the schema up to date, with
    the encryption keys the settings name (``MissingKeyError`` with an external database and
    no key, unless ``insecure_dev``)."""
    keyring = keyring_from_settings(settings)
    url = await anyio.to_thread.run_sync(database_url, settings)
    return await Store.connect(url, pool_size=settings.pool_size, migrate=migrate, keyring=keyring)
