"""Callbacks on a real engine (in this process): every task callback kind, from default_args
and as lists, with the context and its exception; outcomes decided outside a worker (a
deferrable sensor's timeout, with soft_fail too, a trigger's failure, a zombie reaped by the
scheduler, a task failed at claim); DAG callbacks; a callback that raises and one that hangs
(logged with the try's lines, nothing changed); no request for a task without callbacks; the
deadline alerts (one that fires, one a run that ends first removes)."""

from __future__ import annotations

import datetime as dt
import functools
import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from engine import DAG, DeadlineAlert, DeadlineReference
from engine.store import Store
from engine.testing import run_engine
from operators.base import BaseOperator, Context
from operators.callbacks import TaskFailure
from operators.python import PythonOperator
from operators.sensors.temporal import DateTimeSensor
from tests.helpers import wait_until
from triggers.base import BaseTrigger, TriggerEvent

pytestmark = pytest.mark.anyio

#: What the callbacks of these tests saw: (kind, task_id or dag_id, try_number, exception).
SEEN: list[tuple[str, str, Any, Any]] = []


@pytest.fixture(autouse=True)
def _clear_seen() -> None:
    SEEN.clear()


def _recorder(kind: str) -> Any:
    def callback(context: Any) -> None:
        SEEN.append(
            (
                kind,
                context.get("task_id") or context["dag_run"].dag_id,
                context.get("try_number"),
                context.get("exception"),
            )
        )

    callback.__qualname__ = f"record_{kind}"
    return callback


def _kinds() -> list[tuple[str, str]]:
    return [(kind, who) for kind, who, _, _ in SEEN]


def _fail() -> None:
    raise ValueError("boom")


async def _requests_left(store: Store) -> int:
    return len(await store.list_callback_requests())


async def _run(store: Store, dag: DAG, **kwargs: Any) -> dict[str, Any]:
    async with run_engine(store, **kwargs) as engine:
        await engine.start_run(dag)
        tis = await engine.finish(dag.dag_id)
        await engine.drain()
    assert await _requests_left(store) == 0
    return tis


async def test_each_task_callback_kind_runs_once_with_its_context(store: Store) -> None:
    with DAG(
        dag_id="cb_kinds",
        default_args={
            "on_failure_callback": _recorder("failure"),
            "on_retry_callback": _recorder("retry"),
        },
    ) as dag:
        PythonOperator(
            task_id="ok",
            python_callable=lambda: 1,
            on_execute_callback=_recorder("execute"),
            on_success_callback=[_recorder("success"), _recorder("success2")],
        )
        PythonOperator(task_id="bad", python_callable=_fail, retries=1, retry_delay=0)
        PythonOperator(
            task_id="skip",
            python_callable=_skip,
            on_skipped_callback=_recorder("skipped"),
        )
    tis = await _run(store, dag)
    assert tis["ok"]["state"] == "success"
    assert tis["bad"]["state"] == "failed"
    assert sorted(_kinds()) == sorted(
        [
            ("execute", "ok"),
            ("success", "ok"),
            ("success2", "ok"),
            ("retry", "bad"),
            ("failure", "bad"),
            ("skipped", "skip"),
        ]
    )
    retry = next(s for s in SEEN if s[0] == "retry")
    failure = next(s for s in SEEN if s[0] == "failure")
    assert (retry[2], failure[2]) == (1, 2)
    assert isinstance(failure[3], TaskFailure)
    assert str(failure[3]) == "ValueError: boom"
    assert "Traceback" in failure[3].error
    assert next(s for s in SEEN if s[0] == "success")[3] is None


def _skip() -> None:
    from operators.signals import SkipTask

    raise SkipTask("not today")


async def test_a_task_without_callbacks_writes_no_request(store: Store) -> None:
    with DAG(dag_id="cb_none") as dag:
        PythonOperator(task_id="a", python_callable=_fail)
    async with run_engine(store, worker=True) as engine:
        await engine.start_run(dag)
        await engine.finish(dag.dag_id)
    tis = await store.list_task_instances(dag_id="cb_none")
    assert [ti.state for ti in tis] == ["failed"]
    assert await _requests_left(store) == 0
    assert SEEN == []


class _Failing(BaseTrigger):
    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}._Failing", {})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        raise RuntimeError("the trigger broke")
        yield TriggerEvent(None)  # pragma: no cover


