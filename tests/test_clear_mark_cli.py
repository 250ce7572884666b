"""Rerun and override from the command line: ``deferral tasks clear|mark-*`` and ``deferral
runs clear|mark-*`` on a real database, the tries driven by hand as a worker and a triggerer
would drive them (claims, outcomes, trigger events with their fencing tokens), so that each
late write can be made exactly when it matters. Real worker processes: the end of this file
and tests/test_mark_clear_processes.py.

The commands run through click's CliRunner, in a thread (each runs its own event loop)."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from typing import Any

import anyio
import asyncpg
import pytest
from click.testing import CliRunner, Result

from engine import DAG
from engine.cli import cli
from engine.scheduler.dagrecord import record_dags
from engine.store import Store, TaskOutcome, TriggerOutcome
from engine.store.downstream import settle
from operators.python import PythonOperator
from tests.helpers import never_deferral, wait_until
from triggers.base import encode_value

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


def _noop() -> None:
    pass


async def cli_run(db_url: str, *args: str, stdin: str | None = None) -> Result:
    def invoke() -> Result:
        env = {"DEFERRAL_DATABASE_URL": db_url}
        return CliRunner().invoke(cli, list(args), env=env, input=stdin)

    return await anyio.to_thread.run_sync(invoke)


async def cli_json(db_url: str, *args: str) -> Any:
    result = await cli_run(db_url, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


async def _dag(store: Store, *, shared: bool = False) -> dict[str, int]:
    """``a >> b >> c`` and a lone ``d``, one run ``r1``: task ids -> task instance ids."""
    with DAG(dag_id="cm") as dag:
        a = PythonOperator(task_id="a", python_callable=_noop)
        b = PythonOperator(task_id="b", python_callable=_noop)
        c = PythonOperator(task_id="c", python_callable=_noop)
        a >> b >> c
        PythonOperator(task_id="d", python_callable=_noop)
    await record_dags(store, [dag])
    await store.create_dag_run("cm", "r1", logical_date=await store.now())
    return {ti.task_id: ti.id for ti in await store.list_task_instances(dag_id="cm")}


async def _states(store: Store) -> dict[str, tuple[str, int]]:
    return {
        ti.task_id: (ti.state, ti.try_number) for ti in await store.list_task_instances(dag_id="cm")
    }


async def _claim(store: Store, worker: int, task_id: str) -> int:
    """Claim the runnable tries and return the try number of ``task_id``'s (it must be one)."""
    claimed = {c.task_id: c for c in (await store.claim_tasks(worker, 16)).claimed}
    return claimed[task_id].try_number


async def _end(
    store: Store, ids: dict[str, int], worker: int, task_id: str, try_number: int, kind: str
) -> None:
    out = TaskOutcome(ti_id=ids[task_id], worker_id=worker, try_number=try_number, kind=kind)  # type: ignore[arg-type]
    done = await store.finish_tasks([out])
    assert [f.state for f in done] == [kind]
    await settle(store, done)


async def test_clear_of_a_failed_task_and_its_downstream_runs_again_on_try_2_without_its_xcoms(
    store: Store, db_url: str
) -> None:
    ids = await _dag(store)
    worker = await store.register_worker("w", 1, 16)
    assert await _claim(store, worker, "a") == 1
    assert await store.push_xcom(ids["a"], worker, 1, [("rows", encode_value([1, 2]))])
    await _end(store, ids, worker, "a", 1, "failed")
    await _end(store, ids, worker, "d", 1, "success")
    assert await store.finish_dag_runs()
    before = await _states(store)
    assert {t: s for t, (s, _) in before.items()} == {
        "a": "failed", "b": "upstream_failed", "c": "upstream_failed", "d": "success",
    }  # fmt: skip
    run = await store.get_dag_run("cm", "r1")
    assert run is not None
    assert run.state == "failed"

    done = await cli_json(
        db_url, "tasks", "clear", "cm", "--run", "r1", "--task", "a", "--downstream", "--yes"
    )
    assert {(o["task_id"], o["was"], o["state"]) for o in done} == {
        ("a", "failed", "scheduled"), ("b", "upstream_failed", "pending"),
        ("c", "upstream_failed", "pending"),
    }  # fmt: skip
    # The run runs again; try 1's XComs are gone (nothing reads them, nothing keeps them).
    run = await store.get_dag_run("cm", "r1")
    assert run is not None
    assert (run.state, run.ended_at) == ("running", None)
    assert await store.xcom_of_task("cm", "r1", "a") == {}
    assert await store.pull_xcom("cm", "r1", ["a"], "rows") == []
    # Try 2 of a; b and c follow it once it succeeds.
    assert await _claim(store, worker, "a") == 2
    assert await store.pull_xcom("cm", "r1", ["a"], "rows") == []
    await _end(store, ids, worker, "a", 2, "success")
    assert await _claim(store, worker, "b") == 1
    await _end(store, ids, worker, "b", 1, "success")
    assert await _claim(store, worker, "c") == 1
    await _end(store, ids, worker, "c", 1, "success")
    assert await _states(store) == {
        "a": ("success", 2), "b": ("success", 1), "c": ("success", 1), "d": ("success", 1),
    }  # fmt: skip
    assert [r.state for r in await store.finish_dag_runs()] == ["success"]
    # Audited, and said in the log of try 1.
    audit = [(a.action, a.target) for a in await store.list_audit()]
    assert ("clear", "cm/r1/a") in audit
    assert ("clear", "cm/r1/c") in audit
    logs = await store.task_logs("cm", "r1", "a", 1)
    said = [line.message for line in logs.lines if "cleared by" in line.message]
    assert said
    assert "from the command line" in said[0]


