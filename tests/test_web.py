"""The status page's handlers against a real database (aiohttp's test client): every page, every
action, the token, the audit table, and HTML escaping of every value a user controls (a DAG
id, a run's conf, a trigger's kwargs, an error, a log line)."""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner

from engine import DAG
from engine.cli import cli
from engine.store import Deferral, Store, TaskOutcome
from engine.store.models import TaskLogRow, TriggererHealth, TriggerLogRow
from engine.store.session import TriggererSession
from engine.web import hooks
from engine.web.app import make_app
from operators.python import PythonOperator
from tests.helpers import wait_until
from tests.processes import Children, explained
from triggers.base import encode_value

pytestmark = pytest.mark.anyio

XSS = "<script>alert('x')</script>"
#: What the page must show instead of XSS.
ESCAPED = "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"
TOKEN = "t0ken-for-tests"
DAG_ID = f"web{XSS}"
CLASSPATH = "tests.triggers_for_tests.NeverTrigger"


def _noop() -> None:
    pass


@dataclass
class Scene:
    store: Store
    a: int
    c: int
    trigger_id: int
    triggerer_id: int


@pytest.fixture
async def scene(store: Store) -> Scene:
    """A DAG (a >> b, c) whose id holds a script tag; a run with a script in its conf; a failed
    (with a script in its error and in a rendered field, a secret in another), b pending, c
    deferred on a trigger with a script and a secret in its kwargs, held by a triggerer."""
    with DAG(dag_id="web") as dag:
        a = PythonOperator(task_id="a", python_callable=_noop)
        a >> PythonOperator(task_id="b", python_callable=_noop)
        PythonOperator(task_id="c", python_callable=_noop)
    await store.upsert_dag(DAG_ID, "web.py", dag.serialize_tasks(), f"about {XSS}")
    await store.create_dag_run(
        DAG_ID,
        "r1",
        logical_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        conf={"note": XSS, "password": "conf-secret"},
    )
    worker = await store.register_worker("web-host", 4242, 4)
    claimed = (await store.claim_tasks(worker, 10)).claimed
    ids = {ti.task_id: ti.id for ti in claimed}
    await store.defer_task(
        ids["c"],
        worker,
        Deferral(
            classpath=CLASSPATH,
            kwargs=encode_value({"tag": XSS, "api_key": "kwarg-secret"}),
            dedup_key="web-c",
            method_name="resume",
            method_kwargs=encode_value({}),
            timeout_s=3600.0,
        ),
    )
    await store.set_rendered_fields(
        ids["a"], worker, 1, {"bash_command": f"echo {XSS}", "env": {"PASSWORD": "rendered-secret"}}
    )
    await store.finish_tasks(
        [
            TaskOutcome(
                ti_id=ids["a"],
                worker_id=worker,
                try_number=1,
                kind="failed",
                error=f"Traceback (most recent call last):\nValueError: {XSS}",
            )
        ]
    )
    triggerer = await store.register_triggerer("trig-host", 5151, 100, 60.0)
    (trigger,) = (await store.claim_triggers(triggerer, 10)).claimed
    return Scene(store, ids["a"], ids["c"], trigger.id, triggerer)


@pytest.fixture
async def client(scene: Scene) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(make_app(scene.store))) as c:
        yield c


@pytest.fixture
async def acting(scene: Scene) -> AsyncIterator[TestClient[Any, Any]]:
    """A client of a page with actions enabled."""
    async with TestClient(TestServer(make_app(scene.store, token=TOKEN))) as c:
        yield c


def q(**params: str) -> str:
    from urllib.parse import urlencode

    return urlencode(params)


async def page(client: TestClient[Any, Any], path: str, status: int = 200) -> str:
    response = await client.get(path)
    text = await response.text()
    assert response.status == status, text
    assert XSS not in text, f"{path} shows a value unescaped"
    assert "<script>" not in text.replace('<script src="/static/live.js" defer></script>', "")
    return text