class _Deferring(BaseOperator):
    def execute(self, context: Context) -> None:
        self.defer(trigger=_Failing(), method_name="resume")

    def resume(self, context: Context, event: Any = None) -> None:
        return None


async def test_a_trigger_failure_calls_on_failure_callback(store: Store) -> None:
    with DAG(dag_id="cb_trigger") as dag:
        _Deferring(task_id="wait", on_failure_callback=_recorder("failure"))
    tis = await _run(store, dag)
    assert tis["wait"]["state"] == "failed"
    assert _kinds() == [("failure", "wait")]
    assert "the trigger broke" in SEEN[0][3].error


@pytest.mark.parametrize("soft_fail", [False, True])
async def test_a_deferrable_sensor_timeout_calls_back(store: Store, soft_fail: bool) -> None:
    far = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    with DAG(dag_id=f"cb_sensor_{soft_fail}") as dag:
        DateTimeSensor(
            task_id="sense",
            target_time=far,
            deferrable=True,
            timeout=0.5,
            soft_fail=soft_fail,
            on_failure_callback=_recorder("failure"),
            on_skipped_callback=_recorder("skipped"),
        )
    tis = await _run(store, dag)
    assert tis["sense"]["state"] == ("skipped" if soft_fail else "failed")
    assert _kinds() == [("skipped" if soft_fail else "failure", "sense")]
    if not soft_fail:
        assert "sensor timed out" in SEEN[0][3].error


@pytest.mark.parametrize("mode", ["poke", "reschedule"])
async def test_a_sensor_timeout_calls_back_in_poke_and_reschedule_mode(
    store: Store, mode: str
) -> None:
    far = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    with DAG(dag_id=f"cb_sensor_{mode}") as dag:
        DateTimeSensor(
            task_id="sense",
            target_time=far,
            mode=mode,
            poke_interval=0.1,
            timeout=0.5,
            on_failure_callback=_recorder("failure"),
        )
        DateTimeSensor(
            task_id="soft",
            target_time=far,
            mode=mode,
            poke_interval=0.1,
            timeout=0.5,
            soft_fail=True,
            on_skipped_callback=_recorder("skipped"),
        )
    tis = await _run(store, dag)
    assert (tis["sense"]["state"], tis["soft"]["state"]) == ("failed", "skipped")
    assert sorted(_kinds()) == [("failure", "sense"), ("skipped", "soft")]


async def test_a_task_failed_at_claim_calls_back(store: Store) -> None:
    with DAG(dag_id="cb_claim") as dag:
        PythonOperator(
            task_id="nopool",
            python_callable=lambda: 1,
            pool="no_such_pool",
            on_failure_callback=_recorder("failure"),
        )
    tis = await _run(store, dag)
    assert tis["nopool"]["state"] == "failed"
    assert _kinds() == [("failure", "nopool")]
    assert "no_such_pool" in SEEN[0][3].error


async def test_a_zombie_reaped_by_the_scheduler_calls_back_on_a_worker(store: Store) -> None:
    with DAG(dag_id="cb_zombie") as dag:
        PythonOperator(
            task_id="lost",
            python_callable=lambda: 1,
            retries=1,
            retry_delay=3600,
            on_retry_callback=_recorder("retry"),
        )
    # A worker claims the task and vanishes (its heartbeat stops): the scheduler reaps it.
    async with run_engine(store, worker=False, triggerer=False) as engine:
        await engine.start_run(dag)
        gone = await store.register_worker("gone-host", 1, 1)
        claim = await store.claim_tasks(gone, 1)
        assert [ti.task_id for ti in claim.claimed] == ["lost"]
        reaped = await store.reap_zombie_tasks(0.0)
        assert [r.state for r in reaped] == ["up_for_retry"]
    assert SEEN == []  # no worker ran: the request waits
    assert await _requests_left(store) == 1
    async with run_engine(store, scheduler=False, triggerer=False) as engine:
        engine.dagbag.add_dag(dag)
        await engine.drain()
    assert _kinds() == [("retry", "lost")]
    assert "stopped heartbeating" in SEEN[0][3].error