async def test_clear_selects_upstream_only_failed_and_by_default_every_task(
    store: Store, db_url: str
) -> None:
    ids = await _dag(store)
    worker = await store.register_worker("w", 1, 16)
    await _claim(store, worker, "a")
    await _end(store, ids, worker, "a", 1, "success")
    await _claim(store, worker, "b")
    await _end(store, ids, worker, "b", 1, "failed")
    # --upstream of c: b and a too; --only-failed keeps the failed and upstream_failed ones.
    done = await cli_json(
        db_url, "tasks", "clear", "cm", "--run", "r1", "--task", "c", "--upstream",
        "--only-failed", "--yes",
    )  # fmt: skip
    assert sorted(o["task_id"] for o in done) == ["b", "c"]
    assert (await _states(store))["a"] == ("success", 1)
    # runs clear: every task instance (d was scheduled, still is).
    done = await cli_json(db_url, "runs", "clear", "cm", "r1", "--yes")
    assert sorted(o["task_id"] for o in done) == ["a", "b", "c", "d"]
    states = await _states(store)
    assert states["a"] == ("scheduled", 1)
    assert states["c"] == ("pending", 0)


async def test_clear_of_a_whole_ended_run(store: Store, db_url: str) -> None:
    ids = await _dag(store)
    worker = await store.register_worker("w", 1, 16)
    for task_id in ("a", "b", "c"):
        await _claim(store, worker, task_id)
        await _end(store, ids, worker, task_id, 1, "success")
    await _end(store, ids, worker, "d", 1, "success")
    assert [r.state for r in await store.finish_dag_runs()] == ["success"]

    done = await cli_json(db_url, "runs", "clear", "cm", "r1", "--yes")
    assert {o["task_id"]: (o["was"], o["state"]) for o in done} == {
        "a": ("success", "scheduled"), "b": ("success", "pending"),
        "c": ("success", "pending"), "d": ("success", "scheduled"),
    }  # fmt: skip
    run = await store.get_dag_run("cm", "r1")
    assert run is not None
    assert run.state == "running"
    assert await store.finish_dag_runs() == []  # not over again until its tasks are
    for task_id in ("a", "b", "c"):
        assert await _claim(store, worker, task_id) == 2
        await _end(store, ids, worker, task_id, 2, "success")
    await _end(store, ids, worker, "d", 2, "success")
    assert [r.state for r in await store.finish_dag_runs()] == ["success"]
    # --only-failed on a run without failures clears nothing, and says so.
    result = await cli_run(db_url, "runs", "clear", "cm", "r1", "--only-failed", "--yes")
    assert result.exit_code == 0, result.output
    assert "no failed task instances to clear" in result.stdout


async def test_clear_asks_first_and_without_a_terminal_refuses(store: Store, db_url: str) -> None:
    ids = await _dag(store)
    worker = await store.register_worker("w", 1, 16)
    await _claim(store, worker, "a")
    await _end(store, ids, worker, "a", 1, "failed")
    before = await _states(store)
    args = ("tasks", "clear", "cm", "--run", "r1", "--task", "a")
    result = await cli_run(db_url, *args, stdin="y\n")
    assert result.exit_code == 1
    assert "would clear 1 task instance of run r1 of DAG cm" in result.stdout
    assert "pass --yes" in result.stderr
    assert await _states(store) == before
    assert await store.list_audit() == []


