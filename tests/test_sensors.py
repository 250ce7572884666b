"""Every built-in sensor in every mode it supports, against real things: files in a temp dir,
a local aiohttp server, the test PostgreSQL, another DAG in the same store."""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiohttp import web

from engine import DAG
from engine.store import Store
from engine.testing import run_engine
from operators.python import PythonOperator, PythonSensor
from operators.sensors import (
    DateTimeSensor,
    ExternalTaskSensor,
    FileSensor,
    HttpSensor,
    SqlSensor,
    TimeDeltaSensor,
)
from tests.helpers import utcnow, wait_until
from tests.sensor_helpers import (
    FAST,
    MODES,
    http_server,
    task_instance,
    wait_checked_once,
)
from triggers.base import decode_value
from triggers.http import HttpResponse

pytestmark = pytest.mark.anyio

ALL_MODES = list(MODES)


def _done() -> str:
    return "done"


def _result(ti: dict[str, Any]) -> Any:
    return decode_value(ti["result"]) if ti["result"] is not None else None


# -- files --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ALL_MODES)
async def test_file_sensor_waits_for_the_file(store: Store, tmp_path: Path, mode: str) -> None:
    target = tmp_path / "in" / "data.csv"
    with DAG(dag_id="files") as dag:
        sensor = FileSensor(
            task_id="wait", filepath=str(tmp_path / "in" / "*.csv"), **FAST, **MODES[mode]
        )
        sensor >> PythonOperator(task_id="after", python_callable=_done)
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        await wait_checked_once(store, "files", "wait", mode)
        target.parent.mkdir()
        target.write_text("x")
        tis = await engine.finish("files")
    assert tis["__run__"]["state"] == "success"
    assert tis["wait"]["state"] == "success"
    assert _result(tis["wait"]) == [str(target)]
    assert tis["after"]["state"] == "success"


async def test_file_sensor_recursive_and_already_there_costs_no_deferral(
    store: Store, tmp_path: Path
) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.txt").write_text("x")
    with DAG(dag_id="files2") as dag:
        FileSensor(
            task_id="wait",
            filepath=str(tmp_path / "**" / "*.txt"),
            recursive=True,
            deferrable=True,
            **FAST,
        )
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        tis = await engine.finish("files2")
    assert tis["wait"]["state"] == "success"
    assert tis["wait"]["trigger_id"] is None
    assert engine.triggerer.fired == 0  # the first check on the worker was enough


# -- HTTP ---------------------------------------------------------------------------------


def ready_check(response: HttpResponse) -> bool:
    return bool(response.json()["ready"])


class _Service:
    def __init__(self) -> None:
        self.status = 503
        self.ready = False
        self.hits = 0
        self.auth: list[str | None] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        self.auth.append(request.headers.get("Authorization"))
        return web.json_response({"ready": self.ready}, status=self.status)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/status", self.handle)
        return app


@pytest.mark.parametrize("mode", ALL_MODES)
async def test_http_sensor_waits_for_status_and_check(store: Store, mode: str) -> None:
    service = _Service()
    async with http_server(service.app()) as base:
        with DAG(dag_id="http") as dag:
            HttpSensor(
                task_id="wait",
                url=f"{base}/status",
                response_check=ready_check,
                **FAST,
                **MODES[mode],
            )
        async with run_engine(store) as engine:
            await engine.start_run(dag)
            await wait_checked_once(store, "http", "wait", mode)
            service.status = 200  # 200 but not ready: still waiting
            hits = service.hits

            async def more_hits() -> bool:
                return service.hits > hits + 1

            await wait_until(more_hits)
            assert (await task_instance(store, "http", "wait")).state != "success"
            service.ready = True
            tis = await engine.finish("http")
    assert tis["wait"]["state"] == "success"
    assert _result(tis["wait"])["status"] == 200


