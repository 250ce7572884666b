"""Assets: named data that tasks update and DAGs are scheduled on (Airflow's ``Asset``).

``Asset(name, uri=None, group="asset", extra=None, watchers=None)``; ``a & b`` is
:class:`AssetAll` (runs once both have new events), ``a | b`` :class:`AssetAny` (once either
has). ``DAG(schedule=[a, b])`` is ``AssetAll(a, b)``. A task with ``outlets=[a]`` records an
event of ``a`` when it succeeds, with the ``extra`` it set on
``context["outlet_events"][a].extra``. :class:`AssetWatcher` pairs a name with an event
trigger the triggerer runs; each event it yields becomes an asset event.

This module is a contract: it imports no runtime.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import msgspec

from triggers.base import BaseEventTrigger, BaseTrigger, TriggerSerializationError, validate_trigger

__all__ = [
    "MAX_NAME_LENGTH",
    "Asset",
    "AssetAll",
    "AssetAny",
    "AssetCondition",
    "AssetEvent",
    "AssetWatcher",
    "OutletEventAccessor",
    "OutletEventAccessors",
    "TriggeringAssetEvents",
    "check_extra",
]

#: The longest asset name, uri or watcher name (Airflow's limit).
MAX_NAME_LENGTH = 1500


def _check_identifier(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    if not value or not value.strip():
        raise ValueError(f"{what} must not be empty")
    if len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"{what} must be at most {MAX_NAME_LENGTH} characters, got {len(value)}")
    if not value.isascii() or not value.isprintable():
        raise ValueError(f"{what} must be printable ASCII characters, got {value!r}")
    if value != value.strip():
        raise ValueError(f"{what} must not start or end with spaces, got {value!r}")
    return value


def check_extra(what: str, extra: object) -> dict[str, Any]:
    """``extra`` as stored: a dict with str keys that encodes as JSON (msgspec); a clear
    ValueError otherwise."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
        raise ValueError(f"{what} must be a dict with str keys, got {type(extra).__name__}")
    try:
        data: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(dict(extra)))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{what} must be JSON data: {exc}") from None
    if _has_nul(data):
        raise ValueError(f"{what} holds a NUL character, which cannot be stored")
    return data


def _has_nul(value: object) -> bool:
    """Whether decoded JSON data holds a NUL character (no jsonb can store one)."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


class AssetCondition:
    """What a DAG can be scheduled on: an :class:`Asset`, or all/any of several."""

    def __and__(self, other: object) -> AssetAll:
        if not isinstance(other, AssetCondition):
            return NotImplemented
        return AssetAll(self, other)

    def __or__(self, other: object) -> AssetAny:
        if not isinstance(other, AssetCondition):
            return NotImplemented
        return AssetAny(self, other)

    def iter_assets(self) -> Iterator[Asset]:
        raise NotImplementedError

    def serialize(self) -> dict[str, Any]:
        """The condition as the store evaluates it: ``{"asset": name}``, ``{"all": [...]}``,
        ``{"any": [...]}``."""
        raise NotImplementedError

    def evaluate(self, present: set[str]) -> bool:
        """Whether it holds when the assets named in ``present`` have new events."""
        raise NotImplementedError


class AssetWatcher:
    """``AssetWatcher(name, trigger)``: an event trigger the triggerer runs for an asset; each
    event it yields is an event of the asset. ``name``: unique among the asset's watchers."""

    def __init__(self, name: str, trigger: BaseEventTrigger) -> None:
        self.name = _check_identifier("AssetWatcher name", name)
        if not isinstance(trigger, BaseEventTrigger):
            kind = (
                "a trigger that ends at its first event"
                if isinstance(trigger, BaseTrigger)
                else "not a trigger"
            )
            raise TypeError(
                f"AssetWatcher {name!r}: trigger must be an event trigger (a BaseEventTrigger, "
                f"such as triggers.events.DirectoryTrigger), got {type(trigger).__name__}, "
                f"{kind}"
            )
        try:
            self.serialized = validate_trigger(trigger)
        except TriggerSerializationError as exc:
            raise TriggerSerializationError(f"AssetWatcher {name!r}: {exc}") from None
        self.trigger = trigger

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, AssetWatcher)
            and self.name == other.name
            and self.serialized == other.serialized
        )

    def __hash__(self) -> int:
        return hash(("AssetWatcher", self.name))

    def __repr__(self) -> str:
        return f"AssetWatcher({self.name!r}, {self.serialized.classpath})"


