"""Messages that say what happened: a deferral timeout names its trigger (id and classpath),
a wrong ``method_name`` suggests the close ones, a sensor timeout says it was the sensor's
``timeout`` and that it is not retried on purpose, and Ctrl-C on ``dags trigger --wait`` says
the run goes on and how to follow it."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import msgspec
import pytest

from engine import DAG
from engine.store import Store
from engine.testing import run_engine
from operators.base import BaseOperator, Context, TriggerSerializationError
from operators.sensors import BaseSensorOperator, SensorTimeout
from tests.helpers import child_env, claimed_tasks, never_deferral, wait_until
from tests.triggers_for_tests import NeverTrigger, RaisingTrigger

pytestmark = pytest.mark.anyio

NEVER = "tests.triggers_for_tests.NeverTrigger"


# -- a deferral timeout names its trigger --------------------------------------------------------


async def test_timeout_deferrals_returns_the_trigger_it_cleared(store: Store) -> None:
    """The update clears the task's trigger_id; what it returns is the one it waited on."""
    dag_id, worker, (by_id, by_backstop) = await claimed_tasks(store, 2, "timeouts")
    for ti, tag in ((by_id, "by-id"), (by_backstop, "backstop")):
        deferral = msgspec.structs.replace(never_deferral(tag), timeout_s=0.0)
        assert await store.defer_task(ti.id, worker, deferral)
    parked = {ti.id: ti.trigger_id for ti in await store.list_task_instances(dag_id=dag_id)}
    assert None not in parked.values()

    (row,) = await store.timeout_deferrals([parked[by_id.id]])
    assert (row.id, row.trigger_id, row.classpath) == (by_id.id, parked[by_id.id], NEVER)
    (row,) = await store.timeout_deferrals(None, grace_s=0.0)
    assert (row.id, row.trigger_id, row.classpath) == (
        by_backstop.id,
        parked[by_backstop.id],
        NEVER,
    )
    assert {ti.trigger_id for ti in await store.list_task_instances(dag_id=dag_id)} == {None}


class DefersBriefly(BaseOperator):
    def execute(self, context: Context) -> None:
        self.defer(
            trigger=NeverTrigger("brief"), method_name="resume", timeout=dt.timedelta(seconds=0.2)
        )

    def resume(self, context: Context, event: Any) -> None:
        raise AssertionError("never resumed")


async def test_the_triggerer_log_names_the_trigger_that_timed_out(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="engine.triggerer")
    with DAG(dag_id="brief") as dag:
        DefersBriefly(task_id="waits")
    async with run_engine(store, dags=[dag]) as engine:
        await engine.start_run(dag)
        ti = await engine.wait_for_state("brief", "waits", "deferred")
        trigger_id = ti["trigger_id"]
        await engine.wait_for_state("brief", "waits", "failed")
    (message,) = [r.getMessage() for r in caplog.records if "timed out waiting" in r.message]
    assert f"trigger {trigger_id} ({NEVER})" in message, message
    assert "(waits)" in message
    assert "now failed" in message
    assert "trigger None" not in message


# -- did you mean ------------------------------------------------------------------------------


class Misnamed(BaseOperator):
    def execute(self, context: Context) -> None:
        self.defer(trigger=NeverTrigger("x"), method_name="execute_complet")

    def execute_complete(self, context: Context, event: Any) -> None:
        return None


class Unrelated(Misnamed):
    def execute(self, context: Context) -> None:
        self.defer(trigger=NeverTrigger("x"), method_name="zzz")


def test_a_wrong_method_name_suggests_the_close_ones() -> None:
    with pytest.raises(TriggerSerializationError) as caught:
        Misnamed(task_id="m").execute({})
    assert "did you mean 'execute_complete'" in str(caught.value), caught.value
    with pytest.raises(TriggerSerializationError) as caught:
        Unrelated(task_id="u").execute({})
    assert "did you mean" not in str(caught.value)
    assert "(its methods: execute_complete)" in str(caught.value), caught.value


# -- a sensor's timeout ------------------------------------------------------------------------


class NeverTrue(BaseSensorOperator):
    def poke(self, context: Context) -> bool:
        return False


def test_a_sensor_timeout_says_it_is_the_sensors_timeout_and_not_retried() -> None:
    sensor = NeverTrue(task_id="s", timeout=0.2, poke_interval=0.01, retries=3)
    with pytest.raises(SensorTimeout) as caught:
        sensor.execute({})
    message = str(caught.value)
    assert re.match(r"sensor timed out after \d+\.\ds: its timeout of 0\.2s", message), message
    assert "not retried, on purpose" in message


