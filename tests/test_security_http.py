"""HttpTrigger sends a connection's credentials only to the connection's own scheme, host and
port: two real aiohttp servers on 127.0.0.1, one the connection, the other somewhere else."""

from __future__ import annotations

import base64
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from engine import DAG
from engine.store import Store
from engine.testing import run_engine
from operators.base import BaseOperator, Context
from tests.sensor_helpers import http_server
from triggers.http import CredentialsRefused, HttpTrigger

pytestmark = pytest.mark.anyio

CONN = "jobs_api"
SECRET = "s3cret-token"


class Server:
    """An HTTP server that records the Authorization header of every request it gets."""

    def __init__(self, redirect_to: str | None = None) -> None:
        self.seen: list[str | None] = []
        self.redirect_to = redirect_to
        self.app = web.Application()
        self.app.router.add_get("/{tail:.*}", self._handle)

    async def _handle(self, request: web.Request) -> web.Response:
        self.seen.append(request.headers.get("Authorization"))
        if self.redirect_to is not None:
            raise web.HTTPFound(self.redirect_to)
        return web.Response(text="done")


@contextlib.asynccontextmanager
async def two_servers(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[Server, str, Server, str]]:
    """The connection's server (its URL, with credentials, in DEFERRAL_CONN_JOBS_API) and
    another on a second port of the same host."""
    conn, other = Server(), Server()
    async with http_server(conn.app) as conn_base, http_server(other.app) as other_base:
        assert conn_base != other_base
        monkeypatch.setenv(
            "DEFERRAL_CONN_JOBS_API", conn_base.replace("http://", f"http://robot:{SECRET}@")
        )
        yield conn, conn_base, other, other_base


def _basic() -> str:
    return "Basic " + base64.b64encode(f"robot:{SECRET}".encode()).decode()


async def test_an_absolute_url_on_another_port_is_refused_and_gets_no_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with two_servers(monkeypatch) as (conn, _, other, other_base):
        trigger = HttpTrigger(f"{other_base}/steal", conn_id=CONN)
        with pytest.raises(CredentialsRefused) as info:
            await trigger.check()
    assert other.seen == []
    assert conn.seen == []
    assert SECRET not in str(info.value)
    assert other_base not in str(info.value)


@pytest.mark.parametrize(
    "make_url",
    [
        pytest.param(lambda base: base.replace("http://", "https://") + "/x", id="scheme"),
        pytest.param(lambda base: base.replace("127.0.0.1", "localhost") + "/x", id="host"),
        pytest.param(lambda base: "//evil.example/x", id="network-path"),
    ],
)
async def test_any_other_origin_is_refused(monkeypatch: pytest.MonkeyPatch, make_url: Any) -> None:
    async with two_servers(monkeypatch) as (conn, conn_base, _, _):
        trigger = HttpTrigger(make_url(conn_base), conn_id=CONN)
        with pytest.raises(CredentialsRefused):
            await trigger.check()
    assert conn.seen == []


async def test_relative_and_same_origin_urls_carry_the_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with two_servers(monkeypatch) as (conn, conn_base, other, _):
        assert await HttpTrigger("status", conn_id=CONN).check() is not None
        assert await HttpTrigger(f"{conn_base}/status", conn_id=CONN).check() is not None
    assert conn.seen == [_basic()] * 2
    assert other.seen == []


async def test_a_redirect_to_another_origin_drops_the_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with two_servers(monkeypatch) as (conn, _, other, other_base):
        conn.redirect_to = f"{other_base}/landed"
        assert await HttpTrigger("start", conn_id=CONN).check() is not None
    assert conn.seen == [_basic()]
    assert other.seen == [None]


class DeferOnHttp(BaseOperator):
    def __init__(self, *, url: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.url = url

    def execute(self, context: Context) -> None:
        trigger = HttpTrigger(self.url, conn_id=CONN, poll_interval=0.05)
        self.defer(trigger=trigger, method_name="done")

    def done(self, context: Context, event: Any) -> Any:
        return event


async def test_in_the_triggerer_the_refusal_fails_the_task_and_sends_nothing(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with two_servers(monkeypatch) as (conn, _, other, other_base):
        with DAG(dag_id="leak") as dag:
            DeferOnHttp(task_id="wait", url=f"{other_base}/steal")
        async with run_engine(store) as engine:
            tis = await engine.run_dag(dag)
    assert tis["wait"]["state"] == "failed"
    assert "CredentialsRefused" in tis["wait"]["error"]
    assert SECRET not in tis["wait"]["error"]
    assert other.seen == []
    assert conn.seen == []
