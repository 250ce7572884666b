"""Resumes handed to a worker as their triggers fire (migration 0033, issue 21): the fire claims
for the live worker that takes resumes with the most free slots what a claim would admit, and
tells that worker; anything a limit could hold back is left runnable for a claim, as before."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from engine.dags.dag import DAG
from engine.store import PAYLOAD_HANDED, Store, TriggerOutcome
from operators.base import BaseOperator, Context
from operators.python import PythonOperator
from tests.helpers import claimed_tasks, never_deferral, wait_until
from tests.triggers_for_tests import WaitTrigger
from triggers.base import decode_value, encode_value

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def taker(store: Store, slots: int = 4, **kwargs: Any) -> AsyncIterator[int]:
    """A worker row that takes resumes, for the length of a test (later tests of the same
    database must not be handed resumes by it)."""
    kwargs.setdefault("takes_resumes", True)
    worker = await store.register_worker("taker", 2, slots, **kwargs)
    try:
        yield worker
    finally:
        await store.unregister_worker(worker)


async def _deferred(store: Store, n: int, prefix: str) -> tuple[str, list[int]]:
    """``n`` tasks of a new DAG deferred on triggers of their own, none of them held by a
    triggerer: (dag id, their task instance ids)."""
    dag_id, worker, tis = await claimed_tasks(store, n, prefix)
    for i, ti in enumerate(tis):
        assert await store.defer_task(ti.id, worker, never_deferral(f"{dag_id}-{i}"))
    await store.unregister_worker(worker)
    return dag_id, [ti.id for ti in tis]


async def _fire(store: Store, ti_ids: list[int]) -> None:
    """A triggerer claims the triggers of these task instances and fires them."""
    rows = await store._pool.fetch(
        "SELECT trigger_id FROM deferral_task_instances WHERE id = ANY ($1::bigint[])", ti_ids
    )
    mine = {r["trigger_id"] for r in rows}
    me = await store.register_triggerer("test", 1, 10_000, 60.0)
    claimed = [t for t in (await store.claim_triggers(me, 10_000)).claimed if t.id in mine]
    assert len(claimed) == len(mine)
    outcomes = [
        TriggerOutcome(trigger_id=t.id, fence=t.fence, kind="event", payload=encode_value("hi"))
        for t in claimed
    ]
    fired = await store.fire_triggers(me, outcomes)
    assert fired.accepted == mine


async def _states(store: Store, ti_ids: list[int]) -> list[tuple[str, int | None]]:
    rows = await store._pool.fetch(
        "SELECT state, worker_id FROM deferral_task_instances WHERE id = ANY ($1::bigint[]) "
        "ORDER BY id",
        ti_ids,
    )
    return [(r["state"], r["worker_id"]) for r in rows]


async def test_a_fired_resume_is_handed_to_a_worker_that_takes_resumes(
    store: Store, db_url: str
) -> None:
    dag_id, (ti_id,) = await _deferred(store, 1, "handed")
    heard: list[str] = []
    listen = await asyncpg.connect(db_url)
    try:
        await listen.add_listener("deferral_tasks", lambda *args: heard.append(args[-1]))
        async with taker(store) as worker:
            await _fire(store, [ti_id])
            assert await _states(store, [ti_id]) == [("running", worker)]

            async def told() -> bool:
                return f"{PAYLOAD_HANDED}{worker}" in heard

            await wait_until(told, what="the worker told it was handed a resume")
            # It reads what it was handed: the resume, its event opened, the same try.
            (handed,) = (await store.handed_tasks(worker, 100)).claimed
            assert handed.id == ti_id
            assert handed.next_method == "resume"
            assert handed.next_event is not None
            assert decode_value(handed.next_event) == "hi"
            assert handed.try_number == 1
            # Nobody else was woken to claim it.
            assert "" not in heard
    finally:
        await listen.close()
    page = await store.task_logs(dag_id, "r1", "t0", 1)
    lines = [line.message for line in page.lines]
    assert any("fired with event" in m for m in lines), lines
    assert any(m.startswith(f"resuming at resume on worker {worker} (taker, pid 2)") for m in lines)


async def test_without_a_worker_that_takes_resumes_the_fire_leaves_them_runnable(
    store: Store,
) -> None:
    _, ti_ids = await _deferred(store, 2, "not_handed")
    async with taker(store, takes_resumes=False):
        await _fire(store, ti_ids)
    assert await _states(store, ti_ids) == [("scheduled", None)] * 2


async def test_a_worker_is_handed_no_more_resumes_than_its_free_slots(store: Store) -> None:
    _, ti_ids = await _deferred(store, 3, "slots")
    async with taker(store, slots=2) as worker:
        await _fire(store, ti_ids)
        states = await _states(store, ti_ids)
    assert sorted(states, key=str) == sorted(
        [("running", worker), ("running", worker), ("scheduled", None)], key=str
    )


async def test_the_pool_must_have_room_unless_it_counts_deferred_tasks(store: Store) -> None:
    dag_id, full = await _deferred(store, 1, "pool_full")
    await store.set_pool(dag_id, 0)
    async with taker(store):
        await _fire(store, full)
    assert await _states(store, full) == [("scheduled", None)]

    dag_id, reserved = await _deferred(store, 1, "pool_reserved")
    await store.set_pool(dag_id, 0, include_deferred=True)
    async with taker(store) as worker:
        await _fire(store, reserved)
        assert await _states(store, reserved) == [("running", worker)]


@pytest.mark.parametrize(
    "limit",
    [
        pytest.param(lambda dag_id: {"dag": {"max_active_tasks": 8}}, id="max_active_tasks"),
        pytest.param(lambda dag_id: {"task": {"max_active_tis_per_dag": 8}}, id="per_task"),
        pytest.param(lambda dag_id: {"queue": "elsewhere"}, id="queue_not_served"),
        pytest.param(lambda dag_id: {"parallelism": 8}, id="a_worker_counts_parallelism"),
    ],
)
async def test_what_a_limit_could_hold_back_is_left_to_a_claim(
    store: Store, limit: Callable[[str], dict[str, Any]]
) -> None:
    """A DAG with max_active_tasks, a task with max_active_tis_per_dag, a queue the worker does
    not serve, a live worker with a global parallelism: the resume is made runnable, not
    handed (a claim admits it against those limits)."""
    what = limit("")
    dag_id = f"limited_{next(_numbers)}"
    await store.set_pool(dag_id, 4)
    with DAG(dag_id=dag_id, **what.get("dag", {})) as dag:
        PythonOperator(
            task_id="t0",
            python_callable=_noop,
            pool=dag_id,
            queue=what.get("queue", "default"),
            **what.get("task", {}),
        )
    await store.upsert_dag(
        dag_id, f"{dag_id}.py", dag.serialize_tasks(), None, dag.serialize_schedule()
    )
    await store.create_dag_run(dag_id, "r1", logical_date=await store.now())
    queues = [what.get("queue", "default")]
    claimer = await store.register_worker("claimer", 1, 4, queues)
    (ti,) = [
        t
        for t in (await store.claim_tasks(claimer, 100, queues=queues)).claimed
        if t.dag_id == dag_id
    ]
    assert await store.defer_task(ti.id, claimer, never_deferral(dag_id))
    await store.unregister_worker(claimer)
    counting = None
    if "parallelism" in what:
        counting = await store.register_worker("counting", 3, 4, parallelism=8)
    try:
        async with taker(store):
            await _fire(store, [ti.id])
    finally:
        if counting is not None:
            await store.unregister_worker(counting)
    assert await _states(store, [ti.id]) == [("scheduled", None)]


async def test_a_worker_that_stopped_taking_resumes_is_handed_none(store: Store) -> None:
    _, ti_ids = await _deferred(store, 1, "stopped_taking")
    async with taker(store) as worker:
        await store.stop_taking_resumes(worker)
        await _fire(store, ti_ids)
    assert await _states(store, ti_ids) == [("scheduled", None)]


class _Waits(BaseOperator):
    def execute(self, context: Context) -> Any:
        self.defer(trigger=WaitTrigger(0.01, {"n": 7}), method_name="resume")

    def resume(self, context: Context, event: Any = None) -> Any:
        return event


async def test_an_engine_runs_the_resumes_its_worker_is_handed(store: Store) -> None:
    """End to end: the resume runs on the worker it was handed to, in the method it named,
    with the event; claimed in the fire's own transaction (its start is when it fired), not
    by a claim of the worker; and the worker, stopping, takes no more."""
    from engine.testing import run_engine

    with DAG(dag_id=f"handed_e2e_{next(_numbers)}") as dag:
        _Waits(task_id="w")
    async with run_engine(store, dags=[dag]) as engine:
        tis = await engine.run_dag(dag)
        worker = engine.worker.id
    assert tis["w"]["state"] == "success", tis["w"]
    handed = await store._pool.fetchval(
        "SELECT started_at = fired_at FROM deferral_task_instances WHERE dag_id = $1", dag.dag_id
    )
    assert handed is True
    page = await store.task_logs(dag.dag_id, tis["w"]["run_id"], "w", 1)
    lines = [line.message for line in page.lines]
    assert any(m.startswith(f"resuming at resume on worker {worker} ") for m in lines), lines
    gone = await store._pool.fetchval("SELECT count(*) FROM deferral_workers WHERE id = $1", worker)
    assert gone == 0  # (stopped: it unregistered)


def _noop() -> None:
    pass


def _counter() -> Any:
    n = 0
    while True:
        n += 1
        yield n


_numbers = _counter()


async def test_a_resume_handed_while_its_notification_was_lost_is_run_all_the_same(
    store: Store,
) -> None:
    """The notification that names the worker is lost (as while its listener reconnects):
    the worker's polling backstop reads what it holds and does not run, so the resume runs
    instead of sitting 'running' until it is reaped as a zombie."""
    from engine.testing import run_engine

    with DAG(dag_id=f"handed_unheard_{next(_numbers)}") as dag:
        _Waits(task_id="w")
    async with run_engine(store, dags=[dag], triggerer=False) as engine:
        await engine.start_run(dag)
        await engine.wait_for_state(dag.dag_id, "w", "deferred")
        # What a fire hands, without its notification: the resume held by the worker.
        moved = await store._pool.execute(
            "UPDATE deferral_task_instances SET state = 'running', worker_id = $2, "
            "trigger_id = NULL, trigger_timeout_at = NULL, next_event = NULL, "
            "run_after = now(), started_at = now(), fired_at = now(), heartbeat_at = now(), "
            "handed = true "
            "WHERE dag_id = $1 AND state = 'deferred'",
            dag.dag_id,
            engine.worker.id,
        )
        assert moved == "UPDATE 1"
        ti = await engine.wait_for_state(dag.dag_id, "w", "success")
    assert ti["try_number"] == 1


# -- a handed resume nobody reads is given back, never failed ---------------------------------


async def _handed_flags(store: Store, ti_ids: list[int]) -> list[bool]:
    rows = await store._pool.fetch(
        "SELECT handed FROM deferral_task_instances WHERE id = ANY ($1::bigint[]) ORDER BY id",
        ti_ids,
    )
    return [r["handed"] for r in rows]


async def test_a_resume_its_worker_never_read_is_given_back_not_failed(store: Store) -> None:
    """The worker it was handed to died before reading it (or missed the notification and its
    polls): the scheduler's reaper gives it back, the same try with its event, for any worker;
    a zombie it is not (that would fail a try that never started)."""
    dag_id, (ti_id,) = await _deferred(store, 1, "given_back")
    async with taker(store) as worker:
        await _fire(store, [ti_id])
        assert await _states(store, [ti_id]) == [("running", worker)]
        assert await _handed_flags(store, [ti_id]) == [True]
        # Not silent long enough yet: nothing moves.
        assert await store.reap_zombie_tasks(3600.0) == []
        moved = await store.reap_zombie_tasks(3600.0, handed_unread_s=0.0)
        assert [(m.id, m.state) for m in moved] == [(ti_id, "scheduled")]
        assert await _states(store, [ti_id]) == [("scheduled", None)]
        assert await _handed_flags(store, [ti_id]) == [False]
        # The worker it was handed to finds nothing to read any more.
        assert (await store.handed_tasks(worker, 100)).claimed == []
    # Any worker claims it: the resume, with its event, in the same try.
    other = await store.register_worker("other", 5, 4)
    try:
        (resumed,) = [
            t for t in (await store.claim_tasks(other, 100)).claimed if t.dag_id == dag_id
        ]
    finally:
        await store.unregister_worker(other)
    assert resumed.id == ti_id
    assert resumed.try_number == 1
    assert resumed.next_method == "resume"
    assert resumed.next_event is not None
    assert decode_value(resumed.next_event) == "hi"
    page = await store.task_logs(dag_id, "r1", "t0", 1)
    lines = [line.message for line in page.lines]
    assert any("did not read it within 0s; it is runnable again" in m for m in lines), lines


async def test_a_resume_its_worker_read_is_its_own(store: Store) -> None:
    """Once read, a handed resume is the worker's try as a claimed one is: the reaper leaves
    it to the heartbeat rule, a lost-claim read does not return it twice, and a second read
    finds nothing."""
    _, (ti_id,) = await _deferred(store, 1, "read_once")
    async with taker(store) as worker:
        await _fire(store, [ti_id])
        # Unread, it is not a lost claim (the lost-claim read would run it unacknowledged).
        assert (await store.unacknowledged_claims(worker, [])).claimed == []
        (handed,) = (await store.handed_tasks(worker, 100)).claimed
        assert handed.id == ti_id
        assert await _handed_flags(store, [ti_id]) == [False]
        assert (await store.handed_tasks(worker, 100)).claimed == []
        assert await store.reap_zombie_tasks(3600.0, handed_unread_s=0.0) == []
        assert await _states(store, [ti_id]) == [("running", worker)]
        # Read but its reply lost: the lost-claim read finds it.
        assert [t.id for t in (await store.unacknowledged_claims(worker, [])).claimed] == [ti_id]
        await store._pool.execute(
            "UPDATE deferral_task_instances SET state = 'success', worker_id = NULL WHERE id = $1",
            ti_id,
        )


async def test_a_worker_leaving_gives_back_what_it_never_read(store: Store) -> None:
    dag_id, ti_ids = await _deferred(store, 2, "left_unread")
    async with taker(store) as worker:
        await _fire(store, ti_ids)
        assert await _states(store, ti_ids) == [("running", worker)] * 2
    # (taker unregistered it)
    assert await _states(store, ti_ids) == [("scheduled", None)] * 2
    assert await _handed_flags(store, ti_ids) == [False, False]
    page = await store.task_logs(dag_id, "r1", "t0", 1)
    lines = [line.message for line in page.lines]
    assert any(f"worker {worker} left without reading this resume" in m for m in lines), lines


async def test_a_worker_reads_no_more_than_its_free_slots_and_gives_back_the_rest(
    store: Store, db_url: str
) -> None:
    """The database cannot see every slot a worker holds (a thread past its timeout holds
    one): the worker reads at most what it counts free, and the rest goes back at once."""
    dag_id, ti_ids = await _deferred(store, 3, "read_limit")
    heard: list[str] = []
    listen = await asyncpg.connect(db_url)
    try:
        await listen.add_listener("deferral_tasks", lambda *args: heard.append(args[-1]))
        async with taker(store, slots=4) as worker:
            await _fire(store, ti_ids)
            assert await _states(store, ti_ids) == [("running", worker)] * 3
            heard.clear()
            (read,) = (await store.handed_tasks(worker, 1)).claimed
            assert read.id == ti_ids[0]  # (equal priority: the oldest first)

            async def woke() -> bool:
                return "" in heard

            await wait_until(woke, what="the workers woken for what was given back")
            assert await _states(store, ti_ids) == [
                ("running", worker),
                ("scheduled", None),
                ("scheduled", None),
            ]
            assert await _handed_flags(store, ti_ids) == [False] * 3
            assert (await store.handed_tasks(worker, 0)).claimed == []
            await store._pool.execute(
                "UPDATE deferral_task_instances SET state = 'success', worker_id = NULL "
                "WHERE id = $1",
                ti_ids[0],
            )
    finally:
        await listen.close()
    page = await store.task_logs(dag_id, "r1", "t1", 1)
    lines = [line.message for line in page.lines]
    assert any(f"worker {worker} had no free slot for this resume" in m for m in lines), lines


_LINGERING_DAG = """
    import pathlib
    import time

    from engine import DAG
    from operators.base import BaseOperator
    from triggers.file import FileTrigger

    JOURNAL = pathlib.Path({journal})
    PAST_TIMEOUT = pathlib.Path({past_timeout})
    RESUMED = pathlib.Path({resumed})


    def note(line):
        with JOURNAL.open("a") as f:
            f.write(line + "\\n")


    class Waits(BaseOperator):
        def execute(self, context):
            self.defer(trigger=FileTrigger(str(PAST_TIMEOUT), poll_interval=0.05),
                       method_name="resume")

        def resume(self, context, event=None):
            note("resume-start")
            RESUMED.touch()


    class Stuck(BaseOperator):
        def execute(self, context):
            note("stuck-start")
            time.sleep(0.6)  # past its execution_timeout: failed, its thread lingers
            PAST_TIMEOUT.touch()  # the trigger fires while the thread holds the only slot
            deadline = time.monotonic() + {hold_s}
            while time.monotonic() < deadline and not RESUMED.exists():
                time.sleep(0.01)
            note("stuck-end")


    with DAG("handoff_lingering"):
        Waits(task_id="waits", priority_weight=10)
        Stuck(task_id="stuck", execution_timeout=0.3, priority_weight=1)