class Asset(AssetCondition):
    """``Asset(name, uri=None, group="asset", extra=None, watchers=None)``. With only a name,
    the uri is the name; with only a uri (``Asset(uri=...)``), the name is the uri. Two assets
    are equal when name and uri are."""

    def __init__(
        self,
        name: str | None = None,
        uri: str | None = None,
        *,
        group: str = "asset",
        extra: Mapping[str, Any] | None = None,
        watchers: list[AssetWatcher] | None = None,
    ) -> None:
        if name is None and uri is None:
            raise TypeError("Asset() needs a name or a uri")
        self.name = _check_identifier("Asset name", name if name is not None else uri)
        self.uri = _check_identifier(f"Asset {self.name!r}: uri", uri if uri is not None else name)
        self.group = _check_identifier(f"Asset {self.name!r}: group", group)
        self.extra = check_extra(f"Asset {self.name!r}: extra", extra)
        found: list[AssetWatcher] = []
        for watcher in watchers or []:
            if not isinstance(watcher, AssetWatcher):
                raise TypeError(
                    f"Asset {self.name!r}: watchers must be AssetWatcher values, got "
                    f"{type(watcher).__name__}"
                )
            if any(w.name == watcher.name for w in found):
                raise ValueError(f"Asset {self.name!r}: two watchers named {watcher.name!r}")
            found.append(watcher)
        self.watchers = found

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Asset) and (self.name, self.uri) == (other.name, other.uri)

    def __hash__(self) -> int:
        return hash((self.name, self.uri))

    def __repr__(self) -> str:
        if self.uri == self.name:
            return f"Asset({self.name!r})"
        return f"Asset({self.name!r}, uri={self.uri!r})"

    def same_definition(self, other: Asset) -> bool:
        """Whether both declare the asset alike (uri, group, extra, watchers)."""
        return (self.name, self.uri, self.group, self.extra, self.watchers) == (
            other.name,
            other.uri,
            other.group,
            other.extra,
            other.watchers,
        )

    def iter_assets(self) -> Iterator[Asset]:
        yield self

    def serialize(self) -> dict[str, Any]:
        return {"asset": self.name}

    def evaluate(self, present: set[str]) -> bool:
        return self.name in present


class _Combined(AssetCondition):
    kind = ""

    def __init__(self, *objects: AssetCondition) -> None:
        if not objects:
            raise TypeError(f"{type(self).__name__}() needs at least one asset or condition")
        for obj in objects:
            if not isinstance(obj, AssetCondition):
                raise TypeError(
                    f"{type(self).__name__}() takes assets and asset conditions, got "
                    f"{type(obj).__name__} {obj!r}"
                )
        self.objects: tuple[AssetCondition, ...] = objects

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.objects == other.objects

    def __hash__(self) -> int:
        return hash((self.kind, self.objects))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.objects))})"

    def iter_assets(self) -> Iterator[Asset]:
        for obj in self.objects:
            yield from obj.iter_assets()

    def serialize(self) -> dict[str, Any]:
        return {self.kind: [obj.serialize() for obj in self.objects]}


class AssetAll(_Combined):
    """Holds once every one of its assets (conditions) has new events: ``a & b``."""

    kind = "all"

    def __and__(self, other: object) -> AssetAll:
        if not isinstance(other, AssetCondition):
            return NotImplemented
        return AssetAll(*self.objects, other)

    def evaluate(self, present: set[str]) -> bool:
        return all(obj.evaluate(present) for obj in self.objects)


