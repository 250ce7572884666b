"""Secrets masking: the one function every place that shows a value uses.

The status page, the CLI (listings, ``show``, ``--json``, ``tasks test``), the stored task
and trigger log lines and the processes' own logs all show values through :func:`redact`
(any value: dicts, lists, JSON text, plain text) or :func:`redact_text` (one string). Three
rules, applied in this order:

1. **Registered secrets.** A value handed to :func:`register_secret` is replaced by ``***``
   wherever it appears, in any string, from then on (in this process). The engine registers
   the passwords of the ``DEFERRAL_CONN_*`` connection URLs, of the database URL (also the
   embedded server's), and the Fernet keys (:func:`register_environment`,
   :func:`register_url_password`). Values shorter than :data:`MIN_SECRET_CHARS`, and a few
   words a password is often set to in development (``postgres``), are not registered:
   masking them everywhere would garble every line.
2. **Sensitive key names.** The value under a key named like a secret is masked whole, at any
   depth: ``password``, ``passwd``, ``pwd``, ``secret``, ``token``, ``api_key``,
   ``access_token``, ``private_key``, ``authorization``, ``credentials``, ``cookie``,
   ``x-api-key``, ``ocp-apim-subscription-key``, ... (:data:`SENSITIVE_KEY_PARTS`: a key
   containing one, case-insensitively, with ``-``, ``_``, ``.`` and spaces ignored; and
   :data:`SENSITIVE_KEY_WORDS`: a key with one of these as a word, such as ``basic_auth``). Also
   ``{"name": "password", "value": ...}`` pairs and ``("Authorization", ...)`` header tuples.
3. **Secret shapes in text.** Within any string: the password of a URL
   (``scheme://user:PASSWORD@host``, the user part ending at the last ``@`` before the host,
   so a password may contain ``@``); header lines (``Authorization: Bearer ...``,
   ``X-Api-Key: ...``, ``Api-Key``, ``Ocp-Apim-Subscription-Key``, ``Cookie``, ...); a
   ``Bearer`` token anywhere; ``name=value`` pairs whose name is sensitive (libpq DSN keywords
   ``password=secret`` and ``password='quoted value'``, ``?token=...`` and other query
   strings, presigned URLs' ``X-Amz-Signature=``, ``X-Amz-Credential=``, ``sig=``,
   ``Signature=``, ``key=``); and ``"password": "..."`` in JSON or Python-repr text.

Masking never raises: a value it cannot walk shows as :data:`MASK_FAILED`. It is cheap enough
for the log path: patterns are compiled once, and a line with nothing that looks secret costs
one scan of a precompiled pattern plus one substring test per registered secret.

What it cannot know: a secret that is neither registered nor under a sensitive key nor in a
known shape (a bare token in free text, a password in a key called ``x``); a secret
registered in another process (a task run with ``isolation="process"`` registers in its
child process, whose lines the worker stores with the worker's registrations only).

This module imports nothing of the engine, so every layer may use it.
"""

from __future__ import annotations

import datetime as dt
import decimal
import functools
import logging
import os
import re
import threading
import uuid
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote, quote_plus, unquote, urlsplit

__all__ = [
    "MASK",
    "MASK_FAILED",
    "MIN_SECRET_CHARS",
    "SENSITIVE_KEY_PARTS",
    "SENSITIVE_KEY_WORDS",
    "SecretsFilter",
    "forget_secrets",
    "is_registered",
    "is_sensitive_key",
    "masked_url",
    "redact",
    "redact_text",
    "register_environment",
    "register_secret",
    "register_url_password",
]

#: What a masked value shows.
MASK = "***"
#: What a value shows when masking it failed (never the value itself).
MASK_FAILED = "<masking failed>"
#: Registered secrets shorter than this are ignored (masking ``abc`` everywhere would garble
#: every line that holds those letters).
MIN_SECRET_CHARS = 5
#: Values never registered: words a development password is often set to, which also appear
#: in URLs, names and messages (masking ``postgres`` would hide ``postgresql://``).
NEVER_REGISTERED = frozenset({"postgres", "postgresql", "password", "deferral", "secret"})
#: How deep :func:`redact` walks nested values; anything deeper is masked whole.
MAX_DEPTH = 32

