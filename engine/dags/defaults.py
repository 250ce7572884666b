"""The settings that shape a DAG as its file declares it: ``default_timezone`` (where naive
dates are) and ``create_cron_data_intervals`` (which timetable a cron string makes).

A DAG file is imported by every process that needs it (scheduler, worker, ``deferral dags
...``), each reading the same settings (``deferral.toml`` and ``DEFERRAL_*``): on first use,
:func:`authoring` reads them once per process. The ``deferral`` command hands over the
settings it loaded (``--config`` included) with :func:`configure`.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import NamedTuple

from engine.config import ConfigError, Settings, load_settings

__all__ = ["Authoring", "authoring", "configure", "reset"]


class Authoring(NamedTuple):
    default_timezone: dt.tzinfo
    create_cron_data_intervals: bool


_lock = threading.Lock()
_current: Authoring | None = None


def _from(settings: Settings) -> Authoring:
    from engine.dags.timetables.base import ScheduleError, parse_timezone

    try:
        tz = parse_timezone(settings.default_timezone)
    except ScheduleError as exc:
        raise ConfigError(f"setting default_timezone: {exc}") from None
    return Authoring(tz, settings.create_cron_data_intervals)


def configure(settings: Settings) -> None:
    """Use these settings for the DAGs this process declares from now on."""
    global _current
    found = _from(settings)
    with _lock:
        _current = found


def reset() -> None:
    """Read the settings again on next use (tests)."""
    global _current
    with _lock:
        _current = None


def authoring() -> Authoring:
    """The settings DAGs are declared with in this process."""
    global _current
    found = _current
    if found is None:
        try:
            found = _from(load_settings())
        except ConfigError:
            # (A settings file the process cannot use fails the process that loads it,
            # saying why; a DAG is declared with the defaults meanwhile.)
            found = Authoring(dt.UTC, True)
        with _lock:
            _current = found
    return found