async def test_dag_callbacks_get_the_reason(store: Store) -> None:
    reasons: list[tuple[str, str, str]] = []

    def on_dag(context: Any) -> None:
        reasons.append((context["reason"], context["run_id"], context["dag_run"].dag_id))

    with DAG(dag_id="cb_dag_ok", on_success_callback=on_dag, on_failure_callback=on_dag) as ok:
        PythonOperator(task_id="a", python_callable=lambda: 1)
    with DAG(dag_id="cb_dag_bad", on_failure_callback=[on_dag]) as bad:
        PythonOperator(task_id="a", python_callable=_fail)
    async with run_engine(store) as engine:
        await engine.start_run(ok)
        await engine.start_run(bad)
        assert (await engine.finish("cb_dag_ok"))["__run__"]["state"] == "success"
        assert (await engine.finish("cb_dag_bad"))["__run__"]["state"] == "failed"
        await engine.drain()
    assert sorted(reasons) == [
        ("success", "run1", "cb_dag_ok"),
        ("task_failure", "run1", "cb_dag_bad"),
    ]


async def test_a_callback_that_raises_or_hangs_is_logged_and_changes_nothing(
    store: Store,
) -> None:
    release = threading.Event()

    def raises(context: Any) -> None:
        raise RuntimeError("callback exploded")

    def hangs(context: Any) -> None:
        release.wait(30)

    async def hangs_async(context: Any) -> None:
        await anyio.sleep_forever()

    def exits(context: Any) -> None:
        raise SystemExit(3)

    after: list[str] = []
    with DAG(dag_id="cb_bad_callbacks") as dag:
        PythonOperator(
            task_id="a",
            python_callable=lambda: 1,
            on_success_callback=[raises, exits, hangs, hangs_async, lambda c: after.append("ran")],
        )
    try:
        tis = await _run(store, dag, worker_options={"callback_timeout_s": 0.3})
    finally:
        release.set()
    assert tis["a"]["state"] == "success"
    assert after == ["ran"]  # the ones after a failed callback still run
    lines = await store.task_logs("cb_bad_callbacks", "run1", "a", 1)
    text = "\n".join(line.message for line in lines.lines)
    assert "RuntimeError: callback exploded" in text
    assert "Traceback" in text
    assert "SystemExit: 3" in text
    assert text.count("ran past callback_timeout_s") == 2


async def test_a_deadline_alert_fires_once_for_a_run_still_running(store: Store) -> None:
    alerts: list[tuple[str, Any, Any]] = []
    release = threading.Event()

    def alert(context: Any, who: str) -> None:
        alerts.append((who, context["run_id"], context["deadline"]["deadline_time"]))
        release.set()

    with DAG(
        dag_id="cb_deadline",
        deadline=DeadlineAlert(
            reference=DeadlineReference.DAGRUN_QUEUED_AT,
            interval=dt.timedelta(seconds=0.5),
            callback=alert,
            kwargs={"who": "ops"},
        ),
    ) as dag:
        PythonOperator(task_id="slow", python_callable=lambda: release.wait(30))
    try:
        tis = await _run(store, dag)
    finally:
        release.set()
    assert tis["__run__"]["state"] == "success"
    assert [(who, run) for who, run, _ in alerts] == [("ops", "run1")]
    assert await store.list_triggers(100) == []


async def test_a_run_that_ends_first_removes_its_deadline(store: Store) -> None:
    alerts: list[Any] = []
    with DAG(
        dag_id="cb_no_deadline",
        deadline=DeadlineAlert(
            reference=DeadlineReference.DAGRUN_LOGICAL_DATE,
            interval=dt.timedelta(hours=1),
            callback=lambda context: alerts.append(context),
        ),
    ) as dag:
        PythonOperator(task_id="fast", python_callable=lambda: 1)
    async with run_engine(store) as engine:
        await engine.start_run(dag)

        async def timer_started() -> bool:
            return len(await store.list_triggers(100)) == 1

        await wait_until(timer_started, what="the deadline's timer trigger")
        tis = await engine.finish(dag.dag_id)
        await engine.drain()
    assert tis["__run__"]["state"] == "success"
    assert await store.list_triggers(100) == []
    assert alerts == []
    assert await _requests_left(store) == 0