async def test_fleet_shows_every_process_its_load_and_the_backlog(
    scene: Scene, client: TestClient[Any, Any]
) -> None:
    await scene.store.register_scheduler()
    session = TriggererSession(scene.store.url, timeout_s=5)
    await session.connect()
    try:
        health = TriggererHealth(
            loop_lag_p99_ms=12.5,
            blocked_loops=3,
            worst_blocker=f"pkg.{XSS}Trigger",
            worst_block_ms=450.0,
        )
        assert await session.renew(scene.triggerer_id, 60.0, health) == 1
    finally:
        await session.close()
    text = await page(client, "/fleet")
    for shown in ("Schedulers", "web-host [4242]", "trig-host [5151]", "0.1.0"):
        assert shown in text
    assert re.search(r'id="slots-used">0 / 4<', text)  # c deferred, a failed: none running
    assert re.search(r'id="triggers-held">1 / 100<', text)
    assert re.search(r'id="backlog-triggers">0<', text)
    assert "12.5 ms" in text
    assert f"3 (worst: pkg.{ESCAPED}Trigger, 450.0 ms)" in text


async def test_dags_and_dag_pages_list_runs_as_squares_and_the_graph(
    client: TestClient[Any, Any],
) -> None:
    text = await page(client, "/dags")
    assert ESCAPED in text
    assert 'class="sq state-running"' in text
    assert "/run?" + q(dag_id=DAG_ID, run_id="r1").replace("&", "&amp;") in text
    text = await page(client, "/dag?" + q(dag_id=DAG_ID))
    assert f"about {ESCAPED}" in text
    assert "<svg" in text
    assert text.count("<rect") == 3


async def test_run_page_shows_the_grid_the_graph_and_the_conf_masked(
    client: TestClient[Any, Any],
) -> None:
    text = await page(client, "/run?" + q(dag_id=DAG_ID, run_id="r1"))
    grid = text[text.index('id="grid"') : text.index("</table>", text.index('id="grid"'))]
    for task_id, state in (("a", "failed"), ("b", "pending"), ("c", "deferred")):
        assert re.search(rf">{task_id}</a></td><td><span class=\"sq state-{state}\"", grid), (
            task_id,
            grid,
        )
    assert ESCAPED in text  # the conf's note
    assert "conf-secret" not in text
    assert "&#34;password&#34;: &#34;***&#34;" in text
    assert 'class="node state-deferred"' in text


async def test_task_try_page_of_a_deferred_task_says_what_it_waits_on(
    scene: Scene, client: TestClient[Any, Any]
) -> None:
    text = await page(client, "/task?" + q(dag_id=DAG_ID, run_id="r1", task_id="c"))
    assert f"<dd>{scene.trigger_id}</dd>" in text
    assert CLASSPATH in text
    assert f"trig-host [5151] (triggerer {scene.triggerer_id})" in text
    assert "kwarg-secret" not in text
    assert "&#34;api_key&#34;: &#34;***&#34;" in text
    assert ESCAPED in text  # the kwarg "tag"
    assert "trigger_timeout" in text  # the deadline's kind
    assert "waiting since" in text
    assert "nothing logged by this try yet" in text
    assert 'method="post"' not in text  # read-only: no button


