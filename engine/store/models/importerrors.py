"""The rows of engine/store/importerrors.py."""

from __future__ import annotations

import datetime as dt

import msgspec

__all__ = ["ImportErrorRow"]


class ImportErrorRow(msgspec.Struct, frozen=True, kw_only=True):
    """A DAG file that failed to import: its path, its folder, the error (its traceback
    included) and since when it has failed so."""

    fileloc: str
    folder: str
    error: str
    since: dt.datetime
