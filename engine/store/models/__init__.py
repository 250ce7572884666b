"""Every struct a store method takes or returns, one module per reader: models/<reader>.py
holds the structs of engine/store/<reader>.py (models/downstream.py: the rows a write moved,
which engine/store/downstream.py settles). Frozen ``msgspec.Struct``s, converted from the
database's records by msgspec a whole result at a time: no ``asyncpg.Record`` leaves
engine/store/. Field names and order are the named query's columns (the CLI's ``--json``
output encodes them as they are). Import them from here (or the public ones from
``engine.store``)."""

from __future__ import annotations

from engine.store.models.assets import (
    AssetEventRow,
    AssetRecord,
    AssetRow,
    AssetRunCreated,
    AssetWatcherRow,
    NewAssetEvent,
    RecordedAssetEvent,
)
from engine.store.models.browse import (
    GridCellCounts,
    GridRun,
    PoolTask,
    RunFilter,
    TriggerGroup,
    TryRecord,
)
from engine.store.models.downstream import FinishedTask, FiredTriggers, MovedTask, TimedOutTask
from engine.store.models.logstore import (
    LoggedTry,
    LogLine,
    TaskLogRow,
    TaskLogs,
    TriggerLogRow,
    TriggerLogs,
)
from engine.store.models.overrides import Override, OverrideTarget, RunOverride
from engine.store.models.pools import PoolRow
from engine.store.models.runs import (
    Dag,
    DagRun,
    DagRunSummary,
    DagSummary,
    EndedRun,
    TaskInstance,
    WorkLeft,
)
from engine.store.models.schedules import DueDag, NewRun, NextRun, RunRow, StartedRun
from engine.store.models.status import (
    AuditRow,
    Backlog,
    DagOverview,
    Fleet,
    FleetTriggerer,
    GridCell,
    OldestWait,
    RunSquare,
    SchedulerRow,
    TaskTry,
    TriggerListing,
    WorkerRow,
)
from engine.store.models.tasks import (
    ClaimedTask,
    Deferral,
    Heartbeat,
    StopRequest,
    TaskClaim,
    TaskOutcome,
    ti_name,
)
from engine.store.models.triggers import (
    ClaimedTrigger,
    RefusedTrigger,
    TriggerClaim,
    TriggererHealth,
    TriggererRow,
    TriggerOutcome,
    TriggerRow,
    TriggerWaiters,
    WaitingTask,
)
from engine.store.models.variables import PrevRun, StoredConnection, VariableRow
from engine.store.models.watchers import (
    ClaimedWatcher,
    WatcherFault,
    WatcherItem,
    WatcherState,
    WatcherSync,
)
from engine.store.models.why import RunWait, TaskWait, WhyTask

__all__ = [
    "AssetEventRow",
    "AssetRecord",
    "AssetRow",
    "AssetRunCreated",
    "AssetWatcherRow",
    "AuditRow",
    "Backlog",
    "ClaimedTask",
    "ClaimedTrigger",
    "ClaimedWatcher",
    "Dag",
    "DagOverview",
    "DagRun",
    "DagRunSummary",
    "DagSummary",
    "Deferral",
    "DueDag",
    "EndedRun",
    "FinishedTask",
    "FiredTriggers",
    "Fleet",
    "FleetTriggerer",
    "GridCell",
    "GridCellCounts",
    "GridRun",
    "Heartbeat",
    "LogLine",
    "LoggedTry",
    "MovedTask",
    "NewAssetEvent",
    "NewRun",
    "NextRun",
    "OldestWait",
    "Override",
    "OverrideTarget",
    "PoolRow",
    "PoolTask",
    "PrevRun",
    "RecordedAssetEvent",
    "RefusedTrigger",
    "RunFilter",
    "RunOverride",
    "RunRow",
    "RunSquare",
    "RunWait",
    "SchedulerRow",
    "StartedRun",
    "StopRequest",
    "StoredConnection",
    "TaskClaim",
    "TaskInstance",
    "TaskLogRow",
    "TaskLogs",
    "TaskOutcome",
    "TaskTry",
    "TaskWait",
    "TimedOutTask",
    "TriggerClaim",
    "TriggerGroup",
    "TriggerListing",
    "TriggerLogRow",
    "TriggerLogs",
    "TriggerOutcome",
    "TriggerRow",
    "TriggerWaiters",
    "TriggererHealth",
    "TriggererRow",
    "TryRecord",
    "VariableRow",
    "WaitingTask",
    "WatcherFault",
    "WatcherItem",
    "WatcherState",
    "WatcherSync",
    "WhyTask",
    "WorkLeft",
    "WorkerRow",
    "ti_name",
]
