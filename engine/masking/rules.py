"""The rules of secrets masking that hold in every process: which key names hold a secret
(rule 2) and which shapes of text do (rule 3), with what a masked value shows. Stateless: what
this process registered is :mod:`engine.masking.registry`'s."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

__all__ = [
    "MASK",
    "MASK_FAILED",
    "MAX_DEPTH",
    "SECRET_HEADERS",
    "SENSITIVE_KEY_PARTS",
    "SENSITIVE_KEY_WORDS",
    "is_sensitive_key",
    "mask_shapes",
    "sensitive_values",
]

#: What a masked value shows.
MASK = "***"
#: What a value shows when masking it failed (never the value itself).
MASK_FAILED = "<masking failed>"
#: How deep :func:`engine.masking.redact` walks nested values; anything deeper is masked whole.
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
    return _sensitive_name(name)


# (Memoized: the rules are constants, and the same few key names come back in every payload
# shown: a triggerer masks each event's payload for its log line, 10,000 a second in bench
# waits. Bounded, so that keys of arbitrary data cannot grow it without end.)
@functools.lru_cache(maxsize=4096)
def _sensitive_name(name: str) -> bool:
    lowered = name.lower()
    flat = lowered.translate(_NORMALIZE)
    if any(part in flat for part in SENSITIVE_KEY_PARTS):
        return True
    return any(word in SENSITIVE_KEY_WORDS for word in _WORD_SPLIT.split(lowered))


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


def sensitive_values(text: str) -> Iterator[str]:
    """The values of the ``name=value`` pairs of ``text`` whose name is sensitive, unquoted
    (``host=h password='a b'`` gives ``a b``): what a libpq keyword string holds secret."""
    for match in _PAIR.finditer(text):
        if match.group("sep") != "=" or not is_sensitive_key(match.group("name")):
            continue
        found = _VALUE.match(text, match.end())
        if found is not None:
            value = found.group(0)
            if value[:1] in "'\"" and value[-1:] == value[:1] and len(value) > 1:
                value = value[1:-1].replace("\\'", "'")
            yield value


def mask_shapes(text: str) -> str:
    """``text`` with the secret shapes masked (rule 3): URL passwords, bearer tokens, header
    lines and sensitive ``name=value`` / ``"name": value`` pairs."""
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