def _in_a_terminal(db_url: str, answer: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    """``deferral ARGS`` with a terminal on stdin (a pty), ``answer`` typed ahead."""
    main, tty = pty.openpty()
    try:
        os.write(main, answer.encode())
        return subprocess.run(
            [sys.executable, "-m", "engine", *args],
            stdin=tty,
            capture_output=True,
            env={**os.environ, "DEFERRAL_DATABASE_URL": db_url},
            timeout=120,
            check=False,
        )
    finally:
        os.close(tty)
        os.close(main)


async def test_clear_in_a_terminal_clears_on_yes_only(store: Store, db_url: str) -> None:
    ids = await _dag(store)
    worker = await store.register_worker("w", 1, 16)
    await _claim(store, worker, "a")
    await _end(store, ids, worker, "a", 1, "failed")
    before = await _states(store)
    args = ("tasks", "clear", "cm", "--run", "r1", "--task", "a")
    said_no = await anyio.to_thread.run_sync(_in_a_terminal, db_url, "n\n", *args)
    assert said_no.returncode == 1, said_no.stderr
    assert b"would clear 1 task instance" in said_no.stdout
    assert b"Clear them? [y/N]" in said_no.stderr  # (stdout is not a terminal here)
    assert b"nothing cleared" in said_no.stderr
    assert await _states(store) == before
    said_yes = await anyio.to_thread.run_sync(_in_a_terminal, db_url, "y\n", *args)
    assert said_yes.returncode == 0, said_yes.stderr
    assert b"cleared 1 task instance" in said_yes.stdout
    assert (await _states(store))["a"] == ("scheduled", 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("tasks", "clear", "nope", "--run", "r1", "--yes"), "no DAG 'nope'"),
        (("tasks", "clear", "cm", "--run", "r9", "--yes"), "no run 'r9'"),
        (("tasks", "clear", "cm", "--run", "r1", "--task", "zz", "--yes"), "no task 'zz'"),
        (("tasks", "mark-success", "cm", "r1", "zz"), "no task 'zz'"),
        (("tasks", "mark-failed", "nope", "r1", "a"), "no DAG 'nope'"),
        (("runs", "mark-failed", "cm", "r9"), "no run 'r9'"),
        (("runs", "clear", "nope", "r1", "--yes"), "no DAG 'nope'"),
    ],
)
async def test_unknown_dag_run_or_task_is_a_clear_error_and_changes_nothing(
    store: Store, db_url: str, args: tuple[str, ...], message: str
) -> None:
    await _dag(store)
    before = await _states(store)
    result = await cli_run(db_url, *args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())
    assert await _states(store) == before
    assert await store.list_audit() == []


async def test_clear_of_a_deferred_task_then_a_late_event_changes_nothing(
    store: Store, db_url: str
) -> None:
    """d and a wait on one shared trigger; d is cleared: the trigger keeps running for a, and
    its event later resumes a alone. Then a itself is cleared while deferred (the trigger is
    dropped), and the event its triggerer still sends, under its old fence, moves nothing."""
    ids = await _dag(store)
    worker = await store.register_worker("w", 1, 16)
    claimed = {c.task_id: c for c in (await store.claim_tasks(worker, 16)).claimed}
    assert set(claimed) == {"a", "d"}
    assert await store.defer_task(ids["a"], worker, never_deferral("shared"))
    assert await store.defer_task(ids["d"], worker, never_deferral("shared"))
    triggerer = await store.register_triggerer("t", 1, 100, 60.0)
    (trigger,) = (await store.claim_triggers(triggerer, 10)).claimed

    done = await cli_json(db_url, "tasks", "clear", "cm", "--run", "r1", "--task", "d", "--yes")
    assert [(o["was"], o["state"], o["left_trigger_id"]) for o in done] == [
        ("deferred", "scheduled", trigger.id)
    ]
    assert await store.get_trigger(trigger.id) is not None  # still waited on by a
    event = TriggerOutcome(
        trigger_id=trigger.id, fence=trigger.fence, kind="event", payload=encode_value({})
    )
    fired = await store.fire_triggers(triggerer, [event])
    assert [m.task_id for m in fired.moved] == ["a"]
    assert (await _states(store))["d"] == ("scheduled", 1)

    # a resumes (same try), defers again on a trigger of its own; cleared while deferred.
    assert await _claim(store, worker, "a") == 1
    assert await store.defer_task(ids["a"], worker, never_deferral("own"))
    (own,) = (await store.claim_triggers(triggerer, 10)).claimed
    await cli_json(db_url, "tasks", "clear", "cm", "--run", "r1", "--task", "a", "--yes")
    assert await store.get_trigger(own.id) is None  # nobody else waited on it
    before = await _states(store)
    assert before["a"] == ("scheduled", 1)
    late = TriggerOutcome(trigger_id=own.id, fence=own.fence, kind="success")
    fired = await store.fire_triggers(triggerer, [late])
    assert (fired.accepted, fired.moved) == (frozenset(), [])
    assert await _states(store) == before
    # Try 2 runs, and ends as it ends: the old trigger's outcome never counted.
    assert await _claim(store, worker, "a") == 2
    assert await store.defer_task(ids["a"], worker, never_deferral("own"))
    fired = await store.fire_triggers(triggerer, [late])
    assert (fired.accepted, fired.moved) == (frozenset(), [])
    ti = await store.task_try("cm", "r1", "a")
    assert ti is not None
    assert (ti.state, ti.try_number) == ("deferred", 2)


