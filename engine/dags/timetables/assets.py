"""``schedule=[a, b]`` or ``schedule=a & b | c``: runs triggered by asset events.

The scheduler creates no run of such a DAG from the clock: a run is created once the DAG's
asset condition holds over the events queued for it since its last asset-triggered run
(``create_asset_runs``, engine/store/assets.sql), and takes every queued event with it."""

from __future__ import annotations

from typing import Any

from engine.dags.timetables.base import DagRunInfo, ScheduleError, Timetable
from operators.assets import Asset, AssetAll, AssetCondition, summary

__all__ = ["AssetTriggeredTimetable", "asset_schedule"]


class AssetTriggeredTimetable(Timetable):
    """Runs triggered by asset events (``condition``: what must have new events)."""

    periodic = False

    def __init__(self, condition: dict[str, Any], text: str) -> None:
        self.condition = condition
        self.summary = text

    def next_dagrun_info(self, **_: Any) -> DagRunInfo | None:
        return None

    def runs_between(self, earliest: Any, latest: Any) -> Any:
        return iter(())

    def dump(self) -> dict[str, Any]:
        return {"kind": "assets", "condition": self.condition, "summary": self.summary}

    @classmethod
    def load(cls, data: dict[str, Any]) -> AssetTriggeredTimetable:
        return cls(data["condition"], str(data.get("summary") or ""))


def asset_schedule(schedule: object) -> AssetCondition | None:
    """The asset condition of a DAG's ``schedule`` (a list of assets: all of them), or None
    when it is no asset schedule. A list mixing assets with anything else is a
    ScheduleError."""
    if isinstance(schedule, AssetCondition):
        return schedule
    if isinstance(schedule, list | tuple | set | frozenset):
        items = list(schedule)
        if not items:
            raise ScheduleError("a list schedule needs at least one Asset")
        wrong = [i for i in items if not isinstance(i, AssetCondition)]
        if wrong:
            raise ScheduleError(
                "a list schedule holds assets (Asset, AssetAll, AssetAny) only; it cannot mix "
                f"them with {type(wrong[0]).__name__} {wrong[0]!r} (a cron or time schedule "
                "and assets cannot be combined)"
            )
        return items[0] if len(items) == 1 and isinstance(items[0], Asset) else AssetAll(*items)
    return None


def make_asset_timetable(condition: AssetCondition) -> AssetTriggeredTimetable:
    return AssetTriggeredTimetable(condition.serialize(), summary(condition))