class AssetAny(_Combined):
    """Holds once any of its assets (conditions) has new events: ``a | b``."""

    kind = "any"

    def __or__(self, other: object) -> AssetAny:
        if not isinstance(other, AssetCondition):
            return NotImplemented
        return AssetAny(*self.objects, other)

    def evaluate(self, present: set[str]) -> bool:
        return any(obj.evaluate(present) for obj in self.objects)


def summary(condition: AssetCondition) -> str:
    """How ``dags list`` shows an asset schedule: ``orders & (customers | daily)``."""
    if isinstance(condition, Asset):
        return condition.name
    assert isinstance(condition, _Combined)
    parts = [summary(o) if isinstance(o, Asset) else f"({summary(o)})" for o in condition.objects]
    return (" & " if condition.kind == "all" else " | ").join(parts)


class OutletEventAccessor:
    """What a task sets of the event its success records for one outlet asset: ``extra``."""

    def __init__(self, asset: Asset) -> None:
        self.asset = asset
        self.extra: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"OutletEventAccessor({self.asset!r}, extra={self.extra!r})"


class OutletEventAccessors(Mapping[Any, OutletEventAccessor]):
    """``context["outlet_events"]``: one accessor per outlet asset of the task, by the
    :class:`Asset` or its name. An asset that is not an outlet of the task is a KeyError
    saying so (its extra would record nothing)."""

    def __init__(self, task_id: str, outlets: list[Asset]) -> None:
        self._task_id = task_id
        self._by_name = {a.name: OutletEventAccessor(a) for a in outlets}

    def __getitem__(self, key: object) -> OutletEventAccessor:
        name = key.name if isinstance(key, Asset) else key
        try:
            return self._by_name[name]  # type: ignore[index]
        except (KeyError, TypeError):
            raise KeyError(
                f"{key!r} is not an outlet of task {self._task_id} (its outlets: "
                f"{', '.join(self._by_name) or 'none'}): only outlets record events"
            ) from None

    def __iter__(self) -> Iterator[Any]:
        return iter(a.asset for a in self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def events(self) -> list[dict[str, Any]]:
        """The events the task's success records: one per outlet, with its extra (checked)."""
        return [
            {
                "asset": name,
                "extra": check_extra(f'outlet_events["{name}"].extra', accessor.extra),
            }
            for name, accessor in self._by_name.items()
        ]


class AssetEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One asset event as a triggered run sees it (``context["triggering_asset_events"]``):
    its id, asset, ``extra``, ``timestamp`` and source (``source_kind``: task, watcher,
    webhook or cli; a task's dag/run/task/map index; a watcher's name)."""

    id: int
    asset: str
    uri: str
    extra: dict[str, Any]
    timestamp: Any
    source_kind: str
    source_dag_id: str | None = None
    source_run_id: str | None = None
    source_task_id: str | None = None
    source_map_index: int | None = None
    source_name: str | None = None


class TriggeringAssetEvents(Mapping[Any, list[AssetEvent]]):
    """``context["triggering_asset_events"]``: the events that triggered the run, by
    :class:`Asset` (or its name), oldest first. Empty for a run not triggered by assets."""

    def __init__(self, events: list[AssetEvent]) -> None:
        self._by_name: dict[str, list[AssetEvent]] = {}
        self._assets: dict[str, Asset] = {}
        for event in events:
            self._by_name.setdefault(event.asset, []).append(event)
            self._assets.setdefault(event.asset, Asset(event.asset, uri=event.uri))

    def __getitem__(self, key: object) -> list[AssetEvent]:
        name = key.name if isinstance(key, Asset) else key
        if not isinstance(name, str) or name not in self._by_name:
            raise KeyError(key)
        return self._by_name[name]

    def __iter__(self) -> Iterator[Asset]:
        return iter(self._assets.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def __repr__(self) -> str:
        return f"TriggeringAssetEvents({self._by_name!r})"
