"""The asset webhook: ``POST /api/assets/{name}/events`` records an event of asset ``name``,
so outside systems can push instead of being polled.

The token is the setting ``webhook_token`` (``DEFERRAL_WEBHOOK_TOKEN``), sent as
``Authorization: Bearer <token>`` and compared in constant time. No token configured: the
endpoint refuses every request (403, naming the setting). Answers are JSON: ``{"id",
"asset", "timestamp"}`` on success; ``{"error": ...}`` with 400 (the body is not a JSON
object with an optional object ``extra``), 401 (no or wrong token), 403 (no token set), 404
(unknown asset), 503 (the database cannot be reached)."""

from __future__ import annotations

import hmac
from typing import Any

import anyio
import asyncpg
import msgspec
from aiohttp import web

from engine.runtime.retry import TRANSIENT_ERRORS
from engine.store import Store
from engine.store.models import NewAssetEvent

__all__ = ["MAX_BODY_BYTES", "WEBHOOK_PATH", "add_webhook"]

WEBHOOK_PATH = "/api/assets/{name}/events"
#: The largest request body accepted.
MAX_BODY_BYTES = 256 * 1024
#: How long a request waits for the database.
DB_WAIT_S = 10.0

_STORE: web.AppKey[Store] = web.AppKey("webhook_store", Store)
_TOKEN: web.AppKey[str] = web.AppKey("webhook_token", str)


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers or None)


def _has_nul(value: Any) -> bool:
    """Whether a decoded JSON value holds a NUL character (no jsonb can store one)."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_has_nul(k) or _has_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v) for v in value)
    return False


def _extra(body: bytes) -> dict[str, Any]:
    """The event's extra from the request body (empty: none); HTTPBadRequest otherwise."""
    if not body.strip():
        return {}
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise web.HTTPBadRequest(text=f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise web.HTTPBadRequest(text='the body must be a JSON object: {"extra": {...}}')
    unknown = sorted(set(data) - {"extra"})
    if unknown:
        raise web.HTTPBadRequest(text=f'unknown key(s) {unknown}: the body is {{"extra": {{...}}}}')
    extra = data.get("extra", {})
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise web.HTTPBadRequest(text=f'"extra" must be a JSON object, got {type(extra).__name__}')
    if _has_nul(extra):
        raise web.HTTPBadRequest(text='"extra" holds a NUL character, which cannot be stored')
    return extra


async def _post_event(request: web.Request) -> web.Response:
    token = request.app.get(_TOKEN)
    if not token:
        return _error(
            403,
            "the asset webhook is off: set the setting webhook_token (environment variable "
            "DEFERRAL_WEBHOOK_TOKEN) and send it as 'Authorization: Bearer <token>'",
        )
    scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer":  # (the scheme is case-insensitive)
        given = ""
    given = given.strip()
    if not given or not hmac.compare_digest(given.encode(), token.encode()):
        return _error(
            401,
            "a valid token is required: 'Authorization: Bearer <webhook_token>'",
            **{"WWW-Authenticate": "Bearer"},
        )
    name = request.match_info["name"]
    if "\x00" in name:
        return _error(404, f"unknown asset {name!r}: no DAG declares it")
    if (request.content_length or 0) > MAX_BODY_BYTES:
        return _error(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    if len(body) > MAX_BODY_BYTES:
        return _error(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    try:
        extra = _extra(body)
    except web.HTTPBadRequest as exc:
        return _error(400, exc.text or "bad request")
    store = request.app[_STORE]
    event = NewAssetEvent(
        asset=name, extra=extra, source_kind="webhook", source_name=request.remote or None
    )
    try:
        with anyio.fail_after(DB_WAIT_S):
            written = await store.record_asset_events([event])
    except TRANSIENT_ERRORS as exc:  # (TimeoutError among them: fail_after)
        return _error(503, f"the database cannot be reached: {type(exc).__name__}")
    except asyncpg.DataError as exc:  # (a value jsonb cannot hold)
        return _error(400, f"the event cannot be stored: {exc}")
    if not written:
        return _error(404, f"unknown asset {name!r}: no DAG declares it")
    recorded = written[0]
    return web.json_response(
        {"id": recorded.id, "asset": recorded.asset, "timestamp": recorded.timestamp.isoformat()}
    )


def add_webhook(app: web.Application, store: Store, token: str | None) -> None:
    """Add the webhook's route to ``app`` (always: without a token it refuses, saying why)."""
    app[_STORE] = store
    if token:
        app[_TOKEN] = token
    app.router.add_post(WEBHOOK_PATH.replace("{name}", "{name:.+}"), _post_event)