#: A key holds a secret when its name, lower-cased and without ``-``, ``_``, ``.`` and spaces,
#: contains one of these.
SENSITIVE_KEY_PARTS: tuple[str, ...] = (
    "password",
    "passwd",
    "passphrase",
    "pwd",
    "secret",
    "token",
    "apikey",
    "accesskey",
    "privatekey",
    "authorization",
    "credential",
    "cookie",
    "subscriptionkey",
    "signature",
    "sessionid",
    "keyfiledict",
    "serviceaccount",
    "connuri",
)
#: A key holds a secret when one of its words (split at ``-``, ``_``, ``.`` and spaces) is one
#: of these: ``basic_auth`` and ``sentry_dsn`` do, ``author`` and ``bypass`` do not.
SENSITIVE_KEY_WORDS = frozenset({"auth", "pass", "pw", "sig", "jwt", "dsn"})

_NORMALIZE = str.maketrans("", "", "-_. ")
_WORD_SPLIT = re.compile(r"[-_. ]+")

# -- key names ---------------------------------------------------------------------------------


def is_sensitive_key(name: object) -> bool:
    """Whether the value under the key ``name`` is a secret (see :data:`SENSITIVE_KEY_PARTS`
    and :data:`SENSITIVE_KEY_WORDS`). Anything that is not a string is not."""
    if not isinstance(name, str) or not name:
        return False
    lowered = name.lower()
    flat = lowered.translate(_NORMALIZE)
    if any(part in flat for part in SENSITIVE_KEY_PARTS):
        return True
    return any(word in SENSITIVE_KEY_WORDS for word in _WORD_SPLIT.split(lowered))


# -- registered secrets ------------------------------------------------------------------------

_lock = threading.Lock()
#: Registered values (and their encoded forms), longest first: a value that contains another
#: is replaced whole before the shorter one is looked for.
_secrets: tuple[str, ...] = ()
_log = logging.getLogger(__name__)


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
        for match in _PAIR.finditer(url):
            if match.group("sep") != "=" or not is_sensitive_key(match.group("name")):
                continue
            found = _VALUE.match(url, match.end())
            if found is not None:
                value = found.group(0)
                if value[:1] in "'\"" and value[-1:] == value[:1] and len(value) > 1:
                    value = value[1:-1].replace("\\'", "'")
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


# -- shapes in text ----------------------------------------------------------------------------

#: Header names whose value is a secret when written ``Name: value`` (a header line).
SECRET_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "api-key",
        "apikey",
        "x-apikey",
        "ocp-apim-subscription-key",
        "x-auth-token",
        "x-access-token",
        "x-amz-security-token",
        "x-goog-api-key",
        "private-token",
        "cookie",
        "set-cookie",
    }
)