async def test_task_try_page_of_a_failed_task_shows_the_error_and_log_lines_escaped(
    scene: Scene, client: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def lines(store: Store, ti: Any) -> list[str]:
        return [f"INFO starting {ti.task_id}", f"WARNING {XSS}"]

    async def why(store: Store, ti: Any) -> str:
        return f"because {XSS}"

    monkeypatch.setattr(hooks, "task_log_lines", lines)
    monkeypatch.setattr(hooks, "why_not_running", why)
    text = await page(client, "/task?" + q(dag_id=DAG_ID, run_id="r1", task_id="a"))
    assert f"ValueError: {ESCAPED}" in text
    assert "Traceback (most recent call last)" in text
    assert f"INFO starting a\nWARNING {ESCAPED}" in text
    assert f"because {ESCAPED}" in text


async def test_task_try_page_shows_the_rendered_fields_escaped_and_masked(
    client: TestClient[Any, Any],
) -> None:
    text = await page(client, "/task?" + q(dag_id=DAG_ID, run_id="r1", task_id="a"))
    rendered = text[text.index('id="rendered-fields"') :]
    assert f"<dt>bash_command</dt><dd><pre>echo {ESCAPED}</pre>" in rendered
    assert "&#34;PASSWORD&#34;: &#34;***&#34;" in rendered
    assert "rendered-secret" not in text
    # A task that rendered nothing has no such section.
    text = await page(client, "/task?" + q(dag_id=DAG_ID, run_id="r1", task_id="b"))
    assert "rendered-fields" not in text


async def test_triggers_page_filters_counts_and_oldest_waits(
    scene: Scene, client: TestClient[Any, Any]
) -> None:
    text = await page(client, "/triggers")
    classes = text[text.index('id="trigger-classes"') :]
    assert re.search(rf">{re.escape(CLASSPATH)}</a></td><td class=\"num\">1<", classes)
    oldest = text[text.index('id="oldest-waits"') :]
    assert f"{ESCAPED} / r1 / c" in oldest
    for query, listed in (
        (q(classpath="NeverTrigger"), True),
        (q(classpath="Nope"), False),
        (q(triggerer=str(scene.triggerer_id)), True),
        (q(triggerer="0"), False),
        (q(min_age_s="3600"), False),
        (q(min_age_s="0"), True),
    ):
        text = await page(client, "/triggers?" + query)
        listing = text[text.index('id="trigger-list"') :]
        assert (f'<td class="num">{scene.trigger_id}</td>' in listing) == listed, query
    await page(client, "/triggers?" + q(triggerer="x"), 400)


async def test_pools_page_lists_every_pool_and_what_it_holds_escaped(
    scene: Scene, client: TestClient[Any, Any]
) -> None:
    await scene.store.set_pool(f"etl{XSS}", 3, include_deferred=True, description=XSS)
    text = await page(client, "/fleet")
    assert '<a href="/pools">Pools</a>' in text
    text = await page(client, "/pools")
    pools = text[text.index('id="pool-list"') : text.index("</table>")]
    heads = re.findall(r"<th[^>]*>([^<]*)</th>", pools)
    assert heads == [
        "name", "slots", "running", "queued", "deferred", "open", "include_deferred",
        "description",
    ]  # fmt: skip
    rows = [
        [re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        for row in pools.split("<tr")[2:]
    ]
    default = "the pool of every task that names none"
    assert rows == [
        # c is deferred in default_pool, which does not count it against its slots.
        ["default_pool", "128", "0", "0", "1", "128", "no", default],
        [f"etl{ESCAPED}", "3", "0", "0", "0", "3", "yes", ESCAPED],
    ]
    assert '<td class="num">128</td>' in pools
    # Each count links to those tasks of the pool.
    link = '<a href="/pool?name=default_pool&amp;tasks=deferred">1</a>'
    assert f'<td class="num">{link}</td>' in pools
    # Counting deferred tasks, default_pool has one slot fewer open.
    await scene.store.set_pool("default_pool", 128, include_deferred=True)
    text = await page(client, "/pools")
    row = text[text.index(">default_pool</a>") :]
    cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
    assert cells[:5] == ["128", "0", "0", "1", "127"]


async def test_a_build_without_pools_offers_no_pools_page(
    scene: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_pools(store: Store) -> None:
        return None

    monkeypatch.setattr(hooks, "pools", no_pools)
    async with TestClient(TestServer(make_app(scene.store))) as c:
        await page(c, "/pools", 404)
        assert 'href="/pools"' not in await page(c, "/fleet")


async def test_unknown_things_are_404_with_the_name_escaped(client: TestClient[Any, Any]) -> None:
    text = await page(client, "/dag?" + q(dag_id=XSS), 404)
    assert ESCAPED in text
    await page(client, "/run?" + q(dag_id=DAG_ID, run_id=XSS), 404)
    await page(client, "/task?" + q(dag_id=DAG_ID, run_id="r1", task_id=XSS), 404)
    await page(client, "/run?" + q(dag_id=DAG_ID), 400)


async def test_bad_query_parameters_are_a_400_page_never_a_500(
    client: TestClient[Any, Any],
) -> None:
    """Values the database cannot take (NaN, infinity, an age or an id past its ranges, a NUL)
    are the caller's mistake: 400 with an HTML page naming the parameter."""
    for query, name in (
        (q(min_age_s="nan"), "min_age_s"),
        (q(min_age_s="inf"), "min_age_s"),
        (q(min_age_s="1e309"), "min_age_s"),
        (q(min_age_s="1e12"), "min_age_s"),
        (q(min_age_s="-5"), "min_age_s"),
        (q(triggerer="99999999999999999999"), "triggerer"),
        (q(triggerer="-1"), "triggerer"),
        (q(classpath="a\x00b"), "classpath"),
    ):
        text = await page(client, "/triggers?" + query, 400)
        assert name in text, query
        assert "<h1>Bad Request</h1>" in text, query
    for path in (
        "/dag?" + q(dag_id="d\x00"),
        "/run?" + q(dag_id=DAG_ID, run_id="r\x00"),
        "/task?" + q(dag_id=DAG_ID, run_id="r1", task_id="\x00"),
        "/run?" + q(dag_id=DAG_ID, run_id=" "),
    ):
        await page(client, path, 400)


async def test_a_stopped_database_shows_an_error_page_not_a_crash(
    scene: Scene, db_url: str
) -> None:
    """The page reaches the database through a proxy; closing the proxy cuts every connection
    and refuses new ones, as a stopped server does: each page answers 503 saying so."""
    from engine.security.keys import Keyring
    from tests.conftest import TEST_FERNET_KEY
    from tests.pg_proxy import PgProxy

    proxy = PgProxy(db_url)
    async with contextlib.AsyncExitStack() as outage:
        await outage.enter_async_context(proxy.running())
        far = await Store.connect(
            proxy.url, pool_size=2, migrate=False, keyring=Keyring([TEST_FERNET_KEY])
        )
        try:
            async with TestClient(TestServer(make_app(far, token=TOKEN))) as c:
                await page(c, "/fleet")
                await outage.aclose()  # the database is gone
                for path in (
                    "/fleet",
                    "/dags",
                    "/run?" + q(dag_id=DAG_ID, run_id="r1"),
                    "/task?" + q(dag_id=DAG_ID, run_id="r1", task_id="c"),
                    "/triggers",
                    "/audit",
                ):
                    text = await page(c, path, 503)
                    assert "the database cannot be reached" in text, path
                response = await c.post(
                    "/actions/clear", data=_task_form("a", token=TOKEN), allow_redirects=False
                )
                assert response.status == 503
                assert "the database cannot be reached" in await response.text()
                # The server itself goes on.
                assert (await c.get("/static/live.js")).status == 200
        finally:
            await far.close()
    assert (await scene.store.task_try(DAG_ID, "r1", "a")).state == "failed"  # type: ignore[union-attr]


async def test_the_live_script_and_the_root_are_served(client: TestClient[Any, Any]) -> None:
    response = await client.get("/static/live.js")
    assert response.status == 200
    assert "data-live" in await response.text()
    response = await client.get("/", allow_redirects=False)
    assert (response.status, response.headers["Location"]) == (302, "/fleet")


# -- actions -------------------------------------------------------------------------------------


def _task_form(task_id: str, **more: str) -> dict[str, str]:
    return {"dag_id": DAG_ID, "run_id": "r1", "task_id": task_id, **more}


async def test_read_only_by_default_no_action_route_exists(
    scene: Scene, client: TestClient[Any, Any]
) -> None:
    for path in ("/actions/clear", "/actions/mark", "/actions/pause", "/actions/cancel-trigger"):
        response = await client.post(path, data={**_task_form("a"), "token": TOKEN})
        assert response.status == 404, path
    assert (await scene.store.list_task_instances(dag_id=DAG_ID))[0].state == "failed"
    assert await scene.store.list_audit() == []


async def test_actions_need_the_token(scene: Scene, acting: TestClient[Any, Any]) -> None:
    for headers, data in (
        ({}, _task_form("a")),
        ({}, _task_form("a", token="wrong")),
        ({"Authorization": "Bearer wrong"}, _task_form("a")),
        ({"Authorization": TOKEN}, _task_form("a")),  # not a Bearer header
    ):
        response = await acting.post("/actions/clear", data=data, headers=headers)
        assert response.status == 403
    assert (await scene.store.task_try(DAG_ID, "r1", "a")).state == "failed"  # type: ignore[union-attr]
    assert await scene.store.list_audit() == []
    # Refused as a page of the site (a browser's form post lands on it), the token not echoed.
    response = await acting.post("/actions/clear", data=_task_form("a", token="wrong-t0ken"))
    text = await response.text()
    assert response.content_type == "text/html"
    assert "<h1>Forbidden</h1>" in text
    assert "DEFERRAL_WEBSERVER_TOKEN" in text
    assert "wrong-t0ken" not in text
    # A GET never acts.
    assert (await acting.get("/actions/clear")).status == 405


async def test_buttons_are_rendered_only_with_actions(acting: TestClient[Any, Any]) -> None:
    text = await page(acting, "/task?" + q(dag_id=DAG_ID, run_id="r1", task_id="c"))
    for action in ("/actions/clear", "/actions/mark", "/actions/cancel-trigger"):
        assert f'action="{action}"' in text
    assert TOKEN not in text


async def test_clear_puts_the_task_back_to_scheduled_keeping_its_try(
    scene: Scene, acting: TestClient[Any, Any]
) -> None:
    response = await acting.post(
        "/actions/clear",
        data=_task_form("a", next="/dags"),
        headers={"Authorization": f"Bearer {TOKEN}"},
        allow_redirects=False,
    )
    assert (response.status, response.headers["Location"]) == (303, "/dags")
    ti = await scene.store.task_try(DAG_ID, "r1", "a")
    assert ti is not None
    assert (ti.state, ti.try_number, ti.error, ti.retries) == ("scheduled", 1, None, 1)
    (audit,) = await scene.store.list_audit()
    assert (audit.who, audit.action, audit.target) == ("127.0.0.1", "clear", f"{DAG_ID}/r1/a")
    text = await page(acting, "/audit")
    assert f"{ESCAPED}/r1/a" in text
    # A running task is cleared too: its try is told to stop, and the next waits for it.
    worker = await scene.store.register_worker("w2", 1, 4)
    (claimed,) = (await scene.store.claim_tasks(worker, 10)).claimed
    response = await acting.post(
        "/actions/clear", data=_task_form("a", token=TOKEN), allow_redirects=False
    )
    assert response.status == 303
    ti = await scene.store.task_try(DAG_ID, "r1", "a")
    assert ti is not None
    assert (ti.state, ti.try_number, ti.worker_id) == ("scheduled", 2, None)
    beat = await scene.store.heartbeat_worker(worker, [(claimed.id, claimed.try_number)])
    assert [(r.ti_id, r.try_number) for r in beat.stop] == [(claimed.id, 2)]
    assert beat.stop[0].reason == "cleared by 127.0.0.1 from the status page"
    audit = (await scene.store.list_audit())[0]
    assert (audit.action, audit.detail["was"], audit.detail["stopping_worker"]) == (
        "clear",
        "running",
        worker,
    )


async def test_mark_success_settles_the_downstream_tasks(
    scene: Scene, acting: TestClient[Any, Any]
) -> None:
    response = await acting.post(
        "/actions/mark",
        data=_task_form("a", state="success", token=TOKEN),
        allow_redirects=False,
    )
    assert response.status == 303
    states = {ti.task_id: ti.state for ti in await scene.store.list_task_instances(dag_id=DAG_ID)}
    assert states == {"a": "success", "b": "scheduled", "c": "deferred"}
    response = await acting.post(
        "/actions/mark", data=_task_form("c", state="failed", token=TOKEN), allow_redirects=False
    )
    assert response.status == 303
    ti = await scene.store.task_try(DAG_ID, "r1", "c")
    assert ti is not None
    assert (ti.state, ti.trigger_id) == ("failed", None)
    assert ti.error == "marked failed by 127.0.0.1 from the status page"
    actions = [r.action for r in await scene.store.list_audit()]
    assert actions == ["mark_failed", "mark_success"]
    bad = await acting.post(
        "/actions/mark", data=_task_form("a", state="running", token=TOKEN), allow_redirects=False
    )
    assert bad.status == 400


async def test_clear_and_mark_take_the_downstream_and_upstream_choices(
    scene: Scene, acting: TestClient[Any, Any]
) -> None:
    """The page's actions are the command line's: the same selection of relatives, the same
    statements, one audit row per task instance."""
    response = await acting.post(
        "/actions/mark",
        data=_task_form("a", state="skipped", downstream="1", token=TOKEN),
        allow_redirects=False,
    )
    assert response.status == 303
    states = {ti.task_id: ti.state for ti in await scene.store.list_task_instances(dag_id=DAG_ID)}
    assert states == {"a": "skipped", "b": "skipped", "c": "deferred"}
    response = await acting.post(
        "/actions/clear", data=_task_form("b", upstream="1", token=TOKEN), allow_redirects=False
    )
    assert response.status == 303
    states = {ti.task_id: ti.state for ti in await scene.store.list_task_instances(dag_id=DAG_ID)}
    assert states == {"a": "scheduled", "b": "pending", "c": "deferred"}
    audit = sorted((r.action, r.target) for r in await scene.store.list_audit())
    assert audit == [
        ("clear", f"{DAG_ID}/r1/a"), ("clear", f"{DAG_ID}/r1/b"),
        ("mark_skipped", f"{DAG_ID}/r1/a"), ("mark_skipped", f"{DAG_ID}/r1/b"),
    ]  # fmt: skip
    missing = await acting.post(
        "/actions/clear", data=_task_form("zz", token=TOKEN), allow_redirects=False
    )
    assert missing.status == 404
    assert "no task &#39;zz&#39;" in await missing.text()
    text = await page(acting, "/task?" + q(dag_id=DAG_ID, run_id="r1", task_id="a"))
    assert 'name="downstream"' in text
    assert 'name="upstream"' in text


async def test_a_run_is_cleared_and_marked_from_its_page(
    scene: Scene, acting: TestClient[Any, Any]
) -> None:
    text = await page(acting, "/run?" + q(dag_id=DAG_ID, run_id="r1"))
    assert 'action="/actions/clear-run"' in text
    assert 'action="/actions/mark-run"' in text
    run_form = {"dag_id": DAG_ID, "run_id": "r1", "token": TOKEN}
    response = await acting.post(
        "/actions/mark-run", data={**run_form, "state": "failed"}, allow_redirects=False
    )
    assert response.status == 303
    run = await scene.store.get_dag_run(DAG_ID, "r1")
    assert run is not None
    assert run.state == "failed"
    states = {ti.task_id: ti.state for ti in await scene.store.list_task_instances(dag_id=DAG_ID)}
    assert states == {"a": "failed", "b": "skipped", "c": "failed"}
    # only_failed: a and c run again, b (skipped) stays.
    response = await acting.post(
        "/actions/clear-run", data={**run_form, "only_failed": "1"}, allow_redirects=False
    )
    assert response.status == 303
    states = {ti.task_id: ti.state for ti in await scene.store.list_task_instances(dag_id=DAG_ID)}
    assert states == {"a": "scheduled", "b": "skipped", "c": "scheduled"}
    run = await scene.store.get_dag_run(DAG_ID, "r1")
    assert run is not None
    assert run.state == "running"
    actions = {r.action for r in await scene.store.list_audit()}
    assert {"mark_run_failed", "mark_failed", "mark_skipped", "clear"} <= actions
    for data in (
        {**run_form, "state": "running"},
        {**run_form, "state": "success", "run_id": "no"},
    ):
        bad = await acting.post("/actions/mark-run", data=data, allow_redirects=False)
        assert bad.status in (400, 404)
    assert (
        await acting.post("/actions/clear-run", data={**run_form, "run_id": "no"})
    ).status == 404


async def test_cancel_a_trigger_fails_its_waiting_tasks(
    scene: Scene, acting: TestClient[Any, Any]
) -> None:
    response = await acting.post(
        "/actions/cancel-trigger",
        data={"trigger_id": str(scene.trigger_id), "token": TOKEN},
        allow_redirects=False,
    )
    assert (response.status, response.headers["Location"]) == (303, "/triggers")
    ti = await scene.store.task_try(DAG_ID, "r1", "c")
    assert ti is not None
    assert ti.state == "failed"
    assert ti.error == "cancelled by 127.0.0.1 from the status page"
    assert await scene.store.list_triggers() == []
    (audit,) = await scene.store.list_audit()
    assert (audit.action, audit.target) == ("cancel_trigger", f"trigger {scene.trigger_id}")


async def test_actions_with_bad_fields_are_400_and_an_unknown_trigger_404_unaudited(
    scene: Scene, acting: TestClient[Any, Any]
) -> None:
    for path, data in (
        ("/actions/cancel-trigger", {"trigger_id": "99999999999999999999"}),
        ("/actions/cancel-trigger", {"trigger_id": "-3"}),
        ("/actions/cancel-trigger", {"trigger_id": "x"}),
        ("/actions/mark", _task_form("a\x00", state="success")),
        ("/actions/clear", {**_task_form("a"), "run_id": "r\x00"}),
    ):
        response = await acting.post(path, data={**data, "token": TOKEN}, allow_redirects=False)
        assert response.status == 400, (path, data)
    response = await acting.post(
        "/actions/cancel-trigger",
        data={"trigger_id": str(scene.trigger_id + 1000), "token": TOKEN},
        allow_redirects=False,
    )
    assert response.status == 404
    assert await scene.store.list_audit() == []
    assert (await scene.store.task_try(DAG_ID, "r1", "c")).state == "deferred"  # type: ignore[union-attr]


async def test_pause_and_unpause_are_audited_and_shown_on_the_dag_pages(
    scene: Scene, acting: TestClient[Any, Any]
) -> None:
    text = await page(acting, "/dag?" + q(dag_id=DAG_ID))
    assert '<button type="submit">Pause</button>' in text
    response = await acting.post(
        "/actions/pause",
        data={"dag_id": DAG_ID, "paused": "true", "token": TOKEN},
        allow_redirects=False,
    )
    assert response.status == 303
    dag = await scene.store.get_dag(DAG_ID)
    assert dag is not None
    assert dag.is_paused
    assert [(a.action, a.target) for a in await scene.store.list_audit()] == [("pause", DAG_ID)]
    text = await page(acting, "/dag?" + q(dag_id=DAG_ID))
    assert "<strong>paused</strong>" in text
    assert '<button type="submit">Unpause</button>' in text
    listing = await page(acting, "/dags")
    assert re.search(r"<td>None</td><td>yes</td>", listing), listing
    # A DAG that does not exist: nothing done, nothing audited.
    response = await acting.post(
        "/actions/pause", data={"dag_id": "nope", "paused": "true", "token": TOKEN}
    )
    assert response.status == 404
    assert len(await scene.store.list_audit()) == 1


async def test_task_and_trigger_logs_are_shown_from_the_log_store_escaped(
    scene: Scene, client: TestClient[Any, Any]
) -> None:
    await scene.store.insert_task_logs(
        [TaskLogRow(DAG_ID, "r1", "c", 1, 1.0e9, "WARNING", "log", "user.code", f"task {XSS}")]
    )
    await scene.store.insert_trigger_logs(
        [TriggerLogRow(scene.trigger_id, 1.0e9, "INFO", "user.trigger", f"polling {XSS}")]
    )
    text = await page(client, "/task?" + q(dag_id=DAG_ID, run_id="r1", task_id="c"))
    log = text[text.index('id="log"') :]
    assert re.search(rf"WARNING +user.code: task {re.escape(ESCAPED)}", log), log
    trigger_log = text[text.index('id="trigger-log"') :]
    assert re.search(rf"INFO +user.trigger: polling {re.escape(ESCAPED)}", trigger_log)
    assert XSS not in text


async def test_an_action_cannot_redirect_off_the_site(
    scene: Scene, acting: TestClient[Any, Any]
) -> None:
    for target in ("//evil.example/", "/\\evil.example/", "https://evil.example/"):
        response = await acting.post(
            "/actions/clear",
            data=_task_form("a", token=TOKEN, next=target),
            allow_redirects=False,
        )
        assert response.headers["Location"].startswith("/task?"), target


# -- the command ---------------------------------------------------------------------------------


def test_enable_actions_without_a_token_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEFERRAL_WEBSERVER_TOKEN", raising=False)
    result = CliRunner().invoke(cli, ["webserver", "--enable-actions"])
    assert result.exit_code == 2
    assert "DEFERRAL_WEBSERVER_TOKEN" in result.output


def test_the_page_binds_to_loopback_by_default() -> None:
    from engine.config import load_settings

    settings = load_settings({})
    assert (settings.webserver_host, settings.webserver_port) == ("127.0.0.1", 8793)


async def test_an_address_that_cannot_be_bound_names_the_flag_to_change(store: Store) -> None:
    from engine.config import ConfigError
    from engine.web.server import WebServer

    with pytest.raises(ConfigError, match="--host") as bad_host:
        await WebServer(store, host="no-such-host.invalid", port=0).start()
    assert "--port" not in str(bad_host.value)
    taken = WebServer(store, host="127.0.0.1", port=0)
    await taken.start()
    try:
        with pytest.raises(ConfigError, match="--port"):
            await WebServer(store, host="127.0.0.1", port=taken.port).start()
    finally:
        taken.stop()
        await taken.run()


async def test_a_running_scheduler_is_in_the_fleet_until_it_stops(store: Store) -> None:
    from engine.testing import run_engine

    async with run_engine(store, worker=False, triggerer=False) as engine:
        (row,) = (await store.fleet()).schedulers
        assert row.id == engine.scheduler.id
        assert row.version == "0.1.0"
    assert (await store.fleet()).schedulers == []


@pytest.mark.subprocess
async def test_standalone_without_the_webserver_starts_three_processes(
    children: Children, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    proc = children.start("standalone", "--dags", str(dags), "--no-webserver", name="standalone")

    async def started() -> bool:
        return "started scheduler[" in children.output() or proc.poll() is not None

    async with explained(children):
        await wait_until(started, what="standalone to start its children")
    line = next(x for x in children.output().splitlines() if "started scheduler[" in x)
    assert "webserver[" not in line
    assert "triggerer[" in line
    assert "status page:" not in children.output()
