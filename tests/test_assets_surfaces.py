"""Assets from outside (issue 22): ``deferral assets list/events/emit``, ``runs list --json``'s
triggering_asset_events, and the webhook (``POST /api/assets/{name}/events``) on a real
server, with and without its token."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from click.testing import CliRunner, Result

from engine import DAG, Asset, AssetWatcher
from engine.cli import cli
from engine.scheduler.dagrecord import record_dags
from engine.store import Store
from engine.web.server import WebServer
from operators.python import PythonOperator
from tests.helpers import wait_until
from tests.processes import Children, explained
from triggers.events import DirectoryTrigger

pytestmark = pytest.mark.anyio

ORDERS = Asset(
    "orders",
    uri="postgres://warehouse/orders",
    watchers=[AssetWatcher("orders_tick", trigger=DirectoryTrigger("/data/orders"))],
)
TOKEN = "s3cret-webhook-token"


def invoke(db_url: str, *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env={"DEFERRAL_DATABASE_URL": db_url})


async def ainvoke(db_url: str, *args: str) -> Result:
    return await anyio.to_thread.run_sync(functools.partial(invoke, db_url, *args))


async def _record(store: Store) -> None:
    with DAG("producer") as producer:
        PythonOperator(task_id="load", python_callable=print, outlets=[ORDERS])
    with DAG("consumer", schedule=[ORDERS]) as consumer:
        PythonOperator(task_id="use", python_callable=print)
    await record_dags(store, [producer, consumer])


async def test_assets_list_events_and_emit(store: Store, db_url: str) -> None:
    await _record(store)
    listed = await ainvoke(db_url, "assets", "list", "--json")
    assert listed.exit_code == 0, listed.output
    (row,) = json.loads(listed.output)
    assert row["name"] == "orders"
    assert row["uri"] == "postgres://warehouse/orders"
    assert row["group"] == "asset"
    # (No triggerer runs: the watcher waits for one; tests/test_watchers.py runs them.)
    assert row["watchers"] == [
        {
            "name": "orders_tick",
            "classpath": "triggers.events.DirectoryTrigger",
            "state": "unclaimed",
            "triggerer": None,
            "triggerer_id": None,
            "events": 0,
            "restarts": 0,
            "last_error": None,
            "last_error_at": None,
            "retry_at": None,
        }
    ]
    assert row["scheduled_dags"] == ["consumer"]
    assert row["producing_dags"] == ["producer"]
    assert row["last_event"] is None

    emitted = await ainvoke(db_url, "assets", "emit", "orders", "--extra", '{"rows": 7}')
    assert emitted.exit_code == 0, emitted.output
    event_id = int(re.search(r"asset event (\d+)", emitted.output).group(1))  # type: ignore[union-attr]
    events = json.loads((await ainvoke(db_url, "assets", "events", "orders", "--json")).output)
    assert [(e["id"], e["extra"], e["source_kind"]) for e in events] == [
        (event_id, {"rows": 7}, "cli")
    ]
    (row,) = json.loads((await ainvoke(db_url, "assets", "list", "--json")).output)
    assert (row["last_event"]["id"], row["last_event"]["source_kind"]) == (event_id, "cli")
    table = await ainvoke(db_url, "assets", "list")
    assert "orders_tick" in table.output
    assert "consumer" in table.output
    assert await store.queued_asset_events("consumer") == [("consumer", "orders", event_id)]

    # bad input: a clear error, exit 2, nothing written
    for args, message in (
        (("emit", "orders", "--extra", "{not json"), "not JSON"),
        (("emit", "orders", "--extra", "[1, 2]"), "must be a JSON object"),
        (("emit", "nope"), "unknown asset 'nope'"),
        (("events", "nope"), "unknown asset 'nope'"),
    ):
        result = await ainvoke(db_url, "assets", *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output
    assert len(await store.asset_events("orders")) == 1


async def test_runs_list_json_shows_the_triggering_events(store: Store, db_url: str) -> None:
    await _record(store)
    await ainvoke(db_url, "assets", "emit", "orders", "--extra", '{"n": 1}')
    await ainvoke(db_url, "assets", "emit", "orders", "--extra", '{"n": 2}')
    (made,) = await store.create_asset_runs()
    assert made.events == 2
    result = await ainvoke(db_url, "runs", "list", "--dag", "consumer", "--json")
    (run,) = json.loads(result.output)
    assert run["run_type"] == "asset_triggered"
    assert [e["extra"] for e in run["triggering_asset_events"]["orders"]] == [{"n": 1}, {"n": 2}]
    assert {e["source_kind"] for e in run["triggering_asset_events"]["orders"]} == {"cli"}


@pytest.fixture
async def served(store: Store) -> AsyncIterator[Any]:
    servers: list[WebServer] = []

    async def serve(token: str | None) -> str:
        server = WebServer(store, host="127.0.0.1", port=0, webhook_token=token)
        await server.start()
        servers.append(server)
        return f"http://127.0.0.1:{server.port}"

    yield serve
    for server in servers:
        server.stop()
        await server.run()


async def _post(
    url: str, body: Any = None, token: str | None = None, raw: bytes | None = None
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers=headers) as r,
    ):
        return r.status, await r.json()


async def test_the_webhook_without_a_token_configured_refuses(store: Store, served: Any) -> None:
    await _record(store)
    base = await served(None)
    status, body = await _post(f"{base}/api/assets/orders/events", {"extra": {}}, token="x")
    assert status == 403
    assert "webhook_token" in body["error"]
    assert await store.asset_events("orders") == []


async def test_the_webhook_with_its_token(store: Store, served: Any) -> None:
    await _record(store)
    base = await served(TOKEN)
    url = f"{base}/api/assets/orders/events"
    status, body = await _post(url, {"extra": {"rows": 3}}, token=TOKEN)
    assert status == 200, body
    (event,) = await store.asset_events("orders")
    assert body["id"] == event.id
    assert (event.extra, event.source_kind) == ({"rows": 3}, "webhook")
    # no body at all: an event without extra
    status, body = await _post(url, token=TOKEN)
    assert status == 200, body
    assert await store.queued_asset_events("consumer") != []
    for kwargs, expected in (
        ({"body": {"extra": {}}}, 401),  # no token
        ({"body": {"extra": {}}, "token": "wrong"}, 401),
        ({"raw": b"{nope", "token": TOKEN}, 400),
        ({"body": {"extra": [1]}, "token": TOKEN}, 400),
        ({"body": {"other": 1}, "token": TOKEN}, 400),
        ({"body": [1, 2], "token": TOKEN}, 400),
    ):
        status, answer = await _post(url, **kwargs)
        assert status == expected, (kwargs, answer)
        assert answer["error"]
    async with aiohttp.ClientSession() as session:
        lower = {"Authorization": f"bearer {TOKEN}"}  # (the scheme is case-insensitive)
        async with session.post(url, json={"extra": {"case": 1}}, headers=lower) as r:
            assert r.status == 200
    status, answer = await _post(f"{base}/api/assets/nope/events", {"extra": {}}, token=TOKEN)
    assert status == 404
    assert "unknown asset 'nope'" in answer["error"]
    assert len(await store.asset_events("orders")) == 3  # the refused ones wrote nothing


async def test_the_webhook_of_a_webserver_process(
    store: Store, children: Children, tmp_path: Path
) -> None:
    await _record(store)
    children.env["DEFERRAL_WEBHOOK_TOKEN"] = TOKEN
    children.start("webserver", "--port", "0", name="webserver")
    found: list[str] = []

    async def listening() -> bool:
        match = re.search(r"deferral webserver: (http://\S+)/", children.output())
        if match:
            found.append(match.group(1))
        return bool(match)

    async with explained(children):
        await wait_until(listening, what="the webserver to listen")
    url = f"{found[0]}/api/assets/orders/events"
    assert (await _post(url, {"extra": {"a": 1}}))[0] == 401
    status, body = await _post(url, {"extra": {"a": 1}}, token=TOKEN)
    assert status == 200, body
    assert [e.id for e in await store.asset_events("orders")] == [body["id"]]


async def test_the_run_page_lists_the_triggering_events(store: Store, served: Any) -> None:
    await _record(store)
    from engine.store.models import NewAssetEvent

    await store.record_asset_events(
        [NewAssetEvent(asset="orders", extra={"batch": "b-77"}, source_kind="webhook")]
    )
    (made,) = await store.create_asset_runs()
    base = await served(None)
    async with aiohttp.ClientSession() as session:
        params = {"dag_id": "consumer", "run_id": made.run_id}
        async with session.get(f"{base}/run", params=params) as response:
            assert response.status == 200
            page = await response.text()
    assert "Triggering asset events" in page
    assert "b-77" in page
    assert "asset_triggered" in page
