""" "Why is this task not running?": one test per reason ``deferral tasks why`` gives, each
built in a real database (pools held by claimed tasks, DAG and task limits, the global
parallelism, queues no worker serves, retries not due, deferrals on triggers held or not
held, upstream tasks not done, runs queued behind max_active_runs), checked through the
command and, for several, through ``waiting_reason`` in ``tasks list --json`` and the status
page's hook.

The commands run through click's CliRunner on the test database, in a thread (each runs its
own event loop, as on the command line)."""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
from typing import Any

import anyio
import msgspec
import pytest
from click.testing import CliRunner, Result

from engine import DAG
from engine.cli import cli
from engine.scheduler.dagrecord import record_dags
from engine.store import Store, TaskOutcome
from engine.store.models import NewRun
from engine.web import hooks
from operators.python import PythonOperator
from tests.helpers import never_deferral

pytestmark = pytest.mark.anyio

#: Workers registered by a test count as live for this long (far more than any test takes).
STALE_S = "3600"


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # What is under test are the commands, which run their own loop (uvloop, as installed).
    return ("asyncio", {"use_uvloop": True})


def _noop() -> None:
    pass


def invoke(db_url: str, *args: str, **settings: str) -> Result:
    env = {"DEFERRAL_DATABASE_URL": db_url, "DEFERRAL_ZOMBIE_THRESHOLD_S": STALE_S}
    env.update({f"DEFERRAL_{name.upper()}": value for name, value in settings.items()})
    return CliRunner().invoke(cli, list(args), env=env)


async def why(db_url: str, dag_id: str, run_id: str, task_id: str, **settings: str) -> str:
    """What ``deferral tasks why`` answers (on one line, whatever the terminal's width)."""
    result = await anyio.to_thread.run_sync(
        functools.partial(invoke, db_url, "tasks", "why", dag_id, run_id, task_id, **settings)
    )
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.split())


async def reasons(db_url: str, dag_id: str, **settings: str) -> dict[tuple[str, str], Any]:
    """``waiting_reason`` of each task of the DAG in ``tasks list --json``, by (run, task)."""
    result = await anyio.to_thread.run_sync(
        functools.partial(invoke, db_url, "tasks", "list", "--dag", dag_id, "--json", **settings)
    )
    assert result.exit_code == 0, result.output
    return {(r["run_id"], r["task_id"]): r["waiting_reason"] for r in json.loads(result.stdout)}


async def started(store: Store, dag: DAG, *run_ids: str) -> None:
    """Record the DAG and start its runs (not held back by max_active_runs)."""
    await record_dags(store, [dag])
    now = await store.now()
    for run_id in run_ids or ("r1",):
        await store.create_dag_run(dag.dag_id, run_id, logical_date=now)


async def state_of(store: Store, dag_id: str, task_id: str, run_id: str = "r1") -> str:
    ti = await store.task_try(dag_id, run_id, task_id)
    assert ti is not None
    return ti.state


# -- the reasons, in order -------------------------------------------------------------------


async def test_upstream_not_done_names_the_upstream_tasks_and_their_states(
    store: Store, db_url: str
) -> None:
    with DAG(dag_id="chain") as dag:
        extract = PythonOperator(task_id="extract", python_callable=_noop)
        check = PythonOperator(task_id="check", python_callable=_noop)
        [extract, check] >> PythonOperator(task_id="load", python_callable=_noop)
    await started(store, dag)
    worker = await store.register_worker("test", 1, 1)
    (claimed,) = (await store.claim_tasks(worker, 1)).claimed
    other = "check" if claimed.task_id == "extract" else "extract"

    answer = await why(db_url, "chain", "r1", "load")
    assert answer.startswith("upstream not done: waiting for ")
    assert f"{claimed.task_id} (running)" in answer
    assert f"{other} (scheduled)" in answer

    listed = await reasons(db_url, "chain")
    assert listed["r1", "load"] == answer
    assert listed["r1", claimed.task_id] is None  # running: not waiting
    assert listed["r1", other].startswith("runnable: waiting for a free worker slot")