# -- Ctrl-C on dags trigger --wait -------------------------------------------------------------


async def test_ctrl_c_on_dags_trigger_wait_says_the_run_goes_on(
    db_url: str, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "idle.py").write_text(
        textwrap.dedent(
            """
            from engine import DAG
            from operators.python import PythonOperator

            with DAG(dag_id="idle"):
                PythonOperator(task_id="t", python_callable=lambda: 1)
            """
        )
    )
    args = ["dags", "trigger", "idle", "--dags", str(dags), "--run-id", "r 1", "--wait"]
    proc = await anyio.to_thread.run_sync(
        functools.partial(
            subprocess.Popen,
            [sys.executable, "-m", "engine", *args],
            env=child_env(DATABASE_URL=db_url),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    )
    watch = await asyncpg.connect(db_url)
    try:
        # Nobody runs the DAG: the command waits, listening for runs that end.
        async def listening() -> bool:
            return bool(
                await watch.fetchval(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND query ILIKE 'LISTEN%deferral_runs%'"
                )
            )

        await wait_until(listening, what="dags trigger --wait to wait")
        proc.send_signal(signal.SIGINT)
        out, err = await anyio.to_thread.run_sync(functools.partial(proc.communicate, timeout=60))
    finally:
        await watch.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err.decode()
    assert proc.returncode == 130, (out, text)
    assert "the run goes on; follow it with: deferral runs wait idle 'r 1'" in text, text
    assert "Aborted" not in text
    assert "Traceback" not in text


# -- a task's or a trigger's traceback starts at its own code ------------------------------------


def _raises_in_user_code() -> None:
    raise ValueError("raised by the task's own function")


class _DefersToARaisingTrigger(BaseOperator):
    def execute(self, context: Context) -> None:
        self.defer(trigger=RaisingTrigger("raised by the trigger"), method_name="execute")


ENGINE_DIR = str(Path(__file__).resolve().parents[1] / "engine")


def _frames(error: str) -> list[str]:
    return re.findall(r'^  File "([^"]+)"', error, re.MULTILINE)


async def test_a_failed_tasks_traceback_starts_at_the_authors_code(store: Store) -> None:
    """The stored error began with a screen of worker.py, anyio and asyncio frames above the
    one frame the DAG author wrote; it starts at the operator's and the author's code (a
    trigger's, at its run()), the frames below it all kept."""
    from operators.python import PythonOperator

    with DAG(dag_id="tracebacks") as dag:
        PythonOperator(task_id="py", python_callable=_raises_in_user_code)
        _DefersToARaisingTrigger(task_id="trig")
    async with run_engine(store, dags=[dag]) as engine:
        await engine.run_dag(dag, "r1")
    errors = {
        ti.task_id: ti.error or "" for ti in await store.list_task_instances(dag_id=dag.dag_id)
    }
    for error in errors.values():
        frames = _frames(error)
        assert error.startswith("Traceback (most recent call last):") or "raised:\n" in error
        assert frames, error
        assert not [f for f in frames if f.startswith(ENGINE_DIR)], error
        assert not [f for f in frames if "anyio" in f or "asyncio" in f], error
    py = _frames(errors["py"])
    assert py[0].endswith("operators/python.py"), errors["py"]
    assert py[-1] == __file__, errors["py"]
    assert errors["py"].endswith("ValueError: raised by the task's own function")
    trig = _frames(errors["trig"])
    assert trig[0].endswith("tests/triggers_for_tests.py"), errors["trig"]
    assert errors["trig"].endswith("RuntimeError: raised by the trigger")


def test_an_engine_error_keeps_its_whole_traceback() -> None:
    """When no frame is outside the engine (an engine bug), nothing is left out."""
    from engine.usercode.tracebacks import format_user_exception

    fake = str(Path(ENGINE_DIR) / "not_a_module.py")
    source = (
        "def f():\n    raise KeyError('engine bug')\n"
        "try:\n    f()\nexcept KeyError as e:\n    caught = e\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, fake, "exec"), namespace)
    error = format_user_exception(namespace["caught"])
    assert _frames(error) == [fake, fake], error
    assert error.endswith("KeyError: 'engine bug'")
