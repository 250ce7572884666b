"""Sensor timeouts in every mode, soft_fail, backoff, trigger rules around skipped and failed
upstreams, retries with backoff, and execution_timeout across a deferral."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from engine import DAG
from engine.store import Store
from engine.testing import run_engine
from operators.base import BaseOperator, Context
from operators.python import PythonOperator
from operators.sensors import FileSensor
from tests.sensor_helpers import MODES
from triggers.temporal import TimeDeltaTrigger

pytestmark = pytest.mark.anyio

ALL_MODES = list(MODES)
#: Long enough for several checks, short enough for a quick test.
SHORT_TIMEOUT = {"poke_interval": 0.02, "timeout": 0.3}


def _ok() -> str:
    return "ok"


def _boom() -> None:
    raise RuntimeError("boom")


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("soft_fail", [False, True])
async def test_timeout_fails_or_skips_without_using_retries(
    store: Store, tmp_path: Path, mode: str, soft_fail: bool
) -> None:
    with DAG(dag_id="timeouts") as dag:
        FileSensor(
            task_id="wait",
            filepath=str(tmp_path / "never"),
            soft_fail=soft_fail,
            retries=3,
            retry_delay=0,
            **SHORT_TIMEOUT,
            **MODES[mode],
        )
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        tis = await engine.finish("timeouts")
    wait = tis["wait"]
    assert wait["state"] == ("skipped" if soft_fail else "failed")
    assert wait["try_number"] == 1  # a timeout does not burn retries
    if not soft_fail:
        # Whichever way it waited, the error says it was the sensor's timeout, and after how long.
        assert "sensor timed out after " in wait["error"], wait["error"]


async def test_timeout_counts_from_the_first_try_across_reschedules(
    store: Store, tmp_path: Path
) -> None:
    # Every try is a single quick check; only the time since the first try can time it out.
    with DAG(dag_id="resched") as dag:
        FileSensor(
            task_id="wait", filepath=str(tmp_path / "never"), mode="reschedule", **SHORT_TIMEOUT
        )
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        tis = await engine.finish("resched")
    wait = tis["wait"]
    assert wait["state"] == "failed"
    assert "sensor timed out" in wait["error"]
    assert wait["try_number"] == 1
    assert wait["started_at"] > wait["first_try_at"]  # it was claimed again, more than once


async def test_timeout_counts_from_the_first_try_across_retries(
    store: Store, tmp_path: Path
) -> None:
    # A poke that raises uses a retry; the retried try keeps the first try's clock.
    class FlakySensor(FileSensor):
        def poke(self, context: Context) -> Any:
            if context["try_number"] == 1:
                raise OSError("share not mounted")
            return super().poke(context)

    with DAG(dag_id="retried") as dag:
        FlakySensor(
            task_id="wait",
            filepath=str(tmp_path / "never"),
            retries=1,
            retry_delay=0.2,
            mode="reschedule",
            **SHORT_TIMEOUT,
        )
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        tis = await engine.finish("retried")
    assert tis["wait"]["state"] == "failed"
    assert tis["wait"]["try_number"] == 2
    assert "sensor timed out" in tis["wait"]["error"]


def test_exponential_backoff_intervals() -> None:
    sensor = FileSensor(
        task_id="f", filepath="/x", poke_interval=1, exponential_backoff=True, max_wait=5
    )
    elapsed, waits = 0.0, []
    for _ in range(6):
        wait = sensor.interval_s(elapsed)
        waits.append(wait)
        elapsed += wait
    assert waits == [1, 1, 2, 4, 5, 5]
    plain = FileSensor(task_id="g", filepath="/x", poke_interval=2)
    assert [plain.interval_s(e) for e in (0, 10, 100)] == [2, 2, 2]


def test_a_sensor_timeout_is_marked_no_retry_in_the_stored_dag() -> None:
    with DAG(dag_id="marks") as dag:
        FileSensor(task_id="s", filepath="/x")
        PythonOperator(task_id="p", python_callable=_ok)
    marks = {t["task_id"]: t["no_retry_on_timeout"] for t in dag.serialize_tasks()}
    assert marks == {"s": True, "p": False}


# -- trigger rules ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ALL_MODES)
async def test_soft_fail_sensor_and_none_failed_downstream(
    store: Store, tmp_path: Path, mode: str
) -> None:
    with DAG(dag_id="softfail") as dag:
        sensor = FileSensor(
            task_id="wait",
            filepath=str(tmp_path / "never"),
            soft_fail=True,
            **SHORT_TIMEOUT,
            **MODES[mode],
        )
        ok = PythonOperator(task_id="ok", python_callable=_ok)
        report = PythonOperator(task_id="report", python_callable=_ok, trigger_rule="none_failed")
        strict = PythonOperator(task_id="strict", python_callable=_ok)  # all_success
        [sensor, ok] >> report
        sensor >> strict
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        tis = await engine.finish("softfail")
    assert tis["wait"]["state"] == "skipped"
    assert tis["report"]["state"] == "success"
    assert tis["strict"]["state"] == "skipped"
    assert tis["__run__"]["state"] == "success"


RULES_AFTER_SKIPPED_AND_SUCCESS = {
    "all_success": "skipped",
    "none_failed": "success",
    "none_failed_min_one_success": "success",
    "none_skipped": "skipped",
    "one_success": "success",
    "all_done": "success",
    "one_failed": "skipped",
    "always": "success",
}

RULES_AFTER_FAILED_AND_SUCCESS = {
    "all_success": "upstream_failed",
    "none_failed": "upstream_failed",
    "none_failed_min_one_success": "upstream_failed",
    "one_success": "success",
    "one_failed": "success",
    "all_failed": "skipped",
    "all_done": "success",
    "none_skipped": "success",
    "always": "success",
}


async def _rules_run(
    store: Store, tmp_path: Path, dag_id: str, rules: dict[str, str], failing: bool
) -> dict[str, dict[str, Any]]:
    with DAG(dag_id=dag_id) as dag:
        if failing:
            first: BaseOperator = PythonOperator(task_id="first", python_callable=_boom)
        else:
            first = FileSensor(
                task_id="first",
                filepath=str(tmp_path / "never"),
                soft_fail=True,
                deferrable=True,
                **SHORT_TIMEOUT,
            )
        second = PythonOperator(task_id="second", python_callable=_ok)
        for rule in rules:
            [first, second] >> PythonOperator(task_id=rule, python_callable=_ok, trigger_rule=rule)
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        return await engine.finish(dag_id)


async def test_trigger_rules_after_a_skipped_upstream(store: Store, tmp_path: Path) -> None:
    tis = await _rules_run(store, tmp_path, "rules_skip", RULES_AFTER_SKIPPED_AND_SUCCESS, False)
    assert tis["first"]["state"] == "skipped"
    assert {r: tis[r]["state"] for r in RULES_AFTER_SKIPPED_AND_SUCCESS} == (
        RULES_AFTER_SKIPPED_AND_SUCCESS
    )


async def test_trigger_rules_after_a_failed_upstream(store: Store, tmp_path: Path) -> None:
    tis = await _rules_run(store, tmp_path, "rules_fail", RULES_AFTER_FAILED_AND_SUCCESS, True)
    assert tis["first"]["state"] == "failed"
    assert {r: tis[r]["state"] for r in RULES_AFTER_FAILED_AND_SUCCESS} == (
        RULES_AFTER_FAILED_AND_SUCCESS
    )
    assert tis["__run__"]["state"] == "failed"


# -- retries and execution_timeout --------------------------------------------------------


def _fails_twice(try_number: int) -> int:
    if try_number < 3:
        raise RuntimeError(f"try {try_number} fails")
    return try_number


async def test_retries_with_exponential_backoff(store: Store) -> None:
    with DAG(dag_id="retries") as dag:
        PythonOperator(
            task_id="flaky",
            python_callable=_fails_twice,
            retries=3,
            retry_delay=0.02,
            retry_exponential_backoff=True,
            max_retry_delay=0.05,
        )
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        tis = await engine.finish("retries")
    assert tis["flaky"]["state"] == "success"
    assert tis["flaky"]["try_number"] == 3


async def test_retry_delays_double_up_to_the_cap(db_url: str) -> None:
    # The policy itself: deferral_retry_at in the schema, on the database clock.
    conn = await asyncpg.connect(db_url)
    try:
        delays = [
            await conn.fetchval(
                "SELECT EXTRACT(EPOCH FROM deferral_retry_at($1, 10, true, 60) - now())", n
            )
            for n in (1, 2, 3, 4, 5)
        ]
    finally:
        await conn.close()
    assert [round(float(d)) for d in delays] == [10, 20, 40, 60, 60]


class _WaitsAnHour(BaseOperator):
    def execute(self, context: Context) -> None:
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(hours=1)), method_name="done")

    def done(self, context: Context, event: Any = None) -> str:
        return "resumed"


async def test_execution_timeout_keeps_counting_across_a_deferral(store: Store) -> None:
    with DAG(dag_id="exec_timeout") as dag:
        _WaitsAnHour(task_id="op", execution_timeout=0.3, retries=1, retry_delay=0)
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        tis = await engine.finish("exec_timeout")
    op = tis["op"]
    assert op["state"] == "failed"
    assert op["error"].startswith("execution_timeout of 0.3s passed while deferred")
    assert op["try_number"] == 2  # an operator's timeout uses its retries; a sensor's does not
