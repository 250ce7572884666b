"""Secrets masking applied: to one string (:func:`redact_text`), to any value, walked
(:func:`redact`), and to log records (:class:`SecretsFilter`). The rules are
:mod:`engine.masking.rules`', the registered secrets :mod:`engine.masking.registry`'s."""

from __future__ import annotations

import datetime as dt
import decimal
import logging
import uuid
from collections.abc import Mapping
from typing import Any

import msgspec

from engine.masking.registry import mask_registered
from engine.masking.rules import MASK, MASK_FAILED, MAX_DEPTH, is_sensitive_key, mask_shapes

__all__ = ["SHOWN_CHARS", "SecretsFilter", "masked_url", "redact", "redact_text", "shown_json"]

#: Characters of a value :func:`shown_json` shows at most.
SHOWN_CHARS = 2000


def redact_text(text: str) -> str:
    """``text`` with registered secrets and secret shapes masked (see :mod:`engine.masking`).
    Never raises: what is not a string is made one first."""
    try:
        if not isinstance(text, str):
            text = str(text)
        return mask_shapes(mask_registered(text))
    except Exception:
        return MASK_FAILED


def masked_url(url: str) -> str:
    """A URL with its password replaced by ``***`` (for messages and listings)."""
    return redact_text(url)


# -- values ------------------------------------------------------------------------------------

_PLAIN = (int, float, bool, type(None), dt.date, dt.time, dt.timedelta, uuid.UUID, decimal.Decimal)


def _masked_whole(value: Any) -> Any:
    """A sensitive key's value: every leaf masked, its shape kept (None stays None)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {k: _masked_whole(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_masked_whole(v) for v in value]
    return MASK


def _walk(value: Any, depth: int) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, _PLAIN):
        return value
    if depth > MAX_DEPTH:
        return MASK
    if isinstance(value, Mapping):
        pair_name = value.get("name", value.get("key")) if len(value) <= 3 else None
        masked: dict[Any, Any] = {}
        for key, item in value.items():
            if is_sensitive_key(key) or (key == "value" and is_sensitive_key(pair_name)):
                masked[key] = _masked_whole(item)
            else:
                masked[key] = _walk(item, depth + 1)
        return masked
    if isinstance(value, list | tuple):
        # ("Authorization", "Bearer ...") as a header pair.
        if len(value) == 2 and is_sensitive_key(value[0]):
            items = [_walk(value[0], depth + 1), _masked_whole(value[1])]
        else:
            items = [_walk(v, depth + 1) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, set | frozenset):
        return [_walk(v, depth + 1) for v in value]
    if isinstance(value, bytes | bytearray):
        text = bytes(value).decode("utf-8", "replace")
        masked_text = redact_text(text)
        return value if masked_text == text else masked_text
    return redact_text(str(value))


def redact(value: Any, key: object = None) -> Any:
    """``value`` as it may be shown: registered secrets and secret shapes masked in every
    string, and every value under a sensitive key masked whole, at any depth (dicts, lists,
    tuples and sets are copied; a set becomes a list). ``key`` is the name the value was found
    under, if any. Numbers, booleans, None and times pass unchanged; another object shows as
    its masked ``str()``. Never raises (:data:`MASK_FAILED` instead)."""
    try:
        if key is not None and is_sensitive_key(key):
            return _masked_whole(value)
        return _walk(value, 0)
    except Exception:
        return MASK_FAILED


def shown_json(value: Any, max_chars: int = SHOWN_CHARS) -> str:
    """``value`` as one line shows it: :func:`redact`-ed, as compact JSON (dates as ISO
    text, other objects as their ``str()``; a value JSON cannot take as its masked repr), at
    most ``max_chars`` characters and a note of how many more. Never raises."""
    try:
        text = msgspec.json.encode(redact(value), enc_hook=_as_text).decode()
    except Exception:
        text = repr(redact(value))
    if len(text) > max_chars:
        text = text[:max_chars] + f"... ({len(text) - max_chars} more characters)"
    return text


def _as_text(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    return str(value)


# -- logging -----------------------------------------------------------------------------------


class SecretsFilter(logging.Filter):
    """A logging filter that masks each record's message and exception text in place
    (:func:`redact_text`), for handlers of your own. The engine's handlers mask already."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        record.msg = redact_text(message)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True
