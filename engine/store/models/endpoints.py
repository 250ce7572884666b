"""The rows of engine/store/endpoints.py."""

from __future__ import annotations

import datetime as dt

import msgspec

__all__ = ["EndpointRow"]


class EndpointRow(msgspec.Struct, frozen=True, kw_only=True):
    """An address a process listens on: ``kind`` metrics (``url``: its /metrics) or
    webserver (``url``: the status page)."""

    id: int
    kind: str
    process: str
    hostname: str
    pid: int
    version: str | None
    url: str
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    heartbeat_age_s: float
