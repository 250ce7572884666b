"""XComs as people see them: ``tasks list --json`` (``xcom``: size and a preview per key),
``deferral tasks xcom`` (values in full) and the status page's task view. Values are shown
with secrets masked (engine.masking, as every surface shows values)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from engine.masking import redact
from engine.store import Store, TaskInstance
from triggers.base import decode_value

__all__ = ["PREVIEW_CHARS", "XComSummary", "full_json", "shown", "summaries", "summary"]

#: The longest preview of a value (longer ones end with "...").
PREVIEW_CHARS = 80


class XComSummary(msgspec.Struct, frozen=True):
    """One XCom in a listing: its size once encoded, and the start of its value as JSON."""

    bytes: int
    preview: str


def shown(key: str, raw: bytes) -> Any:
    """A stored value decoded, secrets masked (the whole value when its key names a secret,
    as ``password``); one that does not decode says so."""
    try:
        value = decode_value(raw)
    except (msgspec.DecodeError, ValueError, TypeError):
        return f"({len(raw)} bytes that do not decode)"
    return redact({key: value})[key]


def full_json(value: Any, *, indent: int | None = None) -> str:
    """A shown value as JSON (what JSON cannot hold, as its text)."""
    text = msgspec.json.encode(value, enc_hook=str)
    if indent is not None:
        text = msgspec.json.format(text, indent=indent)
    return text.decode()


def summary(values: Mapping[str, bytes]) -> dict[str, XComSummary]:
    """Size and preview of each XCom, by key."""
    out = {}
    for key in sorted(values):
        raw = values[key]
        text = full_json(shown(key, raw))
        if len(text) > PREVIEW_CHARS:
            text = text[: PREVIEW_CHARS - 3] + "..."
        out[key] = XComSummary(bytes=len(raw), preview=text)
    return out


async def summaries(
    store: Store, rows: Sequence[TaskInstance]
) -> dict[int, dict[str, XComSummary]]:
    """The XComs of listed task instances (their return values are their results), by task
    instance id: one statement for all of them."""
    pushed = await store.xcom_of_tasks([row.id for row in rows])
    found: dict[int, dict[str, XComSummary]] = {}
    for row in rows:
        values = dict(pushed.get(row.id, {}))
        if row.result is not None:
            values["return_value"] = row.result  # (as xcom_pull reads it)
        found[row.id] = summary(values)
    return found