async def test_a_run_queued_behind_max_active_runs_says_how_many_run(
    store: Store, db_url: str
) -> None:
    day = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    with DAG(dag_id="one_at_a_time", max_active_runs=1) as dag:
        PythonOperator(task_id="a", python_callable=_noop)
    await record_dags(store, [dag])
    states = []
    for run_id in ("m1", "m2", "m3"):
        run = NewRun(
            dag_id=dag.dag_id, run_id=run_id, logical_date=day, data_interval_start=day,
            data_interval_end=day, run_type="manual",
        )  # fmt: skip
        created = await store.create_queued_run(run)
        assert created is not None
        states.append(created[1])
    assert states == ["running", "queued", "queued"]

    answer = await why(db_url, "one_at_a_time", "m3", "a")
    assert answer.startswith("run not started: run 'm3' is queued behind max_active_runs: ")
    assert "1/1 runs of DAG 'one_at_a_time' run, 1 queued before it" in answer
    # The running run's task is not held back by it.
    assert (await why(db_url, "one_at_a_time", "m1", "a")).startswith("no worker serves")
    # A run has no task of another id: a usage error, as a run that does not exist.
    for args in (("m3", "nope"), ("m9", "a")):
        result = await anyio.to_thread.run_sync(
            functools.partial(invoke, db_url, "tasks", "why", "one_at_a_time", *args)
        )
        assert result.exit_code == 2, result.output
        assert repr(args[1] if args[0] == "m3" else args[0]) in result.output


async def test_a_full_pool_says_which_pool_and_how_many_slots_are_used(
    store: Store, db_url: str
) -> None:
    await store.set_pool("small", 1)
    with DAG(dag_id="pooled") as dag:
        PythonOperator(task_id="a", python_callable=_noop, pool="small")
        PythonOperator(task_id="b", python_callable=_noop, pool="small")
    await started(store, dag)
    worker = await store.register_worker("test", 1, 10)
    (held,) = (await store.claim_tasks(worker, 10)).claimed  # the pool admits one
    waiting = "b" if held.task_id == "a" else "a"

    answer = await why(db_url, "pooled", "r1", waiting)
    expected = "pool full: pool 'small' has 1/1 slots in use (1 by running tasks); the task needs 1"
    assert answer == expected
    assert (await reasons(db_url, "pooled"))["r1", waiting] == expected
    # Resized, the pool holds it back no more.
    await store.set_pool("small", 2)
    assert (await why(db_url, "pooled", "r1", waiting)).startswith("runnable:")


async def test_a_pool_that_counts_deferred_tasks_says_so(store: Store, db_url: str) -> None:
    await store.set_pool("sensors", 1, include_deferred=True)
    with DAG(dag_id="sensing") as dag:
        PythonOperator(task_id="a", python_callable=_noop, pool="sensors")
        PythonOperator(task_id="b", python_callable=_noop, pool="sensors")
    await started(store, dag)
    worker = await store.register_worker("test", 1, 10)
    (held,) = (await store.claim_tasks(worker, 10)).claimed
    assert await store.defer_task(held.id, worker, never_deferral("pool"))
    waiting = "b" if held.task_id == "a" else "a"

    answer = await why(db_url, "sensing", "r1", waiting)
    assert answer == (
        "pool full: pool 'sensors' has 1/1 slots in use (0 by running tasks, 1 by deferred "
        "tasks, which the pool counts: include_deferred); the task needs 1"
    )
    # Without include_deferred the deferred task holds no slot.
    await store.set_pool("sensors", 1, include_deferred=False)
    assert (await why(db_url, "sensing", "r1", waiting)).startswith("runnable:")


async def test_a_task_needing_more_slots_than_its_pool_has_can_never_run(
    store: Store, db_url: str
) -> None:
    await store.set_pool("tiny", 2)
    with DAG(dag_id="big") as dag:
        PythonOperator(task_id="huge", python_callable=_noop, pool="tiny", pool_slots=3)
    await started(store, dag)
    await store.register_worker("test", 1, 10)

    answer = await why(db_url, "big", "r1", "huge")
    assert answer.startswith(
        "pool too small: the task needs 3 slots of pool 'tiny', which has 2: it can never run"
    )
    assert (await reasons(db_url, "big"))["r1", "huge"] == answer


async def test_a_pool_that_does_not_exist_is_named(store: Store, db_url: str) -> None:
    with DAG(dag_id="lost") as dag:
        PythonOperator(task_id="a", python_callable=_noop, pool="nowhere")
    await started(store, dag)

    answer = await why(db_url, "lost", "r1", "a")
    assert answer.startswith("pool missing: pool 'nowhere' does not exist")
    assert "deferral pools set nowhere --slots N" in answer


async def test_a_dag_at_max_active_tasks_says_how_many_run(store: Store, db_url: str) -> None:
    with DAG(dag_id="narrow", max_active_tasks=1) as dag:
        PythonOperator(task_id="a", python_callable=_noop)
        PythonOperator(task_id="b", python_callable=_noop)
    await started(store, dag)
    worker = await store.register_worker("test", 1, 10)
    (held,) = (await store.claim_tasks(worker, 10)).claimed  # the DAG admits one
    waiting = "b" if held.task_id == "a" else "a"

    expected = "DAG at max_active_tasks: DAG 'narrow' runs 1/1 tasks"
    assert await why(db_url, "narrow", "r1", waiting) == expected
    assert (await reasons(db_url, "narrow"))["r1", waiting] == expected