async def test_a_deadline_timer_cancelled_from_the_page_alerts_nobody(store: Store) -> None:
    with DAG(
        dag_id="cb_cancelled_deadline",
        deadline=DeadlineAlert(
            reference=DeadlineReference.DAGRUN_QUEUED_AT,
            interval=dt.timedelta(hours=1),
            callback="tests.test_callbacks._fail",
        ),
    ) as dag:
        PythonOperator(task_id="a", python_callable=lambda: 1)
    async with run_engine(store, worker=False, scheduler=False, triggerer=False) as engine:
        await engine.start_run(dag)
    (timer,) = await store.list_triggers(100)
    assert timer.classpath == "triggers.temporal.DateTimeTrigger"
    assert await store.cancel_trigger(timer.id, who="tester") == []
    assert await store.list_triggers(100) == []
    assert await _requests_left(store) == 0


async def test_a_deadline_timer_is_no_orphan(store: Store) -> None:
    """No task waits on a deadline's timer: the scheduler's orphan sweep must keep it (else
    dropping it would look like its firing)."""
    with DAG(
        dag_id="cb_not_orphan",
        deadline=DeadlineAlert(
            reference=DeadlineReference.DAGRUN_LOGICAL_DATE,
            interval=dt.timedelta(hours=1),
            callback="tests.test_callbacks._fail",
        ),
    ) as dag:
        PythonOperator(task_id="a", python_callable=lambda: 1)
    async with run_engine(store, worker=False, scheduler=False, triggerer=False) as engine:
        await engine.start_run(dag)
    assert await store.delete_orphan_triggers(0.0) == 0
    assert len(await store.list_triggers(100)) == 1
    assert await _requests_left(store) == 0


async def test_an_on_execute_callback_that_raises_does_not_fail_its_try(store: Store) -> None:
    def raises(context: Any) -> None:
        raise RuntimeError("execute callback exploded")

    with DAG(dag_id="cb_execute_raises") as dag:
        PythonOperator(task_id="a", python_callable=lambda: 7, on_execute_callback=raises)
    tis = await _run(store, dag)
    assert tis["a"]["state"] == "success"
    lines = await store.task_logs("cb_execute_raises", "run1", "a", 1)
    text = "\n".join(line.message for line in lines.lines)
    assert "RuntimeError: execute callback exploded" in text


def _record_mapped_failure(context: Any) -> None:
    SEEN.append(("failure", context["task_id"], context["ti"].map_index, context["exception"]))


def _fail_on(x: int) -> None:
    raise ValueError(f"boom {x}")


async def test_every_instance_of_a_mapped_task_calls_back_as_itself(store: Store) -> None:
    # Instances 1..n-1 are inserted by the expansion: they carry the task's callbacks too, and
    # each request runs with its own instance (its map index, its log under TASK[i]).
    with DAG(dag_id="cb_mapped") as dag:
        PythonOperator.partial(
            task_id="each", python_callable=_fail_on, on_failure_callback=_record_mapped_failure
        ).expand(op_args=[[0], [1], [2]])
    await _run(store, dag)
    assert sorted((kind, who, index) for kind, who, index, _ in SEEN) == [
        ("failure", "each", 0),
        ("failure", "each", 1),
        ("failure", "each", 2),
    ]


async def test_a_dag_failure_callback_gets_the_failed_task_instance(store: Store) -> None:
    seen: list[tuple[str, Any, Any, Any]] = []

    def on_dag(context: Any) -> None:
        ti = context.get("ti")
        seen.append(
            (
                context["reason"],
                getattr(ti, "task_id", None),
                getattr(ti, "try_number", None),
                context.get("task_instance") is ti,
            )
        )

    with DAG(dag_id="cb_dag_ti", on_failure_callback=on_dag) as dag:
        # (the failed task is not the last by task id: Airflow's pick would be "z_after")
        boom = PythonOperator(task_id="boom", python_callable=_fail)
        boom >> PythonOperator(task_id="z_after", python_callable=lambda: 1)
        PythonOperator(task_id="ok", python_callable=lambda: 1)
    tis = await _run(store, dag)
    assert tis["__run__"]["state"] == "failed"
    assert seen == [("task_failure", "boom", 1, True)]


def _callbacks_of_every_kind() -> dict[str, Any]:
    return {f"on_{kind}_callback": _recorder(kind) for kind in ("success", "failure", "skipped")}


