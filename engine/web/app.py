"""The status page's aiohttp application: the pages (GET), the static files and, only with a
token, the actions (POST)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import jinja2
from aiohttp import web

from engine import __version__
from engine.store import Store
from engine.web import hooks, views
from engine.web.actions import ACTION_ROUTES, Action, authorized, who
from engine.web.render import environment

__all__ = ["make_app"]

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
        **context,
    }
    body = app[ENV].get_template(template).render(context)
    return web.Response(
        text=body,
        status=status,
        content_type="text/html",
        headers={
            "Cache-Control": "no-store",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "same-origin",
            "Content-Security-Policy": "default-src 'self'; style-src 'self'; img-src 'self' data:",
        },
    )


def _page(fn: Page) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            template, context = await fn(request, request.app[STORE])
        except views.NotFound as exc:
            return _render(request, "error.html", {"title": "Not found", "message": str(exc)}, 404)
        return _render(request, template, context)

    return handler


def _param(request: web.Request, name: str) -> str:
    value = request.query.get(name)
    if not value:
        raise web.HTTPBadRequest(text=f"missing query parameter {name!r}")
    return value


async def _fleet(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "fleet.html", await views.fleet_page(store)


async def _dags(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "dags.html", await views.dags_page(store)


async def _dag(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "dag.html", await views.dag_page(store, _param(request, "dag_id"))


async def _run(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "run.html", await views.run_page(
        store, _param(request, "dag_id"), _param(request, "run_id")
    )


async def _task(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    return "task.html", await views.task_page(
        store, _param(request, "dag_id"), _param(request, "run_id"), _param(request, "task_id")
    )


def _number(request: web.Request, name: str, kind: type[int] | type[float]) -> Any:
    raw = request.query.get(name, "").strip()
    if not raw:
        return None
    try:
        return kind(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be a number") from None


async def _triggers(request: web.Request, store: Store) -> tuple[str, dict[str, Any]]:
    flt = views.TriggerFilter(
        classpath=request.query.get("classpath", "").strip() or None,
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
        if not authorized(request, form, request.app[TOKEN]):
            raise web.HTTPForbidden(text="a valid token is required (DEFERRAL_WEBSERVER_TOKEN)")
        return await fn(request, request.app[STORE], form, who(request))

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
