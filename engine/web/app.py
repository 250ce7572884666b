"""The status page's aiohttp application: the pages (GET), the static files and, only with a
token, the actions (POST)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import anyio
import jinja2
from aiohttp import web

from engine.dags.importerrors import error_summary
from engine.masking import redact_text
from engine.runtime.retry import TRANSIENT_ERRORS
from engine.states import RUN_STATES, STATES
from engine.store import Store
from engine.version import __version__
from engine.web import hooks, params, views
from engine.web.actions import ACTION_ROUTES, Action, authorized, who
from engine.web.guard import add_security_headers
from engine.web.render import environment
from engine.web.webhook import add_webhook

__all__ = ["make_app"]

log = logging.getLogger(__name__)

#: How long a page or an action may wait on the database before it answers 503.
DB_WAIT_S = 15.0
#: The most files the import error banner names.
BANNER_FILES = 20

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


async def _fleet(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "fleet.html", await views.fleet_page(store)


async def _dags(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    query = views.DagQuery(
        name=params.text(request, "name"),
        state=params.choice(request, "state", RUN_STATES),
        paused=params.choice(request, "paused", ("yes", "no")),
    )
    return "dags.html", await views.dags_page(store, query)


def _run_query(request: web.Request) -> views.RunQuery:
    """The runs a page asks for (``state``, ``run_type``, ``since`` and ``until``)."""
    return views.RunQuery(
        state=params.choice(request, "state", RUN_STATES),
        run_type=params.choice(request, "run_type", views.RUN_TYPES),
        since=params.text(request, "since"),
        until=params.text(request, "until"),
        since_at=params.when(request, "since"),
        until_at=params.when(request, "until", end_of_day=True),
    )


async def _dag(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "dag.html", await views.dag_page(
        store,
        params.required(request, "dag_id"),
        params.number(request, "page", int),
        query=_run_query(request),
        run_page=params.number(request, "run_page", int),
    )


async def _runs(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    query = _run_query(request)
    return "runs.html", await views.runs_page(store, query, params.number(request, "page", int))


async def _run(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "run.html", await views.run_page(
        store,
        params.required(request, "dag_id"),
        params.required(request, "run_id"),
        state=params.choice(request, "state", STATES),
        page=params.number(request, "page", int),
    )


async def _gantt(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "gantt.html", await views.gantt_page(
        store,
        params.required(request, "dag_id"),
        params.required(request, "run_id"),
        page=params.number(request, "page", int),
    )


async def _task(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "task.html", await views.task_page(
        store,
        params.required(request, "dag_id"),
        params.required(request, "run_id"),
        params.required(request, "task_id"),
        params.number(request, "try", int),
    )


async def _triggers(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    flt = views.TriggerFilter(
        classpath=params.text(request, "classpath"),
        triggerer=params.number(request, "triggerer", int),
        min_age_s=params.number(request, "min_age_s", float),
    )
    return "triggers.html", await views.triggers_page(store, flt)


async def _pools(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "pools.html", await views.pools_page(store)


async def _pool(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    if not request.app.get(POOLS, False):
        raise views.NotFound("this build has no pools")
    return "pool.html", await views.pool_page(
        store,
        params.required(request, "name"),
        params.choice(request, "tasks", views.POOL_GROUPS) or "running",
        params.number(request, "page", int),
    )


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


def make_app(
    store: Store, *, token: str | None = None, webhook_token: str | None = None
) -> web.Application:
    """The status page on ``store``. With a ``token``, the actions too (POST, each needing the
    token); without one, read-only: no action route exists and no button is rendered. The
    asset webhook (engine/web/webhook.py) needs ``webhook_token`` (setting webhook_token);
    without one it refuses every request."""
    app = web.Application()
    add_webhook(app, store, webhook_token)
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
        "/runs": _runs,
        "/run": _run,
        "/gantt": _gantt,
        "/task": _task,
        "/triggers": _triggers,
        "/pools": _pools,
        "/pool": _pool,
        "/audit": _audit,
    }.items():
        app.router.add_get(path, _page(page))
    app.router.add_static("/static", str(static))
    if token:
        for path, action in ACTION_ROUTES.items():
            app.router.add_post(path, _action(action))
    return app