"""


async def test_a_resume_waits_for_a_thread_that_holds_the_only_slot(
    store: Store, tmp_path: Path
) -> None:
    """The fire counts the slot of a thread past its timeout free (its try's failure is
    written); the worker, reading what it was handed, does not: the resume runs once the
    thread has ended, not beside it."""
    from tests.test_worker_timeouts import _ended, _engine, _write_dag

    journal = tmp_path / "journal"
    dags = _write_dag(
        tmp_path,
        _LINGERING_DAG,
        journal=str(journal),
        past_timeout=str(tmp_path / "past-timeout"),
        resumed=str(tmp_path / "resumed"),
        hold_s=4.0,
    )
    async with _engine(store, dags, slots=1) as worker:
        await wait_until(lambda: _ended(store, "handoff_lingering"), what="the run to end")
        assert worker.peak_running == 1
    assert journal.read_text().split() == ["stuck-start", "stuck-end", "resume-start"]


async def _runnable(store: Store, prefix: str) -> tuple[str, list[int]]:
    """A new DAG of one task, its run created: (dag id, [its runnable task instance id])."""
    dag_id = f"{prefix}_{next(_numbers)}"
    await store.set_pool(dag_id, 4)
    with DAG(dag_id=dag_id) as dag:
        PythonOperator(task_id="t0", python_callable=_noop, pool=dag_id)
    await store.upsert_dag(dag_id, f"{dag_id}.py", dag.serialize_tasks(), None)
    await store.create_dag_run(dag_id, "r1", logical_date=await store.now())
    ids = await store._pool.fetch(
        "SELECT id FROM deferral_task_instances WHERE dag_id = $1 AND state = 'scheduled'", dag_id
    )
    return dag_id, [r["id"] for r in ids]


async def test_a_claim_takes_no_slot_a_fire_filled_while_it_waited(store: Store) -> None:
    """A worker counts its claim's limit before the admission's lock; a fire may hand it
    resumes meanwhile. The claim, once it holds the lock, takes no more than its slots hold."""
    _, handed_ids = await _deferred(store, 2, "filled")
    dag_id, waiting = await _runnable(store, "claim_waits")
    async with taker(store, slots=2) as worker:
        await _fire(store, handed_ids)
        assert await _states(store, handed_ids) == [("running", worker)] * 2
        # Its limit (2), counted before the fire, would have taken the waiting task too.
        assert (await store.claim_tasks(worker, 2)).claimed == []
        assert len((await store.handed_tasks(worker, 100)).claimed) == 2  # (its tries now)
        await store._pool.execute(
            "UPDATE deferral_task_instances SET state = 'success', worker_id = NULL "
            "WHERE id = ANY ($1::bigint[])",
            handed_ids,
        )
        # With its slots free again, it claims.
        got = [t.id for t in (await store.claim_tasks(worker, 2)).claimed if t.dag_id == dag_id]
        assert got == waiting


async def test_a_claim_clears_a_stale_handed_mark(store: Store) -> None:
    """A handed resume cleared before its worker read it (state 'scheduled' again, as a clear
    or mark leaves it) and claimed later is that claim's try: not unread, never given back."""
    dag_id, (ti_id,) = await _deferred(store, 1, "stale_mark")
    async with taker(store):
        await _fire(store, [ti_id])
        await store._pool.execute(
            "UPDATE deferral_task_instances SET state = 'scheduled', worker_id = NULL "
            "WHERE id = $1",
            ti_id,
        )
        assert await _handed_flags(store, [ti_id]) == [True]
    other = await store.register_worker("other", 6, 4)
    try:
        got = [t.id for t in (await store.claim_tasks(other, 100)).claimed if t.dag_id == dag_id]
        assert got == [ti_id]
        assert await _handed_flags(store, [ti_id]) == [False]
        assert await store.reap_zombie_tasks(3600.0, handed_unread_s=0.0) == []
        assert await _states(store, [ti_id]) == [("running", other)]
    finally:
        await store._pool.execute(
            "UPDATE deferral_task_instances SET state = 'success', worker_id = NULL WHERE id = $1",
            ti_id,
        )
        await store.unregister_worker(other)


async def test_a_deferral_written_again_does_not_park_the_resume_it_was_handed(
    store: Store,
) -> None:
    """A deferral's reply was lost after it committed; its trigger fired and handed the resume
    to the same worker before the write was sent again. The repeated write must find no try
    to park (the resume is not the try that deferred)."""
    dag_id, worker, (ti,) = await claimed_tasks(store, 1, "deferred_twice")
    await store._pool.execute(
        "UPDATE deferral_workers SET takes_resumes = true WHERE id = $1", worker
    )
    try:
        deferral = never_deferral(f"{dag_id}-0")
        assert await store.defer_task(ti.id, worker, deferral)
        await _fire(store, [ti.id])
        assert await _states(store, [ti.id]) == [("running", worker)]
        assert not await store.defer_task(ti.id, worker, deferral)
        assert await _states(store, [ti.id]) == [("running", worker)]
        assert await _handed_flags(store, [ti.id]) == [True]
    finally:
        await store.unregister_worker(worker)
