"""What the status page does against other sites: its responses can never be framed (no
clickjacking of the action buttons), and an action's ``next`` can only lead back to a page of
this site (no open redirect).

The headers go on every response the application makes (pages, error pages, static files,
aiohttp's own 404 and 405), set in one place: :func:`add_security_headers`, an
``on_response_prepare`` signal.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from aiohttp import web

__all__ = ["CONTENT_SECURITY_POLICY", "SECURITY_HEADERS", "add_security_headers", "local_path"]

#: Only the page's own scripts, styles and images; no other site may frame it.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; style-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)

#: Headers of every response. ``X-Frame-Options`` says to older browsers what
#: ``frame-ancestors`` says to the others.
SECURITY_HEADERS: dict[str, str] = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}

#: The longest ``next`` followed (a page's address is far shorter).
MAX_NEXT = 4096
#: A path of this site: segments of unreserved characters, each after one ``/``. No ``%``
#: (an encoded ``/``, ``\`` or tab), no ``\``, no ``@`` or ``:``, no control character, never
#: two slashes in a row.
_PATH = re.compile(r"/|(?:/[A-Za-z0-9._~-]+)+/?")


async def add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the security headers on whatever the application answers."""
    for name, value in SECURITY_HEADERS.items():
        response.headers[name] = value


def local_path(target: Any) -> str | None:
    """``target`` rebuilt as a path of this site with its query (``/run?dag_id=...``), or
    None when it is not one.

    Browsers drop tabs and newlines anywhere in an address, strip leading spaces and control
    characters, and read ``\\`` as ``/``: ``/\\t/example.com`` is ``//example.com`` to them,
    another site. So any of these refuses the target outright rather than being cleaned, and
    what is accepted is rebuilt from its parsed parts: the path (checked against
    :data:`_PATH`) and the query (decoded and encoded again); a fragment is dropped."""
    if not isinstance(target, str) or not target or len(target) > MAX_NEXT:
        return None
    if not target.isascii() or any(c <= " " or c in "\x7f\\" for c in target):
        return None
    # The path as written, not as parsed: urlsplit("///example.com") has no host and the path
    # "/example.com", where a browser sees the host example.com.
    path = re.split(r"[?#]", target, maxsplit=1)[0]
    if not _PATH.fullmatch(path):
        return None
    try:
        parts = urlsplit(target)
        query = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        return None
    if parts.scheme or parts.netloc or parts.path != path:
        return None
    return f"{parts.path}?{urlencode(query)}" if query else parts.path