#: A name followed by ``=`` or ``:``, its quotes if quoted (JSON, Python repr, JSON escaped
#: inside JSON). Where each value starts is found with this one pattern; the name decides.
_PAIR = re.compile(
    r"(?<![A-Za-z0-9_.])(?P<kq>\\?[\"']?)(?P<name>[A-Za-z_][A-Za-z0-9_.-]*+)(?P=kq)"
    r"[ \t]*(?P<sep>[=:])[ \t]*"
)
# A value: quoted (single, double, or JSON-escaped double quotes; backslash escapes inside),
# or bare up to the next space, ``&``, ``;``, ``#``, quote, comma or closing bracket.
_QUOTED = r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"|\\\"(?:[^\"\\\n]|\\[^\"])*\\\""
_VALUE = re.compile(rf"{_QUOTED}|[^\s&;#\"'<>,)\]}}]+")
#: A JSON or repr value after ``"name":``: quoted, or a bare number or word (not ``{``/``[``:
#: the keys inside are looked at one by one).
_JSON_VALUE = re.compile(rf"{_QUOTED}|[^\s,}}\]{{\[][^\s,}}\]]*")
#: A header's value, after an optional scheme that stays readable: to the end of the line.
_HEADER_VALUE = re.compile(
    r"(?P<scheme>(?:bearer|basic|token|digest|negotiate|bot|aws4-hmac-sha256)[ \t]+)?"
    r"[^\s\"'][^\r\n\"']*",
    re.IGNORECASE,
)
#: A bearer token anywhere.
_BEARER = re.compile(r"\b(bearer\s+)[A-Za-z0-9\-._~+/]+=*", re.IGNORECASE)
#: The password of a URL: the user part may hold ``@`` (Azure's ``user@server``); the
#: password runs to the last ``@`` before the path, query or end of the address.
_URL_PASSWORD = re.compile(
    r"(\b[a-z][a-z0-9+.-]*://[^\s:/?#\"'<>]*:)[^\s/?#\"<>]+@",
    re.IGNORECASE,
)
#: Lower-cased text holding none of these holds no shape: the cheap test every line passes.
_SIGNALS = re.compile(
    "|".join(
        [
            *SENSITIVE_KEY_PARTS,
            *SENSITIVE_KEY_WORDS,
            "://",
            "bearer",
            "api-key",
            "api_key",
            "access_key",
            "access-key",
            "private_key",
            "private-key",
            "subscription-key",
            "session_id",
            "conn_uri",
            "key",
        ]
    )
)


@functools.lru_cache(maxsize=4096)
def _name_kind(name: str, sep: str, quoted: bool) -> str:
    """How the value after ``name`` + ``sep`` is masked: ``value`` (a bare or quoted
    value), ``json`` (a JSON or repr value), ``header`` (to the end of the line), or ``""``
    (it is not a secret)."""
    lowered = name.lower()
    if sep == "=":
        return "value" if is_sensitive_key(name) else ""
    if quoted:
        return "json" if is_sensitive_key(name) else ""
    if lowered in SECRET_HEADERS or any(w in lowered for w in ("password", "passwd", "passphrase")):
        return "header"
    return ""


def _mask_pairs(text: str) -> str:
    out: list[str] = []
    done = 0  # text[:done] is in ``out``
    for match in _PAIR.finditer(text):
        if match.start() < done:
            continue  # inside a value masked already
        quote_ = match.group("kq")
        name, sep = match.group("name"), match.group("sep")
        kind = _name_kind(name, sep, bool(quote_))
        if not kind and sep == "=" and name.lower() == "key":
            # ``key=`` is a secret in a URL's query (Google's ``?key=``), not in prose.
            at = match.start()
            kind = "value" if at and text[at - 1] in "?&" else ""
        if not kind:
            continue
        pos = match.end()
        if kind == "header":
            value = _HEADER_VALUE.match(text, pos)
            if value is None:
                continue
            if value.group("scheme"):
                pos = value.end("scheme")
        else:
            value = (_JSON_VALUE if kind == "json" else _VALUE).match(text, pos)
            if value is None:
                continue
        shown = value.group(0) if kind != "header" else ""
        q = next(
            (
                q
                for q in ('\\"', "'", '"')
                if shown.startswith(q) and shown.endswith(q) and len(shown) >= 2 * len(q)
            ),
            "",
        )
        out.append(text[done:pos])
        out.append(f"{q}{MASK}{q}")
        done = value.end()
    if not out:
        return text
    out.append(text[done:])
    return "".join(out)


def redact_text(text: str) -> str:
    """``text`` with registered secrets and secret shapes masked (see the module docstring).
    Never raises: what is not a string is made one first."""
    try:
        if not isinstance(text, str):
            text = str(text)
        for secret in _secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        lowered = text.lower()
        if not _SIGNALS.search(lowered):
            return text
        if "://" in lowered and "@" in text:
            text = _URL_PASSWORD.sub(rf"\1{MASK}@", text)
        if "bearer" in lowered:
            text = _BEARER.sub(rf"\1{MASK}", text)
        if "=" in text or ":" in text:
            text = _mask_pairs(text)
        return text
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