async def test_marks_queue_no_callbacks(store: Store) -> None:
    """A mark is the user's override, not the task's outcome: as in Airflow (the state is set;
    no callback runs), for a task not running, a running one (told to stop: what it does late
    is ignored) and a run marked as a whole (no on_skipped_callback for tasks that never ran,
    no DAG callback)."""
    dag_calls: list[str] = []
    with DAG(
        dag_id="cb_marks",
        on_success_callback=lambda context: dag_calls.append("success"),
        on_failure_callback=lambda context: dag_calls.append("failure"),
    ) as dag:
        first = PythonOperator(task_id="first", python_callable=_fail, **_callbacks_of_every_kind())
        first >> PythonOperator(
            task_id="later", python_callable=_fail, **_callbacks_of_every_kind()
        )
        PythonOperator(task_id="busy", python_callable=_fail, **_callbacks_of_every_kind())
        PythonOperator(task_id="idle", python_callable=_fail, **_callbacks_of_every_kind())
    async with run_engine(store, worker=False, scheduler=False, triggerer=False) as engine:
        await engine.start_run(dag)
    worker = await store.register_worker("test", 1, 10)
    claimed = {t.task_id: t for t in (await store.claim_tasks(worker, 10)).claimed}
    assert set(claimed) == {"first", "busy", "idle"}
    ids = {t.task_id: t.id for t in await store.list_task_instances(dag_id="cb_marks")}
    # Running tries marked success and failed.
    assert await store.mark_task(ids["first"], "success", who="ops")
    assert await store.mark_task(ids["busy"], "failed", who="ops")
    # Ended already: marked again.
    assert await store.mark_task(ids["busy"], "skipped", who="ops")
    assert await store.mark_task(ids["busy"], "success", who="ops")
    # The run marked failed: "idle" (running) fails, "later" (scheduled, never ran) is skipped.
    marked = await store.mark_run("cb_marks", "run1", "failed", who="ops")
    assert {t.task_id: t.state for t in marked.tasks} == {"idle": "failed", "later": "skipped"}
    assert await store.list_callback_requests() == []
    marked = await store.mark_run("cb_marks", "run1", "success", who="ops")
    assert await store.list_callback_requests() == []
    assert dag_calls == []


def _counting(store: Store, name: str) -> list[int]:
    """Count the calls of the store's method ``name`` (the real method is called)."""
    calls = [0]
    real = getattr(store, name)

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await real(*args, **kwargs)

    setattr(store, name, counted)
    return calls


async def test_only_a_callback_request_sends_the_callback_runner_to_the_database(
    store: Store,
) -> None:
    """A notification about tasks wakes the worker's claim loop, not its callback runner;
    the one a callback request's write sends wakes the runner (no poll within the test)."""
    from engine.store import CHANNEL_TASKS, PAYLOAD_CALLBACKS

    callback_claims = _counting(store, "claim_callbacks")
    task_claims = _counting(store, "claim_tasks")
    async with run_engine(
        store, scheduler=False, triggerer=False, worker_options={"poll_interval_s": 300.0}
    ) as engine:
        await wait_until(lambda: _at_least(callback_claims, 1), what="the runner's first claim")
        await wait_until(lambda: _at_least(task_claims, 1), what="the worker's first claim")
        before = callback_claims[0]
        for _ in range(3):
            seen = task_claims[0]
            await store.notify(CHANNEL_TASKS)
            await wait_until(functools.partial(_at_least, task_claims, seen + 1), what="a claim")
        assert callback_claims[0] == before
        await store.notify(CHANNEL_TASKS, PAYLOAD_CALLBACKS)
        await wait_until(lambda: _at_least(callback_claims, before + 1), what="a callback claim")
        await engine.drain()


async def test_a_callback_request_wakes_the_callback_runner(store: Store) -> None:
    """The request written with a task's outcome is claimed at once, not at the next poll."""
    with DAG(dag_id="cb_wake") as dag:
        PythonOperator(
            task_id="ok", python_callable=lambda: 1, on_success_callback=_recorder("success")
        )
    async with run_engine(store, poll_interval_s=300.0) as engine:
        await engine.start_run(dag)
        await engine.finish(dag.dag_id)

        async def called() -> bool:
            return _kinds() == [("success", "ok")]

        await wait_until(called, timeout_s=30, what="the success callback")


async def _at_least(calls: list[int], n: int) -> bool:
    return calls[0] >= n