async def test_a_task_at_max_active_tis_per_dag_says_how_many_run(
    store: Store, db_url: str
) -> None:
    with DAG(dag_id="serial") as dag:
        PythonOperator(task_id="t", python_callable=_noop, max_active_tis_per_dag=1)
    await started(store, dag, "r1", "r2")
    worker = await store.register_worker("test", 1, 10)
    (held,) = (await store.claim_tasks(worker, 10)).claimed
    waiting = "r2" if held.run_id == "r1" else "r1"

    answer = await why(db_url, "serial", waiting, "t")
    assert answer == (
        "task at max_active_tis_per_dag: 1/1 tries of task 't' run across the DAG's runs"
    )


async def test_global_parallelism_is_the_setting_against_the_running_tasks(
    store: Store, db_url: str
) -> None:
    with DAG(dag_id="wide") as dag:
        PythonOperator(task_id="a", python_callable=_noop)
        PythonOperator(task_id="b", python_callable=_noop)
    await started(store, dag)
    worker = await store.register_worker("test", 1, 10)
    (held,) = (await store.claim_tasks(worker, 1)).claimed
    waiting = "b" if held.task_id == "a" else "a"

    answer = await why(db_url, "wide", "r1", waiting, parallelism="1")
    assert answer == (
        "global parallelism reached: 1/1 tasks run across all workers (setting parallelism)"
    )
    assert (await reasons(db_url, "wide", parallelism="1"))["r1", waiting] == answer
    # With room (or no limit), nothing explains the wait but the workers' slots.
    for limit in ("2", "0"):
        answer = await why(db_url, "wide", "r1", waiting, parallelism=limit)
        assert answer == (
            "runnable: waiting for a free worker slot (live workers serving queue 'default': 1)"
        )


async def test_no_worker_serving_the_queue_names_it_and_when_one_was_last_seen(
    store: Store, db_url: str
) -> None:
    with DAG(dag_id="gpu_work") as dag:
        PythonOperator(task_id="train", python_callable=_noop, queue="gpu")
    await started(store, dag)
    await store.register_worker("test", 1, 10)  # serves 'default' only

    answer = await why(db_url, "gpu_work", "r1", "train")
    assert answer == (
        "no worker serves queue 'gpu': no live worker takes it (deferral worker --queues gpu); "
        "a worker serving it was never seen"
    )
    assert (await reasons(db_url, "gpu_work"))["r1", "train"] == answer

    gone = await store.register_worker("gpu-host", 2, 1, queues=["gpu"])
    await store.unregister_worker(gone)
    answer = await why(db_url, "gpu_work", "r1", "train")
    assert "a worker serving it was last seen " in answer
    assert "never" not in answer

    await store.register_worker("gpu-host", 3, 1, queues=["gpu", "default"])
    assert (await why(db_url, "gpu_work", "r1", "train")).startswith("runnable:")


async def test_a_retry_not_due_says_when_it_runs(store: Store, db_url: str) -> None:
    with DAG(dag_id="flaky") as dag:
        PythonOperator(task_id="a", python_callable=_noop, retries=2, retry_delay=3600)
    await started(store, dag)
    worker = await store.register_worker("test", 1, 10)
    (claimed,) = (await store.claim_tasks(worker, 10)).claimed
    failed = TaskOutcome(
        ti_id=claimed.id, worker_id=worker, try_number=1, kind="failed", error="boom"
    )
    assert [f.state for f in await store.finish_tasks([failed])] == ["up_for_retry"]
    ti = await store.task_try("flaky", "r1", "a")
    assert ti is not None

    answer = await why(db_url, "flaky", "r1", "a")
    stamp = ti.run_after.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    assert answer.startswith(f"retry not due: try 2 of 3 runs at {stamp} (in ")
    assert (await reasons(db_url, "flaky"))["r1", "a"].startswith("retry not due: try 2 of 3")


