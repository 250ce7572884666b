"""The built-in triggers, run on their own with the authoring kit against real things."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import asyncpg
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from engine import DAG
from engine.store import Store
from engine.testing import assert_serializable, run_trigger
from operators.python import PythonOperator
from tests.sensor_helpers import http_server
from triggers.base import BaseTrigger, TaskFailedEvent, TaskSkippedEvent, TaskSuccessEvent
from triggers.connections import ConnectionNotFound, conn_env_name, resolve_url
from triggers.external_task import TaskStateTrigger
from triggers.file import FileTrigger
from triggers.http import HttpResponse, HttpTrigger
from triggers.python import PythonTrigger
from triggers.sql import SqlTrigger
from triggers.temporal import DateTimeTrigger, TimeDeltaTrigger

pytestmark = pytest.mark.anyio

MOMENT = dt.datetime(2026, 11, 29, 12, tzinfo=dt.UTC)


def accept_all(response: HttpResponse) -> bool:
    return response.status == 200


async def always_ready(**kwargs: object) -> dict[str, object]:
    return {"ready": True, **kwargs}


BUILT_INS: list[BaseTrigger] = [
    DateTimeTrigger(MOMENT),
    DateTimeTrigger(MOMENT, end_from_trigger=True),
    TimeDeltaTrigger(dt.timedelta(minutes=5)),
    FileTrigger("/data/*.csv", recursive=True, poll_interval=0.5),
    HttpTrigger(
        "https://example.org/health",
        method="post",
        headers={"X-A": "1"},
        data="{}",
        expected_status=[200, 204],
        response_check="tests.test_triggers_builtin.accept_all",
        conn_id=None,
        poll_interval=2,
    ),
    HttpTrigger("jobs/1", conn_id="jobs_api", end_from_trigger=True),
    SqlTrigger("warehouse", "SELECT count(*) FROM t WHERE day = $1", parameters=["2026-11-29"]),
    SqlTrigger("postgresql://u@localhost/db", "SELECT true"),
    TaskStateTrigger("producer", "load", MOMENT, states=["success"], check_existence=True),
    TaskStateTrigger("producer", None, MOMENT.isoformat(), soft_fail=True, conn="other"),
    PythonTrigger("tests.test_triggers_builtin.always_ready", kwargs={"n": 1}),
]


@pytest.mark.parametrize("trigger", BUILT_INS, ids=repr)
def test_every_built_in_trigger_is_serializable(trigger: BaseTrigger) -> None:
    rebuilt = assert_serializable(trigger)
    assert rebuilt.serialize() == trigger.serialize()


@given(
    path=st.text(min_size=1, max_size=40).filter(lambda s: "\x00" not in s),
    recursive=st.booleans(),
    interval=st.floats(min_value=0, max_value=1e6),
)
def test_file_trigger_round_trips_any_path(path: str, recursive: bool, interval: float) -> None:
    assert_serializable(FileTrigger(path, recursive=recursive, poll_interval=interval))


def test_connections_come_from_the_environment() -> None:
    env = {"DEFERRAL_CONN_JOBS_API": "https://u:p@jobs", "DEFERRAL_DATABASE_URL": "postgresql://d"}
    assert conn_env_name("jobs-api") == "DEFERRAL_CONN_JOBS_API"
    assert resolve_url("jobs-api", env) == "https://u:p@jobs"
    assert resolve_url("postgresql://x/y", env) == "postgresql://x/y"
    assert resolve_url("deferral", env) == "postgresql://d"
    with pytest.raises(ConnectionNotFound, match="DEFERRAL_CONN_NOPE"):
        resolve_url("nope", env)


async def test_file_trigger_fires_on_a_file_created_later(tmp_path: Path) -> None:
    trigger = FileTrigger(str(tmp_path / "*.csv"), poll_interval=0.01)
    assert await trigger.check() is None
    (tmp_path / "a.csv").write_text("1")
    event = await run_trigger(trigger)
    assert event.payload == [str(tmp_path / "a.csv")]


async def test_file_trigger_ignores_an_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    trigger = FileTrigger(str(tmp_path / "empty"))
    assert await trigger.check() is None
    (tmp_path / "empty" / "x").write_text("")
    assert await trigger.check() == [str(tmp_path / "empty")]


async def test_http_trigger_retries_until_the_expected_status() -> None:
    answers = iter([500, 404, 200])

    async def handle(_request: web.Request) -> web.Response:
        return web.Response(text="ok", status=next(answers, 200))

    app = web.Application()
    app.router.add_get("/", handle)
    async with http_server(app) as base:
        event = await run_trigger(
            HttpTrigger(f"{base}/", poll_interval=0.01, end_from_trigger=True)
        )
    assert isinstance(event, TaskSuccessEvent)
    assert event.payload["status"] == 200


async def test_http_trigger_waits_through_connection_errors() -> None:
    async with http_server(web.Application()) as base:
        pass  # the server is gone: its port refuses connections now
    trigger = HttpTrigger(f"{base}/", poll_interval=0.01, request_timeout=1)
    assert await trigger.check() is None


async def test_sql_trigger_fires_on_a_truthy_first_cell(db_url: str) -> None:
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute("CREATE TABLE ready (ok boolean)")
        trigger = SqlTrigger(db_url, "SELECT ok FROM ready", poll_interval=0.01)
        assert await trigger.check() is None  # no row
        await conn.execute("INSERT INTO ready VALUES (false)")
        assert await trigger.check() is None  # falsy
        await trigger.cleanup()
        await conn.execute("UPDATE ready SET ok = true")
        event = await run_trigger(trigger)
    finally:
        await conn.close()
    assert event.payload is None  # a bare true is no payload


def _ok() -> str:
    return "ok"


def _boom() -> None:
    raise RuntimeError("no")


async def test_task_state_trigger_reads_the_engine_tables(store: Store, db_url: str) -> None:
    with DAG(dag_id="producer") as dag:
        PythonOperator(task_id="load", python_callable=_ok)
    await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
    await store.create_dag_run("producer", "p1", logical_date=MOMENT)
    waiting = TaskStateTrigger("producer", "load", MOMENT, states=["scheduled"], conn=db_url)
    event = await run_trigger(waiting)
    assert event.payload == {
        "dag_id": "producer",
        "task_id": "load",
        "run_id": "p1",
        "state": "scheduled",
    }
    whole_run = TaskStateTrigger("producer", None, MOMENT, states=["running"], conn=db_url)
    assert (await run_trigger(whole_run)).payload["state"] == "running"
    failed = TaskStateTrigger(
        "producer", "load", MOMENT, states=["success"], failed_states=["scheduled"], conn=db_url
    )
    assert isinstance(await run_trigger(failed), TaskFailedEvent)
    skipped = TaskStateTrigger(
        "producer", "load", MOMENT, failed_states=["scheduled"], soft_fail=True, conn=db_url
    )
    assert isinstance(await run_trigger(skipped), TaskSkippedEvent)
    missing_task = TaskStateTrigger("producer", "nope", MOMENT, check_existence=True, conn=db_url)
    event = await run_trigger(missing_task)
    assert isinstance(event, TaskFailedEvent)
    assert "has no task 'nope'" in event.payload
    other_date = TaskStateTrigger(
        "producer", "load", MOMENT + dt.timedelta(days=1), check_existence=True, conn=db_url
    )
    event = await run_trigger(other_date)
    assert isinstance(event, TaskFailedEvent)
    assert MOMENT.isoformat() in event.payload  # names the nearest run that exists


async def test_python_trigger_awaits_the_check() -> None:
    event = await run_trigger(
        PythonTrigger("tests.test_triggers_builtin.always_ready", kwargs={"n": 2})
    )
    assert event.payload == {"ready": True, "n": 2}


def test_python_trigger_refuses_a_sync_check() -> None:
    with pytest.raises(TypeError, match="async def"):
        PythonTrigger("tests.test_triggers_builtin.accept_all")


def test_http_trigger_refuses_an_unimportable_check() -> None:
    with pytest.raises(ValueError, match="cannot be imported"):
        HttpTrigger("http://127.0.0.1/", response_check="tests.nowhere.check")


async def test_date_time_trigger_in_the_past_fires_at_once() -> None:
    event = await run_trigger(DateTimeTrigger(MOMENT - dt.timedelta(days=1), end_from_trigger=True))
    assert isinstance(event, TaskSuccessEvent)
