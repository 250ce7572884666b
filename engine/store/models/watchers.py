"""The structs of engine/store/watchers.py: asset watchers as the triggerer runs them."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

__all__ = ["ClaimedWatcher", "WatcherFault", "WatcherItem", "WatcherState", "WatcherSync"]


class ClaimedWatcher(msgspec.Struct, frozen=True, kw_only=True):
    """A claimed trigger row that runs an asset watcher, and the cursor it starts from."""

    trigger_id: int
    asset: str
    name: str
    #: Encoded (``triggers.base.decode_value`` reads it); None: no cursor stored yet.
    cursor: bytes | None = None
    restarts: int = 0


class WatcherItem(msgspec.Struct, frozen=True, kw_only=True):
    """What one event of a watcher's trigger writes: an asset event (``is_event``) with its
    ``extra``, and the trigger's cursor after it (``has_cursor``), under the fence the trigger
    was claimed with."""

    trigger_id: int
    fence: int
    extra: dict[str, Any] | None = None
    is_event: bool = True
    #: Encoded (``triggers.base.encode_value``).
    cursor: bytes | None = None
    has_cursor: bool = False
    #: Its place in its run (1, 2, ...): written once, even when its batch is written again.
    seq: int = 0


class WatcherFault(msgspec.Struct, frozen=True, kw_only=True):
    """A watcher's trigger raised (or ended): the error, and the backoff before it starts
    again."""

    trigger_id: int
    fence: int
    error: str
    retry_in_s: float
    #: Whether the trigger starts again after it (False: an event of a trigger that runs on
    #: could not be stored; recorded as its last error, no restart counted, no backoff).
    restart: bool = True


class WatcherSync(msgspec.Struct, frozen=True, kw_only=True):
    """What a reconciliation of the watchers' trigger rows did."""

    stopped: int
    started: int


class WatcherState(msgspec.Struct, frozen=True, kw_only=True):
    """A watcher as it runs: its trigger row and that row's triggerer (none: no triggerer
    runs it now), the events it recorded, its restarts and last fault."""

    asset: str
    name: str
    classpath: str
    trigger_id: int | None
    triggerer_id: int | None
    hostname: str | None
    pid: int | None
    events: int
    restarts: int
    last_error: str | None
    last_error_at: dt.datetime | None
    retry_at: dt.datetime | None
    #: Encoded (``triggers.base.decode_value`` reads it).
    cursor: bytes | None = None
