"""The status page's aiohttp application: the pages (GET), the static files and, only with a
token, the actions (POST)."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import anyio
import jinja2
from aiohttp import web

from engine.dags.dagbag import error_summary
from engine.masking import redact_text
from engine.runtime.retry import TRANSIENT_ERRORS
from engine.states import STATES
from engine.store import Store
from engine.version import __version__
from engine.web import hooks, views
from engine.web.actions import ACTION_ROUTES, Action, authorized, who
from engine.web.guard import add_security_headers
from engine.web.render import environment

__all__ = ["make_app"]

log = logging.getLogger(__name__)

#: How long a page or an action may wait on the database before it answers 503.
DB_WAIT_S = 15.0
#: The most files the import error banner names.
BANNER_FILES = 20
#: The largest id a query parameter may name (PostgreSQL's bigint).
MAX_ID = 2**63 - 1
#: The largest age filter (a century): beyond it the database's timestamps overflow.
MAX_AGE_S = 100 * 365.25 * 86400

STORE: web.AppKey[Store] = web.AppKey("store", Store)
ENV: web.AppKey[jinja2.Environment] = web.AppKey("env", jinja2.Environment)
TOKEN: web.AppKey[str] = web.AppKey("token", str)
POOLS: web.AppKey[bool] = web.AppKey("pools_offered", bool)

Page = Callable[[web.Request, Store], Awaitable[tuple[str, dict[str, Any]]]]


def _render(
    request: web.Request, template: str, context: dict[str, Any], status: int = 200
) -> web.Response:
    app = request.app
    context = {
        "version": __version__,
        "actions": TOKEN in app,
        "path": request.path_qs,
        "pools_offered": app.get(POOLS, False),
        "import_errors": [],
        "banner_files": BANNER_FILES,
        **context,
    }
    body = app[ENV].get_template(template).render(context)
    return web.Response(
        text=body,
        status=status,
        content_type="text/html",
        headers={"Cache-Control": "no-store"},  # (the security headers: guard.py, on all)
    )


def _unreachable(request: web.Request, exc: BaseException) -> web.Response:
    """The database is stopped or out of reach: an error page (503) that says so, never a
    500: the page is for finding out what is wrong."""
    log.warning("%s %s: the database cannot be reached: %r", request.method, request.path, exc)
    detail = str(exc) or f"no answer in {DB_WAIT_S:g} s"
    message = f"the database cannot be reached ({type(exc).__name__}: {detail}); reload to retry"
    context = {"title": "Database unreachable", "message": message}
    return _render(request, "error.html", context, 503)


def _refused(request: web.Request, exc: web.HTTPClientError) -> web.Response:
    """A 4xx (bad parameter, no token, unknown thing, conflict) as a page of the site saying
    why, with its status: a browser user sees where they are, not a bare line of text."""
    message = exc.text or exc.reason
    return _render(request, "error.html", {"title": exc.reason, "message": message}, exc.status)


async def import_error_banner(store: Store) -> list[tuple[str, str]]:
    """The DAG files that fail to import (path, the error's last line, masked), for the banner
    every page shows until they are fixed; at most BANNER_FILES and one more (to say so)."""
    rows = await store.import_errors(limit=BANNER_FILES + 1)
    return [(r.fileloc, redact_text(error_summary(r.error))) for r in rows]


def _page(fn: Page) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            with anyio.fail_after(DB_WAIT_S):
                template, context = await fn(request, request.app[STORE])
                context["import_errors"] = await import_error_banner(request.app[STORE])
        except views.NotFound as exc:
            return _render(request, "error.html", {"title": "Not found", "message": str(exc)}, 404)
        except web.HTTPClientError as exc:
            return _refused(request, exc)
        except TRANSIENT_ERRORS as exc:
            return _unreachable(request, exc)
        return _render(request, template, context)

    return handler


def _text(request: web.Request, name: str) -> str | None:
    """A query parameter's text (None when absent or blank); a NUL, which no database text
    can hold, is a bad request."""
    value = request.query.get(name, "").strip()
    if "\x00" in value:
        raise web.HTTPBadRequest(text=f"query parameter {name!r} holds a NUL character")
    return value or None


def _param(request: web.Request, name: str) -> str:
    value = _text(request, name)
    if value is None:
        raise web.HTTPBadRequest(text=f"missing query parameter {name!r}")
    return request.query[name]


async def _fleet(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "fleet.html", await views.fleet_page(store)


async def _dags(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "dags.html", await views.dags_page(store)


async def _dag(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    page = _number(request, "page", int)
    return "dag.html", await views.dag_page(store, _param(request, "dag_id"), page)


async def _run(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    state = _text(request, "state")
    if state is not None and state not in STATES:
        raise web.HTTPBadRequest(text=f"state must be one of {', '.join(sorted(STATES))}")
    return "run.html", await views.run_page(
        store,
        _param(request, "dag_id"),
        _param(request, "run_id"),
        state=state,
        page=_number(request, "page", int),
    )


async def _task(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "task.html", await views.task_page(
        store, _param(request, "dag_id"), _param(request, "run_id"), _param(request, "task_id")
    )


def _number(request: web.Request, name: str, kind: type[int] | type[float]) -> Any:
    """A numeric query parameter (None when absent): a non-negative number the database can
    hold, or a bad request naming it."""
    raw = _text(request, name)
    if raw is None:
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be a number") from None
    top = MAX_ID if kind is int else MAX_AGE_S
    if not (math.isfinite(value) and 0 <= value <= top):
        raise web.HTTPBadRequest(text=f"{name} must be a number from 0 to {top:g}")
    return value


async def _triggers(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    flt = views.TriggerFilter(
        classpath=_text(request, "classpath"),
        triggerer=_number(request, "triggerer", int),
        min_age_s=_number(request, "min_age_s", float),
    )
    return "triggers.html", await views.triggers_page(store, flt)


async def _pools(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    rows = await hooks.pools(store)
    if rows is None:
        raise views.NotFound("this build has no pools")
    return "pools.html", {"title": "Pools", "pools": rows}


async def _audit(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "audit.html", {"title": "Audit", "rows": await store.list_audit()}


async def _index(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/fleet")


def _action(fn: Action) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        form = await request.post()
        try:
            if not authorized(request, form, request.app[TOKEN]):
                raise web.HTTPForbidden(text="a valid token is required (DEFERRAL_WEBSERVER_TOKEN)")
            with anyio.fail_after(DB_WAIT_S):
                return await fn(request, request.app[STORE], form, who(request))
        except web.HTTPClientError as exc:
            return _refused(request, exc)
        except TRANSIENT_ERRORS as exc:
            return _unreachable(request, exc)

    return handler


async def _pools_offered(app: web.Application) -> None:
    app[POOLS] = await hooks.pools(app[STORE]) is not None


def make_app(store: Store, *, token: str | None = None) -> web.Application:
    """The status page on ``store``. With a ``token``, the actions too (POST, each needing the
    token); without one, read-only: no action route exists and no button is rendered."""
    app = web.Application()
    app[STORE] = store
    app[ENV] = environment()
    if token:
        app[TOKEN] = token
    app.on_startup.append(_pools_offered)
    app.on_response_prepare.append(add_security_headers)
    static = resources.files("engine.web").joinpath("static")
    app.router.add_get("/", _index)
    for path, page in {
        "/fleet": _fleet,
        "/dags": _dags,
        "/dag": _dag,
        "/run": _run,
        "/task": _task,
        "/triggers": _triggers,
        "/pools": _pools,
        "/audit": _audit,
    }.items():
        app.router.add_get(path, _page(page))
    app.router.add_static("/static", str(static))
    if token:
        for path, action in ACTION_ROUTES.items():
            app.router.add_post(path, _action(action))
    return app
