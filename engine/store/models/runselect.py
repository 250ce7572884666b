"""The rows of engine/store/runselect.py."""

from __future__ import annotations

import datetime as dt

import msgspec

__all__ = ["SelectedRun"]


class SelectedRun(msgspec.Struct, frozen=True, kw_only=True):
    """A run a selector named (or might have meant)."""

    dag_id: str
    run_id: str
    logical_date: dt.datetime
    run_type: str
    state: str
