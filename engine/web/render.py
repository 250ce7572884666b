"""The pages' template environment: autoescaping on (every value shown is HTML-escaped), the
templates and static files shipped as package data, and the filters the pages share."""

from __future__ import annotations

import datetime as dt
from typing import Any

import jinja2
import msgspec

from engine.masking import MASK, redact
from triggers.base import decode_value

__all__ = ["MASK", "decoded", "environment", "masked", "pretty"]


def masked(value: Any) -> Any:
    """``value`` as the pages show it: secrets masked at any depth, by the engine's one
    masking function (:func:`engine.masking.redact`: registered secrets, sensitive
    key names, secret shapes in text)."""
    return redact(value)


def decoded(raw: bytes | None) -> Any:
    """A stored (MessagePack) value, decoded; a value that does not decode shows as such."""
    if raw is None:
        return None
    try:
        return decode_value(raw)
    except (msgspec.DecodeError, ValueError, TypeError):
        return f"({len(raw)} bytes that do not decode)"


def pretty(value: Any) -> str:
    """A decoded value as indented JSON (what JSON cannot hold, as its text)."""
    return msgspec.json.format(msgspec.json.encode(value, enc_hook=str), indent=2).decode()


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def _when(value: dt.datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("engine.web", "templates"),
        autoescape=jinja2.select_autoescape(["html"], default=True),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(age=_age, when=_when, ms=_ms, pretty=pretty, masked=masked)
    return env
