"""Wait for an HTTP endpoint to answer as expected (aiohttp, on the triggerer's loop)."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

import aiohttp
import msgspec

from triggers.connections import aresolve_url
from triggers.polling import DEFAULT_POLL_INTERVAL_S, PollingTrigger, import_callable

__all__ = ["CredentialsRefused", "HttpResponse", "HttpTrigger"]

log = logging.getLogger(__name__)

#: Response bodies longer than this are cut in the event payload.
MAX_BODY_CHARS = 64 * 1024


_DEFAULT_PORTS = {"http": 80, "https": 443}


class CredentialsRefused(ValueError):
    """A request would carry a connection's credentials to another origin."""


def _origin(url: str) -> tuple[str, str, int | None]:
    """Scheme, host and port (the default port of the scheme when none is written)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = -1  # an invalid port matches no origin
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme)


class HttpResponse(msgspec.Struct, frozen=True):
    """What a ``response_check`` receives."""

    status: int
    headers: dict[str, str]
    text: str

    def json(self) -> Any:
        return msgspec.json.decode(self.text)


class HttpTrigger(PollingTrigger):
    """Requests ``url`` every ``poll_interval`` seconds until the status is one of
    ``expected_status`` and, when given, ``response_check`` (an import path to
    ``f(HttpResponse) -> bool``, sync and quick) returns true.

    With ``conn_id``, ``url`` is relative to the connection's URL and the connection's
    ``user:password@`` becomes basic authentication, so secrets stay out of the kwargs. The
    credentials go only to the connection's own scheme, host and port: an absolute ``url``
    elsewhere is an error (:class:`CredentialsRefused`), which fails the trigger.
    Connection errors and other statuses mean "not yet". The payload is
    ``{"status", "url", "text"}``. ``response_check`` must match the engine's allow-list
    (setting ``trigger_allow``), which the runtime checks before building the trigger.
    """

    import_path_kwargs = ("response_check",)

    def __init__(
        self,
        url: str,
        *,
        method: str = "GET",
        headers: dict[str, str] | None = None,
        data: str | None = None,
        expected_status: Sequence[int] = (200,),
        response_check: str | None = None,
        conn_id: str | None = None,
        request_timeout: float = 30.0,
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        end_from_trigger: bool = False,
    ) -> None:
        super().__init__(poll_interval=poll_interval, end_from_trigger=end_from_trigger)
        self.url = url
        self.method = method.upper()
        self.headers = dict(headers or {})
        self.data = data
        self.expected_status = sorted({int(s) for s in expected_status})
        if response_check is not None:
            import_callable(response_check, "response_check")  # fail at defer time, not later
        self.response_check = response_check
        self.conn_id = conn_id
        self.request_timeout = float(request_timeout)
        #: A check given as a live callable (sensors in poke/reschedule mode); never serialized.
        self.response_check_fn: Callable[[HttpResponse], Any] | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.http.HttpTrigger",
            {
                "url": self.url,
                "method": self.method,
                "headers": self.headers,
                "data": self.data,
                "expected_status": self.expected_status,
                "response_check": self.response_check,
                "conn_id": self.conn_id,
                "request_timeout": self.request_timeout,
                **self._base_kwargs(),
            },
        )

    async def _target(self) -> tuple[str, dict[str, str]]:
        """The full URL and the headers, with the connection's credentials as basic auth."""
        if self.conn_id is None:
            return self.url, self.headers
        parts = urlsplit(await aresolve_url(self.conn_id))
        headers = dict(self.headers)
        if parts.username is not None:
            # aiohttp.BasicAuth is deprecated and encode_basic_auth needs aiohttp 3.14: the
            # header is one line of RFC 7617.
            user, password = unquote(parts.username), unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
            headers["Authorization"] = f"Basic {token}"
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        base = urlunsplit(parts._replace(netloc=netloc))
        given = urlsplit(self.url)
        if given.scheme or given.netloc:
            url = self.url
        else:
            url = urljoin(base.rstrip("/") + "/", self.url.lstrip("/"))
        if _origin(url) != _origin(base):
            # The URL and the connection's host are kwargs and configuration: neither is shown.
            raise CredentialsRefused(
                "HttpTrigger: url is an absolute URL outside its connection (conn_id): the "
                "connection's credentials go only to the connection's own scheme, host and "
                "port. Give a path relative to the connection, or a URL on that origin"
            )
        return url, headers

    async def check(self) -> dict[str, Any] | None:
        url, headers = await self._target()
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.request(self.method, url, headers=headers, data=self.data) as resp,
            ):
                text = await resp.text()
                status = resp.status
                answer_headers = dict(resp.headers)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.log.info("%s %s: %s: %s; trying again", self.method, url, type(exc).__name__, exc)
            return None
        if status not in self.expected_status:
            self.log.debug(
                "%s %s answered %s; waiting for %s", self.method, url, status, self.expected_status
            )
            return None
        check = self.response_check_fn
        if check is None and self.response_check is not None:
            check = import_callable(self.response_check, "response_check")
        if check is not None and not check(
            HttpResponse(status=status, headers=answer_headers, text=text)
        ):
            return None
        return {"status": status, "url": self.url, "text": text[:MAX_BODY_CHARS]}