async def test_http_sensor_uses_a_connection_id_for_url_and_credentials(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = _Service()
    service.status, service.ready = 200, True
    async with http_server(service.app()) as base:
        monkeypatch.setenv("DEFERRAL_CONN_JOBS_API", base.replace("://", "://robot:s3cret@"))
        with DAG(dag_id="http_conn") as dag:
            HttpSensor(task_id="wait", url="status", conn_id="jobs-api", **FAST, deferrable=True)
        async with run_engine(store) as engine:
            await engine.start_run(dag)
            tis = await engine.finish("http_conn")
    assert tis["wait"]["state"] == "success"
    assert service.auth
    assert all(a == "Basic cm9ib3Q6czNjcmV0" for a in service.auth)  # robot:s3cret


def test_a_deferrable_http_sensor_refuses_a_lambda_check() -> None:
    with pytest.raises(ValueError, match="import path"):
        HttpSensor(
            task_id="x", url="http://127.0.0.1/", response_check=lambda r: True, deferrable=True
        )


# -- SQL ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ALL_MODES)
async def test_sql_sensor_waits_for_a_truthy_first_cell(
    store: Store, db_url: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute("CREATE TABLE partitions (day date PRIMARY KEY, rows integer)")
        monkeypatch.setenv("DEFERRAL_CONN_WAREHOUSE", db_url)
        with DAG(dag_id="sql") as dag:
            SqlSensor(
                task_id="wait",
                conn="warehouse",
                sql="SELECT rows FROM partitions WHERE day = $1::text::date",
                parameters=["2026-11-29"],
                **FAST,
                **MODES[mode],
            )
        async with run_engine(store) as engine:
            await engine.start_run(dag)
            await wait_checked_once(store, "sql", "wait", mode)
            await conn.execute("INSERT INTO partitions VALUES ('2026-11-29', 0)")  # falsy
            await conn.execute("UPDATE partitions SET rows = 1200")
            tis = await engine.finish("sql")
    finally:
        await conn.close()
    assert tis["wait"]["state"] == "success"
    assert _result(tis["wait"]) == 1200


# -- another DAG --------------------------------------------------------------------------


def _external_dags() -> tuple[DAG, Any]:
    with DAG(dag_id="producer") as producer:
        PythonOperator(task_id="load", python_callable=_done)
    return producer, None


@pytest.mark.parametrize("mode", ALL_MODES)
async def test_external_task_sensor_waits_for_the_other_dag(
    store: Store,
    db_url: str,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    producer, _ = _external_dags()
    logical = dt.datetime(2026, 11, 29, 6, tzinfo=dt.UTC)
    with DAG(dag_id="consumer") as consumer:
        ExternalTaskSensor(
            task_id="wait",
            external_dag_id="producer",
            external_task_id="load",
            execution_delta=dt.timedelta(hours=1),
            **FAST,
            **MODES[mode],
        )
    async with run_engine(store) as engine:
        await engine.add_dag(producer)
        await engine.start_run(consumer, logical_date=logical)
        await wait_checked_once(store, "consumer", "wait", mode)
        missing = "no run of DAG producer exists at logical date 2026-11-29T05:00:00+00:00"

        async def said_so() -> bool:
            return missing in caplog.text

        # The first check finds no producer run and says so in the log at once.
        await wait_until(said_so, what="the log to name the missing run")
        await engine.start_run(producer, "p1", logical_date=logical - dt.timedelta(hours=1))
        tis = await engine.finish("consumer")
    assert tis["wait"]["state"] == "success"
    assert _result(tis["wait"])["state"] == "success"


@pytest.mark.parametrize("mode", ALL_MODES)
async def test_external_task_sensor_fails_fast_when_the_dates_do_not_line_up(
    store: Store, db_url: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer, _ = _external_dags()
    logical = dt.datetime(2026, 11, 29, 6, tzinfo=dt.UTC)
    with DAG(dag_id="consumer") as consumer:
        ExternalTaskSensor(
            task_id="wait",
            external_dag_id="producer",
            external_task_id="load",
            check_existence=True,
            retries=2,
            retry_delay=0,
            **FAST,
            **MODES[mode],
        )
    async with run_engine(store) as engine:
        await engine.start_run(producer, "p1", logical_date=logical - dt.timedelta(minutes=30))
        await engine.start_run(consumer, logical_date=logical)
        tis = await engine.finish("consumer")
    assert tis["wait"]["state"] == "failed"
    assert "no run of DAG producer exists" in tis["wait"]["error"]
    assert "2026-11-29T05:30:00+00:00" in tis["wait"]["error"]  # the nearest run is named


def _boom() -> None:
    raise RuntimeError("load failed")


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("soft_fail", [False, True])
async def test_external_task_sensor_stops_on_a_failed_state(
    store: Store, db_url: str, mode: str, soft_fail: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    with DAG(dag_id="producer") as producer:
        PythonOperator(task_id="load", python_callable=_boom)
    logical = dt.datetime(2026, 11, 29, 6, tzinfo=dt.UTC)
    with DAG(dag_id="consumer") as consumer:
        ExternalTaskSensor(
            task_id="wait",
            external_dag_id="producer",
            external_task_id="load",
            execution_date_fn=lambda d, _ctx: d.replace(hour=0),
            soft_fail=soft_fail,
            **FAST,
            **MODES[mode],
        )
    async with run_engine(store) as engine:
        await engine.add_dag(producer)
        await engine.start_run(consumer, logical_date=logical)
        await wait_checked_once(store, "consumer", "wait", mode)
        await engine.start_run(producer, "p1", logical_date=logical.replace(hour=0))
        tis = await engine.finish("consumer")
    assert tis["wait"]["state"] == ("skipped" if soft_fail else "failed")


# -- Python and time ------------------------------------------------------------------------

FLAGS: dict[str, bool] = {}


def flag_is_up(name: str) -> bool:
    return FLAGS.get(name, False)


async def async_flag_is_up(name: str) -> Any:
    return {"flag": name} if FLAGS.get(name) else None


@pytest.mark.parametrize("mode", ALL_MODES)
async def test_python_sensor(store: Store, mode: str) -> None:
    flag = f"flag-{mode}-{id(store)}"
    with DAG(dag_id="py") as dag:
        PythonSensor(
            task_id="wait",
            python_callable=flag_is_up,
            op_kwargs={"name": flag},
            async_check="tests.test_sensors.async_flag_is_up",
            **FAST,
            **MODES[mode],
        )
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        await wait_checked_once(store, "py", "wait", mode)
        FLAGS[flag] = True
        tis = await engine.finish("py")
    assert tis["wait"]["state"] == "success"
    if mode == "deferrable":
        assert _result(tis["wait"]) == {"flag": flag}


def test_a_deferrable_python_sensor_needs_an_async_check() -> None:
    with pytest.raises(ValueError, match="async_check"):
        PythonSensor(task_id="x", python_callable=lambda: True, deferrable=True)


@pytest.mark.parametrize("mode", ALL_MODES)
async def test_time_sensors(store: Store, mode: str) -> None:
    with DAG(dag_id="time") as dag:
        DateTimeSensor(
            task_id="at", target_time=utcnow() + dt.timedelta(seconds=0.2), **FAST, **MODES[mode]
        )
        TimeDeltaSensor(task_id="after", delta=0.2, **FAST, **MODES[mode])
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        tis = await engine.finish("time")
    assert tis["at"]["state"] == "success"
    assert tis["after"]["state"] == "success"


async def test_deferrable_follows_the_engines_default_at_run_time(
    store: Store, tmp_path: Path
) -> None:
    """default_deferrable reaches sensors through their context (no environment variable):
    a sensor not told defers; one told not to, or one that cannot defer, waits in its mode."""
    flag = tmp_path / "flag"
    with DAG(dag_id="defaults") as dag:
        FileSensor(task_id="untold", filepath=str(flag), **FAST)
        FileSensor(task_id="told", filepath=str(flag), deferrable=False, **FAST)
        PythonSensor(task_id="cannot", python_callable=flag.exists, **FAST)
    assert FileSensor(task_id="f", filepath=str(flag)).deferrable is None
    async with run_engine(store, default_deferrable=True) as engine:
        await engine.start_run(dag)
        untold = await engine.wait_for_state("defaults", "untold", "deferred")
        assert untold["trigger_id"] is not None
        # poke mode holds its slot and keeps checking: running, never deferred.
        await engine.wait_for_state("defaults", "told", "running")
        await engine.wait_for_state("defaults", "cannot", "running")
        flag.touch()
        tis = await engine.finish("defaults")
    assert {tis[t]["state"] for t in ("untold", "told", "cannot")} == {"success"}