async def test_mark_success_of_a_deferred_sensor_releases_its_trigger_and_downstream_runs(
    store: Store, db_url: str
) -> None:
    ids = await _dag(store)
    worker = await store.register_worker("w", 1, 16)
    await store.claim_tasks(worker, 16)
    assert await store.defer_task(ids["a"], worker, never_deferral("sensor"))
    triggerer = await store.register_triggerer("t", 1, 100, 60.0)
    (trigger,) = (await store.claim_triggers(triggerer, 10)).claimed

    done = await cli_json(db_url, "tasks", "mark-success", "cm", "r1", "a")
    assert [(o["task_id"], o["was"], o["state"], o["left_trigger_id"]) for o in done] == [
        ("a", "deferred", "success", trigger.id)
    ]
    assert await store.get_trigger(trigger.id) is None
    assert (await _states(store))["b"] == ("scheduled", 0)
    # Its event, if it still comes, moves nothing; b runs.
    late = TriggerOutcome(trigger_id=trigger.id, fence=trigger.fence, kind="failed", error="x")
    assert (await store.fire_triggers(triggerer, [late])).moved == []
    assert await _claim(store, worker, "b") == 1
    audit = [(a.action, a.target, a.detail.get("was")) for a in await store.list_audit()]
    assert audit == [("mark_success", "cm/r1/a", "deferred")]


async def test_mark_failed_of_a_running_task_stops_it_and_ignores_its_outcome(
    store: Store, db_url: str
) -> None:
    ids = await _dag(store)
    worker = await store.register_worker("w", 1, 16)
    assert await _claim(store, worker, "a") == 1
    done = await cli_json(db_url, "tasks", "mark-failed", "cm", "r1", "a")
    assert [(o["was"], o["state"], o["stopping_worker_id"]) for o in done] == [
        ("running", "failed", worker)
    ]
    # Its worker is told to stop the try (a wake-up, and its next heartbeat says so) ...
    beat = await store.heartbeat_worker(worker, [(ids["a"], 1), (ids["d"], 1)])
    assert [(r.ti_id, r.try_number) for r in beat.stop] == [(ids["a"], 1)]
    assert "marked failed by" in beat.stop[0].reason
    # ... and what the try reports after is ignored.
    late = TaskOutcome(ti_id=ids["a"], worker_id=worker, try_number=1, kind="success")
    assert await store.finish_tasks([late]) == []
    states = await _states(store)
    assert (states["a"][0], states["b"][0], states["c"][0]) == (
        "failed", "upstream_failed", "upstream_failed",
    )  # fmt: skip
    ti = await store.task_try("cm", "r1", "a")
    assert ti is not None
    assert ti.error is not None
    assert "marked failed by" in ti.error


async def test_mark_with_downstream_and_skipped(store: Store, db_url: str) -> None:
    await _dag(store)
    done = await cli_json(db_url, "tasks", "mark-skipped", "cm", "r1", "b", "--downstream")
    assert sorted((o["task_id"], o["state"]) for o in done) == [("b", "skipped"), ("c", "skipped")]
    assert (await _states(store))["a"] == ("scheduled", 0)
    # Marking what is already so changes nothing.
    result = await cli_run(db_url, "tasks", "mark-skipped", "cm", "r1", "b")
    assert result.exit_code == 0, result.output
    assert "already skipped" in result.stdout


