"""The secrets registered in this process (rule 1 of secrets masking): a value handed to
:func:`register_secret` is masked wherever it appears, in any string, from then on. The module
holds the one set of registered values (behind a lock: any thread may register)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from urllib.parse import quote, quote_plus, unquote, urlsplit

from engine.masking.rules import MASK, MAX_DEPTH, is_sensitive_key, sensitive_values

__all__ = [
    "MIN_SECRET_CHARS",
    "NEVER_REGISTERED",
    "forget_secrets",
    "is_registered",
    "mask_registered",
    "register_environment",
    "register_secret",
    "register_url_password",
]

#: Registered secrets shorter than this are ignored (masking ``abc`` everywhere would garble
#: every line that holds those letters).
MIN_SECRET_CHARS = 5
#: Values never registered: words a development password is often set to, which also appear
#: in URLs, names and messages (masking ``postgres`` would hide ``postgresql://``).
NEVER_REGISTERED = frozenset({"postgres", "postgresql", "password", "deferral", "secret"})

_lock = threading.Lock()
#: Registered values (and their encoded forms), longest first: a value that contains another
#: is replaced whole before the shorter one is looked for.
_secrets: tuple[str, ...] = ()
_log = logging.getLogger("engine.masking")


def _forms(value: str) -> set[str]:
    """The value and how it is written inside URLs and JSON text."""
    forms = {value, quote(value, safe=""), quote_plus(value, safe="")}
    if "%" in value:
        forms.add(unquote(value))
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    forms.add(escaped)
    return {f for f in forms if len(f) >= MIN_SECRET_CHARS and f.lower() not in NEVER_REGISTERED}


def register_secret(value: object, name: str | None = None) -> None:
    """Mask ``value`` wherever it appears from now on, in this process.

    ``value`` is a string (also registered as written in URLs: percent-encoded, and in JSON:
    escaped), bytes (UTF-8), or a mapping or iterable of them, walked; in a mapping only the
    values under sensitive keys are registered. With ``name``, the value is registered only
    when ``name`` is a sensitive key name (a Variable called ``api_token`` is, one called
    ``region`` is not). Values shorter than :data:`MIN_SECRET_CHARS` and the words of
    :data:`NEVER_REGISTERED` are ignored. Safe to call from any thread, and with anything:
    what is not text is ignored."""
    global _secrets
    if name is not None and not is_sensitive_key(name):
        return
    found: set[str] = set()
    _collect(value, found, depth=0, under_sensitive=name is not None)
    if not found:
        return
    with _lock:
        known = set(_secrets)
        if found <= known:
            return
        _secrets = tuple(sorted(known | found, key=lambda s: (-len(s), s)))


def _collect(value: object, found: set[str], *, depth: int, under_sensitive: bool) -> None:
    if depth > MAX_DEPTH:
        return
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", "replace")
    if isinstance(value, str):
        text = value.strip()
        if len(text) < MIN_SECRET_CHARS:
            if text:
                _log.debug("a secret of fewer than %d characters is not masked", MIN_SECRET_CHARS)
            return
        found.update(_forms(text))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if under_sensitive or is_sensitive_key(key):
                _collect(item, found, depth=depth + 1, under_sensitive=True)
    elif isinstance(value, Iterable):
        for item in value:
            _collect(item, found, depth=depth + 1, under_sensitive=under_sensitive)


def register_url_password(url: str | None) -> None:
    """Register the password of a URL (``scheme://user:password@host/...``; the user part
    ends at the last ``@`` before the host) or of a libpq keyword string
    (``host=h password=secret``). Nothing happens for a URL without one."""
    if not url or not isinstance(url, str):
        return
    try:
        if "://" in url:
            netloc = urlsplit(url.strip()).netloc
            userinfo, at, _host = netloc.rpartition("@")
            if at and ":" in userinfo:
                register_secret(userinfo.partition(":")[2])
        for value in sensitive_values(url):
            register_secret(value)
    except ValueError:
        return


def register_environment(environ: Mapping[str, str] | None = None) -> None:
    """Register what the environment holds for the engine: the passwords of the
    ``DEFERRAL_CONN_*`` connection URLs and of ``DEFERRAL_DATABASE_URL``, and the keys of
    ``DEFERRAL_FERNET_KEY`` (every engine command calls this once at start)."""
    env = os.environ if environ is None else environ
    for key, value in env.items():
        if key.startswith("DEFERRAL_CONN_") or key == "DEFERRAL_DATABASE_URL":
            register_url_password(value)
        elif key == "DEFERRAL_FERNET_KEY":
            register_secret([k for k in value.replace("\n", ",").split(",") if k.strip()])


def is_registered(value: str) -> bool:
    """Whether ``value`` is masked as a registered secret."""
    return value in _secrets


def forget_secrets() -> None:
    """Forget every registered secret (tests start from a clean slate with it)."""
    global _secrets
    with _lock:
        _secrets = ()


def mask_registered(text: str) -> str:
    """``text`` with every registered secret replaced by ``***`` (rule 1)."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text
