"""Data values as the engine stores them: MessagePack, with the types JSON lacks kept.

:func:`encode_data` encodes what XComs and task results may hold: JSON's types (``None``,
bools, ints, floats, strings, lists, dicts with string keys) plus ``datetime``, ``date``,
``time``, ``timedelta``, ``UUID``, ``Decimal`` and ``bytes``, each read back as its own type by
:func:`triggers.base.decode_value` (which every reader of stored values uses). Tuples come
back as lists. Anything else (an object, a function, a set, a dict with non-string keys) is a
:class:`TypeError` naming its type, raised before anything is written.

This module imports nothing of the engine: the contracts and the runtime share it.
"""

from __future__ import annotations

import datetime as dt
import decimal
import uuid
from typing import Any

import msgspec

__all__ = ["decode_ext", "encode_data"]

# MessagePack extension codes of the types msgspec would otherwise turn into strings.
_EXT_DATE = 1
_EXT_UUID = 2
_EXT_DECIMAL = 3
_EXT_NAIVE_DATETIME = 4
_EXT_TIME = 5
_EXT_TIMEDELTA = 6

_encoder = msgspec.msgpack.Encoder(order="sorted")
_PLAIN = (str, int, float, bool, bytes, type(None))


def _convert(value: Any, path: str) -> Any:
    """``value`` with every date, UUID, Decimal, naive datetime and time as an extension;
    TypeError for what the store cannot keep (``path`` says where it sits)."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    # (A plain item is taken as it is, without building the path it sits at: a result's
    # dict of numbers and strings costs no string formatting.)
    if kind is list or kind is tuple:
        return [
            v if type(v) in _PLAIN else _convert(v, f"{path}[{i}]") for i, v in enumerate(value)
        ]
    if kind is dict:
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"{path} has a key of type {type(k).__name__} ({k!r}); keys must be str"
                )
            out[k] = v if type(v) in _PLAIN else _convert(v, f"{path}[{k!r}]")
        return out
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None and value.utcoffset() is not None:
            # MessagePack's own timestamp, read back as an aware datetime (in UTC); a subclass
            # (pendulum's DateTime, the context's dates) as the stdlib value it stands for
            if type(value) is not dt.datetime:
                return dt.datetime.fromtimestamp(value.timestamp(), tz=dt.UTC)
            return value
        return msgspec.msgpack.Ext(_EXT_NAIVE_DATETIME, value.isoformat().encode())
    if isinstance(value, dt.date):
        return msgspec.msgpack.Ext(_EXT_DATE, value.isoformat().encode())
    if isinstance(value, dt.time):
        return msgspec.msgpack.Ext(_EXT_TIME, value.isoformat().encode())
    if isinstance(value, dt.timedelta):
        parts = f"{value.days},{value.seconds},{value.microseconds}"
        return msgspec.msgpack.Ext(_EXT_TIMEDELTA, parts.encode())
    if isinstance(value, uuid.UUID):
        return msgspec.msgpack.Ext(_EXT_UUID, value.bytes)
    if isinstance(value, decimal.Decimal):
        return msgspec.msgpack.Ext(_EXT_DECIMAL, str(value).encode())
    if isinstance(value, bool | int | float | str | bytes):  # subclasses (IntEnum, StrEnum, ...)
        return value
    if isinstance(value, list | tuple):
        return [_convert(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return _convert(dict(value), path)
    raise TypeError(f"{path} is a {kind.__module__}.{kind.__qualname__}")


def encode_data(value: Any) -> bytes:
    """``value`` as stored bytes; TypeError (naming the type and where it sits) for a value of
    a type the store does not keep."""
    return _encoder.encode(_convert(value, "the value"))


def decode_ext(code: int, data: memoryview) -> Any:
    """The value of one of :func:`encode_data`'s extensions (msgspec's ``ext_hook``)."""
    raw = bytes(data)
    if code == _EXT_DATE:
        return dt.date.fromisoformat(raw.decode())
    if code == _EXT_UUID:
        return uuid.UUID(bytes=raw)
    if code == _EXT_DECIMAL:
        return decimal.Decimal(raw.decode())
    if code == _EXT_NAIVE_DATETIME:
        return dt.datetime.fromisoformat(raw.decode())
    if code == _EXT_TIME:
        return dt.time.fromisoformat(raw.decode())
    if code == _EXT_TIMEDELTA:
        days, seconds, micros = (int(p) for p in raw.decode().split(","))
        return dt.timedelta(days=days, seconds=seconds, microseconds=micros)
    return msgspec.msgpack.Ext(code, raw)
