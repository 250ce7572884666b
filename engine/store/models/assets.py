"""The structs of engine/store/assets.py: assets, their watchers and their events."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

import msgspec

__all__ = [
    "AssetEventRow",
    "AssetRecord",
    "AssetRow",
    "AssetRunCreated",
    "AssetWatcherRow",
    "NewAssetEvent",
    "RecordedAssetEvent",
]

#: Who recorded an asset event.
AssetEventSource = Literal["task", "watcher", "webhook", "cli"]


class NewAssetEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An asset event to record (:meth:`engine.store.Store.record_asset_events`): its asset's
    name, its ``extra`` (JSON data) and who records it (``source_name``: a watcher's name;
    who, for the webhook and the CLI; a task's dag/run/task/map index for a task)."""

    asset: str
    extra: dict[str, Any] = {}
    source_kind: AssetEventSource
    source_name: str | None = None
    source_dag_id: str | None = None
    source_run_id: str | None = None
    source_task_id: str | None = None
    source_map_index: int | None = None


class RecordedAssetEvent(msgspec.Struct, frozen=True):
    """An event written: its id, asset and time."""

    id: int
    asset: str
    timestamp: dt.datetime


class AssetEventRow(msgspec.Struct, frozen=True, kw_only=True):
    """A stored asset event (``deferral assets events``, a run's triggering events)."""

    id: int
    asset: str
    uri: str
    extra: dict[str, Any]
    source_kind: str
    source_dag_id: str | None
    source_run_id: str | None
    source_task_id: str | None
    source_map_index: int | None
    source_name: str | None
    timestamp: dt.datetime
    #: The run it triggered (only for a run's triggering events).
    dag_run_id: int | None = None


class AssetRow(msgspec.Struct, frozen=True, kw_only=True):
    """An asset as ``deferral assets list`` shows it."""

    name: str
    uri: str
    group: str
    extra: dict[str, Any]
    updated_at: dt.datetime
    #: ``[{"name": ..., "classpath": ...}, ...]`` (the triggerer's runtime may add keys).
    watchers: list[dict[str, Any]]
    last_event_id: int | None
    last_event_at: dt.datetime | None
    last_event_source: str | None
    scheduled_dags: list[str]
    producing_dags: list[str]


class AssetRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What the DAG scan records of one asset a DAG uses: its definition, how the DAG uses it
    (``roles``: ``schedule``, ``outlet``) and its watchers (name, classpath, encoded kwargs)."""

    name: str
    uri: str
    group: str
    extra: dict[str, Any]
    roles: list[str]
    watchers: list[tuple[str, str, bytes]] = []


class AssetWatcherRow(msgspec.Struct, frozen=True):
    """A watcher as declared: its asset, name and trigger (classpath, encoded kwargs)."""

    asset: str
    name: str
    classpath: str
    kwargs: bytes


class AssetRunCreated(msgspec.Struct, frozen=True):
    """An asset-triggered run the scheduler created, and how many events it consumed."""

    id: int
    dag_id: str
    run_id: str
    events: int