async def test_runs_mark_failed_fails_the_tries_under_way_and_skips_the_rest(
    store: Store, db_url: str
) -> None:
    ids = await _dag(store)
    worker = await store.register_worker("w", 1, 16)
    await store.claim_tasks(worker, 16)  # a and d run
    await _end(store, ids, worker, "d", 1, "success")
    result = await cli_json(db_url, "runs", "mark-failed", "cm", "r1")
    assert (result["was"], result["state"]) == ("running", "failed")
    assert sorted((o["task_id"], o["was"], o["state"]) for o in result["tasks"]) == [
        ("a", "running", "failed"), ("b", "pending", "skipped"), ("c", "pending", "skipped"),
    ]  # fmt: skip
    run = await store.get_dag_run("cm", "r1")
    assert run is not None
    assert run.state == "failed"
    assert run.ended_at is not None
    assert (await _states(store))["d"] == ("success", 1)  # ended: kept
    late = TaskOutcome(ti_id=ids["a"], worker_id=worker, try_number=1, kind="success")
    assert await store.finish_tasks([late]) == []
    assert await store.finish_dag_runs() == []  # ended, and stays as marked
    actions = {a.action for a in await store.list_audit()}
    assert {"mark_run_failed", "mark_failed", "mark_skipped"} <= actions

    # mark-success: every task instance not a success (failed, skipped) becomes one.
    result = await cli_json(db_url, "runs", "mark-success", "cm", "r1")
    assert (result["was"], result["state"]) == ("failed", "success")
    assert {s for s, _ in (await _states(store)).values()} == {"success"}
    run = await store.get_dag_run("cm", "r1")
    assert run is not None
    assert run.state == "success"


async def test_a_mark_committed_first_refuses_the_worker_outcome_racing_it(
    store: Store, db_url: str
) -> None:
    """A worker finishing a try while a mark of it is being committed: the mark holds the task
    instance's row, the worker's write waits for it, then finds the try no longer its own."""
    ids = await _dag(store)
    worker = await store.register_worker("w", 1, 16)
    assert await _claim(store, worker, "a") == 1
    conn = await asyncpg.connect(db_url)
    try:
        tx = conn.transaction()
        await tx.start()
        # The mark, uncommitted (its statement, as Store.mark_tasks runs it).
        await conn.fetch(store._q["mark_tasks"], [ids["a"]], "failed", "me", "a test")
        finished: list[object] = []

        async def finish() -> None:
            out = TaskOutcome(ti_id=ids["a"], worker_id=worker, try_number=1, kind="success")
            finished.append(await store.finish_tasks([out]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(finish)

            async def waiting() -> bool:
                return bool(
                    await conn.fetchval(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                ) or bool(finished)

            await wait_until(waiting, what="the worker's outcome to wait for the mark")
            await tx.commit()
    finally:
        await conn.close()
    assert finished == [[]]
    assert (await _states(store))["a"] == ("failed", 1)


async def test_a_run_marked_failed_keeps_a_success_committed_first(
    store: Store, db_url: str
) -> None:
    """A worker's success commits while the run's mark waits for the row: the mark reads the
    task as it then is (ended) and keeps it."""
    ids = await _dag(store)
    worker = await store.register_worker("w", 1, 16)
    await store.claim_tasks(worker, 16)
    conn = await asyncpg.connect(db_url)
    try:
        tx = conn.transaction()
        await tx.start()
        # The worker's outcome, uncommitted: it holds a's row.
        out = await conn.fetch(
            store._q["finish_tasks"], [ids["a"]], [worker], ["success"], [None], [None],
            [False], [1], None, [], [],
        )  # fmt: skip
        assert [r["state"] for r in out] == ["success"]
        marked: list[Any] = []

        async def mark() -> None:
            marked.append(await store.mark_run("cm", "r1", "failed", who="me", via="a test"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(mark)

            async def waiting() -> bool:
                return bool(
                    await conn.fetchval(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                ) or bool(marked)

            await wait_until(waiting, what="the mark to wait for the worker's outcome")
            await tx.commit()
    finally:
        await conn.close()
    (run,) = marked
    assert sorted((o.task_id, o.state) for o in run.tasks) == [
        ("b", "skipped"), ("c", "skipped"), ("d", "failed"),
    ]  # fmt: skip
    assert (await _states(store))["a"] == ("success", 1)
