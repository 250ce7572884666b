"""The status page's actions: POST only, offered only with ``--enable-actions``, each one
authorized by the token (``Authorization: Bearer <token>`` or a ``token`` form field; never a
cookie, so another site cannot make a browser send it) and written to ``deferral_audit``."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from engine.store import Store
from engine.store.downstream import settle
from engine.store.models import MovedTask
from engine.store.overrides import MARK_STATES, RUN_MARK_STATES, NoSuchTarget
from engine.web import hooks
from engine.web.guard import local_path
from engine.web.views import dag_url, run_url, task_url

__all__ = ["ACTION_ROUTES", "TOKEN_ENV", "authorized"]

#: The environment variable that holds the actions' token.
TOKEN_ENV = "DEFERRAL_WEBSERVER_TOKEN"

Action = Callable[[web.Request, Store, Any, str], Awaitable[web.StreamResponse]]


def authorized(request: web.Request, form: Any, token: str) -> bool:
    header = request.headers.get("Authorization", "")
    given = header[len("Bearer ") :] if header.startswith("Bearer ") else str(form.get("token", ""))
    return bool(given) and hmac.compare_digest(given.encode(), token.encode())


def who(request: web.Request) -> str:
    """Who took an action: the remote address (the audit's ``who``)."""
    return request.remote or "unknown"


def _field(form: Any, name: str) -> str:
    value = form.get(name)
    if not isinstance(value, str) or not value:
        raise web.HTTPBadRequest(text=f"missing form field {name!r}")
    if "\x00" in value:  # no database text can hold it
        raise web.HTTPBadRequest(text=f"form field {name!r} holds a NUL character")
    return value


def _back(form: Any, default: str) -> web.HTTPSeeOther:
    """Back to the page the action came from (a path of this site only, rebuilt), or
    ``default``."""
    return web.HTTPSeeOther(local_path(form.get("next")) or default)


async def _settled(store: Store, moved: list[MovedTask]) -> None:
    await settle(store, moved, woke=any(m.state == "scheduled" for m in moved))


def _flag(form: Any, name: str) -> bool:
    """An optional checkbox (``downstream``, ``upstream``): on when sent as 1/true/yes/on."""
    return str(form.get(name, "")).lower() in ("1", "true", "yes", "on")


async def _targets(store: Store, form: Any) -> tuple[list[int], str]:
    """The task instances an action on the form's task reaches (with its ``downstream`` and
    ``upstream`` choices), as the command line selects them; its page to go back to."""
    dag_id, run_id, task_id = (_field(form, n) for n in ("dag_id", "run_id", "task_id"))
    # (an instance's page sends its map index: the action is on that instance alone)
    index = str(form.get("map_index", "-1"))
    if not index.lstrip("-").isdigit():
        raise web.HTTPBadRequest(text="form field 'map_index' must be a number")
    try:
        targets = await store.override_targets(
            dag_id,
            run_id,
            [task_id],
            map_indexes=[int(index)],
            downstream=_flag(form, "downstream"),
            upstream=_flag(form, "upstream"),
        )
    except NoSuchTarget as exc:
        raise web.HTTPNotFound(text=str(exc)) from None
    name = task_id if int(index) < 0 else f"{task_id}[{index}]"
    return [t.id for t in targets], task_url(dag_id, run_id, name)


async def clear(request: web.Request, store: Store, form: Any, actor: str) -> web.StreamResponse:
    ids, page = await _targets(store, form)
    # (The store's clear, as `deferral tasks clear` runs it: a running try is stopped first,
    # XComs dropped; audited and settled there.)
    await store.clear_tasks(ids, who=actor)
    raise _back(form, page)


async def mark(request: web.Request, store: Store, form: Any, actor: str) -> web.StreamResponse:
    state = _field(form, "state")
    if state not in MARK_STATES:
        raise web.HTTPBadRequest(text="state must be success, failed or skipped")
    ids, page = await _targets(store, form)
    # (The store's mark, as `deferral tasks mark-*` runs it: a running try is stopped;
    # audited and settled there.)
    await store.mark_tasks(ids, state, who=actor)
    raise _back(form, page)


async def _run_of(store: Store, form: Any) -> tuple[str, str]:
    dag_id, run_id = _field(form, "dag_id"), _field(form, "run_id")
    if await store.get_dag_run(dag_id, run_id) is None:
        raise web.HTTPNotFound(text=f"no run {run_id!r} of DAG {dag_id!r}")
    return dag_id, run_id


async def clear_run(
    request: web.Request, store: Store, form: Any, actor: str
) -> web.StreamResponse:
    dag_id, run_id = await _run_of(store, form)
    # (As `deferral runs clear`: every task instance, or with only_failed the failed ones.)
    try:
        targets = await store.override_targets(
            dag_id, run_id, only_failed=_flag(form, "only_failed")
        )
    except NoSuchTarget as exc:
        raise web.HTTPNotFound(text=str(exc)) from None
    await store.clear_tasks([t.id for t in targets], who=actor)
    raise _back(form, run_url(dag_id, run_id))


async def mark_run(request: web.Request, store: Store, form: Any, actor: str) -> web.StreamResponse:
    state = _field(form, "state")
    if state not in RUN_MARK_STATES:
        raise web.HTTPBadRequest(text="a run's state must be success or failed")
    dag_id, run_id = await _run_of(store, form)
    # (As `deferral runs mark-*`: the tasks marked and the run ended in one transaction.)
    try:
        await store.mark_run(dag_id, run_id, state, who=actor)
    except NoSuchTarget as exc:
        raise web.HTTPNotFound(text=str(exc)) from None
    raise _back(form, run_url(dag_id, run_id))


async def pause(request: web.Request, store: Store, form: Any, actor: str) -> web.StreamResponse:
    dag_id = _field(form, "dag_id")
    paused = _field(form, "paused") in ("1", "true", "yes", "on")
    done = await hooks.set_dag_paused(store, dag_id, paused)
    if done is None:
        raise web.HTTPNotFound(text="this build cannot pause DAGs (no schedules)")
    if not done:
        raise web.HTTPNotFound(text=f"no DAG {dag_id!r}")
    await store.record_audit(actor, "pause" if paused else "unpause", dag_id)
    raise _back(form, dag_url(dag_id))


async def cancel_trigger(
    request: web.Request, store: Store, form: Any, actor: str
) -> web.StreamResponse:
    raw = _field(form, "trigger_id")
    try:
        trigger_id = int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text="trigger_id must be a number") from None
    if not 0 < trigger_id < 2**63:
        raise web.HTTPBadRequest(text="trigger_id must be a trigger's id (a positive number)")
    # Nothing to cancel is not an action taken: no audit row saying it was.
    if await store.get_trigger(trigger_id) is None:
        raise web.HTTPNotFound(
            text=f"no trigger {trigger_id} (it fired, timed out or was cancelled)"
        )
    moved = await store.cancel_trigger(trigger_id, who=actor)
    await _settled(store, moved)
    raise _back(form, "/triggers")


#: Path → action.
ACTION_ROUTES: dict[str, Action] = {
    "/actions/clear": clear,
    "/actions/mark": mark,
    "/actions/clear-run": clear_run,
    "/actions/mark-run": mark_run,
    "/actions/pause": pause,
    "/actions/cancel-trigger": cancel_trigger,
}
