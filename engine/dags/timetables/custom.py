"""Timetables of your own: a class in a DAG file (or a module beside it), written as for
Airflow.

```python
from engine.dags.timetables import DagRunInfo, DataInterval, TimeRestriction, Timetable

class AfterWorkday(Timetable):
    def infer_manual_data_interval(self, *, run_after): ...
    def next_dagrun_info(self, *, last_automated_data_interval, restriction): ...
    # optional: serialize() -> dict (JSON data), deserialize(cls, data) -> instance,
    # summary (what `dags list` shows), can_be_scheduled (False: manual runs only)

with DAG("payroll", schedule=AfterWorkday(), start_date=...): ...
```

The methods receive and may return pendulum DateTimes (Airflow's) or aware datetimes;
``restriction`` is a :class:`TimeRestriction` and ``next_dagrun_info`` returns a
:class:`DagRunInfo` (``DagRunInfo.interval(start, end)``, ``DagRunInfo.exact(at)``) or None.
Subclassing :class:`Timetable` is optional: any object with the two methods is one.

The scheduler rebuilds the timetable from what the store recorded: the class's import path
and ``serialize()``'s data. A process that declared the DAG already knows the class; any other
imports it by path only when the setting ``trigger_allow`` allows that path, the same rule as
trigger classpaths (by default: the modules of the DAGs folder and ``triggers.*``), so whoever
can write to the database cannot make the scheduler import a module of their choosing.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import pendulum

from engine.dags.timetables.base import (
    UTC,
    DagRunInfo,
    DataInterval,
    ScheduleError,
    TimeRestriction,
    Timetable,
    to_aware,
)
from triggers.base import ImportPathError, import_object

__all__ = ["CustomTimetable", "allow_custom_timetables", "is_custom", "load_custom"]

_lock = threading.Lock()
#: The custom timetable classes the DAGs declared in this process use, by import path.
_known: dict[str, type] = {}
#: Whether an import path may be imported (the ``trigger_allow`` rule); None: the default.
_allow: Callable[[str], bool] | None = None


def allow_custom_timetables(allow: Callable[[str], bool] | None) -> None:
    """The rule for importing a custom timetable's class by path in this process (the
    scheduler's: its ``trigger_allow`` list). None: the settings' default."""
    global _allow
    with _lock:
        _allow = allow


def _allowed(path: str) -> bool:
    allow = _allow
    if allow is None:
        from engine.config import ConfigError, load_settings
        from engine.security.allow import TriggerAllowList

        try:
            settings = load_settings()
        except ConfigError:
            return False
        allow = TriggerAllowList.from_setting(settings.trigger_allow, settings.dags_folder)
    return bool(allow(path))


def is_custom(schedule: object) -> bool:
    """Whether ``schedule`` is a timetable of the user's own (not one of the engine's)."""
    if isinstance(schedule, Timetable) and type(schedule).__module__.startswith(
        "engine.dags.timetables."
    ):
        return False
    return callable(getattr(schedule, "next_dagrun_info", None)) and callable(
        getattr(schedule, "infer_manual_data_interval", None)
    )


def _pendulum(value: dt.datetime | None) -> Any:
    return None if value is None else pendulum.instance(value.astimezone(UTC))


def _utc(value: Any, what: str) -> dt.datetime:
    if not isinstance(value, dt.datetime) or value.tzinfo is None:
        raise ScheduleError(f"{what} must be an aware datetime, got {value!r}")
    return to_aware(value)


def _interval(value: Any, what: str) -> DataInterval:
    start, end = getattr(value, "start", None), getattr(value, "end", None)
    return DataInterval(_utc(start, f"{what}.start"), _utc(end, f"{what}.end"))


class CustomTimetable(Timetable):
    """The engine's side of a user's timetable object (Airflow's interface)."""

    def __init__(self, user: Any) -> None:
        self.user = user
        cls = type(user)
        self.path = f"{cls.__module__}.{cls.__qualname__}"
        if "<" in cls.__qualname__ or "." in cls.__qualname__:
            raise ScheduleError(
                f"timetable class {self.path} must be defined at the top level of its module "
                "(the scheduler imports it by that path)"
            )
        summary = getattr(user, "summary", None)
        self.summary = summary if isinstance(summary, str) and summary else cls.__name__
        self.periodic = bool(getattr(user, "can_be_scheduled", getattr(user, "periodic", True)))
        limit = getattr(user, "active_runs_limit", None)
        self.active_runs_limit = limit if isinstance(limit, int) else None
        serialize = getattr(user, "serialize", None)
        data = serialize() if callable(serialize) else {}
        try:
            self.data = msgspec.json.decode(msgspec.json.encode(data))
        except (TypeError, ValueError) as exc:
            raise ScheduleError(f"{self.path}.serialize() must return JSON data: {exc}") from None
        with _lock:
            _known[self.path] = cls

    def next_dagrun_info(
        self,
        *,
        last: DataInterval | None,
        earliest: dt.datetime | None,
        latest: dt.datetime | None,
        catchup: bool,
        now: dt.datetime,
    ) -> DagRunInfo | None:
        if not self.periodic:
            return None
        last_given = None if last is None else _AirflowInterval(
            _pendulum(last.start), _pendulum(last.end)
        )  # fmt: skip
        restriction = TimeRestriction(_pendulum(earliest), _pendulum(latest), catchup)
        info = self.user.next_dagrun_info(
            last_automated_data_interval=last_given, restriction=restriction
        )
        if info is None:
            return None
        what = f"{self.path}.next_dagrun_info()"
        interval = _interval(getattr(info, "data_interval", None), f"{what}.data_interval")
        return DagRunInfo(interval, _utc(getattr(info, "run_after", None), f"{what}.run_after"))

    def infer_manual_data_interval(self, run_after: dt.datetime) -> DataInterval:
        found = self.user.infer_manual_data_interval(run_after=_pendulum(run_after))
        if found is None:
            return DataInterval.exact(run_after)
        return _interval(found, f"{self.path}.infer_manual_data_interval()")

    def dump(self) -> dict[str, Any]:
        return {"kind": "custom", "classpath": self.path, "data": self.data}


class _AirflowInterval(msgspec.Struct, frozen=True):
    """The last interval as a custom timetable reads it (pendulum DateTimes)."""

    start: Any
    end: Any


def load_custom(data: dict[str, Any]) -> CustomTimetable:
    """Rebuild a custom timetable from what :meth:`CustomTimetable.dump` stored."""
    path = str(data.get("classpath", ""))
    cls = _known.get(path)
    if cls is None:
        if not _allowed(path):
            raise ScheduleError(
                f"timetable class {path!r} is not allowed by the setting trigger_allow (the "
                "scheduler imports a custom timetable by path only when that list allows it; "
                "by default, the modules of the DAGs folder)"
            )
        try:
            found = import_object(
                path,
                "timetable class",
                accept=lambda obj: isinstance(obj, type),
                wanted="a class",
            )
        except ImportPathError as exc:
            raise ScheduleError(str(exc)) from None
        cls = found
    deserialize = getattr(cls, "deserialize", None)
    settings = data.get("data") or {}
    user = deserialize(settings) if callable(deserialize) else cls()
    if not is_custom(user):
        raise ScheduleError(f"{path} does not make a timetable (next_dagrun_info and "
                            "infer_manual_data_interval)")  # fmt: skip
    return CustomTimetable(user)