async def test_a_deferred_task_names_its_trigger_triggerer_and_deadline(
    store: Store, db_url: str
) -> None:
    with DAG(dag_id="waits") as dag:
        PythonOperator(task_id="s", python_callable=_noop)
    await started(store, dag)
    worker = await store.register_worker("test", 1, 10)
    (claimed,) = (await store.claim_tasks(worker, 10)).claimed
    deferral = msgspec.structs.replace(never_deferral("why"), timeout_s=3600.0)
    assert await store.defer_task(claimed.id, worker, deferral)
    ti = await store.task_try("waits", "r1", "s")
    assert ti is not None
    assert ti.trigger_id is not None

    # No triggerer at all: the trigger is unassigned.
    answer = await why(db_url, "waits", "r1", "s")
    assert answer.startswith(
        f"trigger unassigned: trigger {ti.trigger_id} (tests.triggers_for_tests.NeverTrigger) "
        "waits for a triggerer, and no live triggerer serves trigger queue 'default'"
    )
    assert "one serving it was never seen" in answer

    triggerer = await store.register_triggerer("trig-host", 4242, 10, 600.0)
    assert [t.id for t in (await store.claim_triggers(triggerer, 10)).claimed] == [ti.trigger_id]
    answer = await why(db_url, "waits", "r1", "s")
    assert answer.startswith(
        f"deferred on trigger {ti.trigger_id} (tests.triggers_for_tests.NeverTrigger): held "
        f"by triggerer {triggerer} on trig-host [4242]; waiting since "
    )
    assert "; waiting since " in answer
    assert ", next deadline: trigger_timeout at " in answer
    # (Read a moment later: a second may have passed, and its countdowns with it.)
    assert _steady((await reasons(db_url, "waits"))["r1", "s"]) == _steady(answer)
    # The status page's task try page says the same.
    assert _steady(await hooks.why_not_running(store, ti) or "") == _steady(answer)


async def test_a_trigger_no_triggerer_takes_is_unassigned(store: Store, db_url: str) -> None:
    with DAG(dag_id="teams") as dag:
        PythonOperator(task_id="busy", python_callable=_noop)
        PythonOperator(task_id="late", python_callable=_noop)
        PythonOperator(task_id="team", python_callable=_noop, trigger_queue="team")
    await started(store, dag)
    worker = await store.register_worker("test", 1, 10)
    claimed = {ti.task_id: ti for ti in (await store.claim_tasks(worker, 10)).claimed}
    triggerer = await store.register_triggerer("trig-host", 4242, 1, 600.0)
    assert await store.defer_task(claimed["busy"].id, worker, never_deferral("busy"))
    assert len((await store.claim_triggers(triggerer, 10)).claimed) == 1  # its one slot
    assert await store.defer_task(claimed["late"].id, worker, never_deferral("late"))
    assert await store.defer_task(claimed["team"].id, worker, never_deferral("team"))

    late = await why(db_url, "teams", "r1", "late")
    assert late.startswith("trigger unassigned: trigger ")
    assert "the one live triggerer of trigger queue 'default' is at capacity" in late
    team = await why(db_url, "teams", "r1", "team")
    assert "no live triggerer serves trigger queue 'team' (deferral triggerer --queues team)" in (
        team
    )
    listed = await reasons(db_url, "teams")
    assert (listed["r1", "late"], listed["r1", "team"]) == (late, team)

    # A triggerer with room for the default queue: the trigger waits to be claimed.
    await store.register_triggerer("trig-host", 4243, 10, 600.0)
    answer = await why(db_url, "teams", "r1", "late")
    assert "held by no triggerer yet (a live triggerer of trigger queue 'default' with room" in (
        answer
    )
    assert "1 of 2 have room" in answer


async def test_a_running_or_ended_task_is_not_waiting(store: Store, db_url: str) -> None:
    with DAG(dag_id="done") as dag:
        PythonOperator(task_id="a", python_callable=_noop)
        PythonOperator(task_id="b", python_callable=_noop)
        PythonOperator(task_id="c", python_callable=_noop)
    await started(store, dag)
    worker = await store.register_worker("worker-host", 77, 10)
    claimed = {ti.task_id: ti for ti in (await store.claim_tasks(worker, 10)).claimed}
    ok = TaskOutcome(ti_id=claimed["b"].id, worker_id=worker, try_number=1, kind="success")
    error = "Traceback (most recent call last):\n  ...\nValueError: boom\n"
    bad = TaskOutcome(
        ti_id=claimed["c"].id, worker_id=worker, try_number=1, kind="failed", error=error
    )
    await store.finish_tasks([ok, bad])

    assert (await why(db_url, "done", "r1", "a")).startswith(
        f"running: try 1 on worker {worker} on worker-host [77], since "
    )
    assert (await why(db_url, "done", "r1", "b")).startswith("success: ended at ")
    failed = await why(db_url, "done", "r1", "c")
    assert failed.startswith("failed: ended at ")
    assert failed.endswith(": ValueError: boom")
    assert await reasons(db_url, "done") == {("r1", t): None for t in ("a", "b", "c")}
    ti = await store.task_try("done", "r1", "a")
    assert ti is not None
    assert await hooks.why_not_running(store, ti) is None  # the page shows no section


def _steady(answer: str) -> str:
    """An answer without its ages and countdowns ("(3s ago)", "(in 59m59s)")."""
    return re.sub(r"\((in )?[0-9hmsd ]+( ago)?\)", "(...)", answer)
