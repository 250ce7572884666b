"""PostgreSQL, through asyncpg: the one coordination point of every process.

Where things live in this package:

* **SQL** only in .sql files: the named queries in ``queries.sql``, the schema in
  ``schema.sql`` (what ``migrations/`` build, applied in order).
* **Connections apart from queries**: ``connection.py`` makes the pool, applies the
  migrations and listens (``Listener``); ``core.py`` is what every reader shares.
* **Queries by reader**: one class per part of the engine, each holding the methods of its
  named queries: ``tasks.py`` (workers and their tries), ``triggers.py`` (triggerers and their
  triggers), ``runs.py`` (DAGs, runs, task instances), ``schedules.py``, ``pools.py``,
  ``overrides.py`` (mark, clear), ``status.py`` (the status page), ``logstore.py``, ``why.py``,
  ``rotation.py``. :class:`Store` (``store.py``) derives from them all and is the one public
  class. A statement that another connection runs too (the triggerer's lease connection,
  ``session.py``) is a function taking the connection, in its reader's module.
* **Row structs**: every struct a store method takes or returns is in
  ``models/<reader>.py``, for the reader of that name (``models/downstream.py``: the rows a
  write moved); reader modules define none. Import them from ``engine.store.models`` (the
  public ones from here).
* **Settling** (``downstream.py``): the store's writes and claims settle nothing; the process
  that wrote them settles what they moved. A claim returns what it took that cannot run
  (``refused``) unwritten, for the worker or triggerer to write through its outbox like every
  outcome. (Only a mark or a clear, ``overrides.py``, settles what it changed before it
  returns: a person's action, with no process of its own behind it.)
"""

from __future__ import annotations

import anyio

from engine.config import Settings
from engine.masking import register_url_password
from engine.security.keys import keyring_from_settings
from engine.store.assets import CHANNEL_ASSETS, AssetConflict
from engine.store.connection import (
    CHANNEL_DEADLINES,
    CHANNEL_FINISHED,
    CHANNEL_RUNS,
    CHANNEL_STOP,
    CHANNEL_TASKS,
    CHANNEL_TRIGGERS,
    HANDED_UNREAD_S,
    PAYLOAD_CALLBACKS,
    PAYLOAD_HANDED,
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
    ti_name,
)
from engine.store.overrides import MARK_STATES, VIA_PAGE
from engine.store.pools import PoolInUse, PoolNotFound
from engine.store.runs import DagRunNotFound, UnknownDag
from engine.store.schedules import DuplicateRun
from engine.store.store import Store

__all__ = [
    "CHANNEL_ASSETS",
    "CHANNEL_DEADLINES",
    "CHANNEL_FINISHED",
    "CHANNEL_RUNS",
    "CHANNEL_STOP",
    "CHANNEL_TASKS",
    "CHANNEL_TRIGGERS",
    "HANDED_UNREAD_S",
    "MARK_STATES",
    "PAYLOAD_CALLBACKS",
    "PAYLOAD_HANDED",
    "VIA_PAGE",
    "AssetConflict",
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
    "ti_name",
]


def database_url(settings: Settings) -> str:
    """The configured URL, or the embedded server's (started on first use)."""
    url = settings.database_url or embedded_database_url(settings.home_path)
    # Its password is masked wherever this process shows values (also the embedded server's,
    # generated on first use).
    register_url_password(url)
    return url


async def open_store(settings: Settings, *, migrate: bool = True, warm: bool = False) -> Store:
    """Connect (starting the embedded server if needed) and bring the schema up to date, with
    the encryption keys the settings name (``MissingKeyError`` with an external database and
    no key, unless ``insecure_dev``). ``warm``: all ``pool_size`` connections opened now and
    kept (see ``create_pool``)."""
    keyring = keyring_from_settings(settings)
    url = await anyio.to_thread.run_sync(database_url, settings)
    return await Store.connect(
        url, pool_size=settings.pool_size, migrate=migrate, keyring=keyring, warm=warm
    )
