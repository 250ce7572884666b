"""The triggerer in the test's event loop: capacity, deduplication, deadlines, a blocked loop,
and triggers that fail in every way a trigger can."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine import DAG
from engine.dags.dagbag import DagBag
from engine.store import Store, TaskInstance
from engine.testing import run_engine
from engine.triggerer import Triggerer
from engine.worker.worker import Worker
from tests.helpers import wait_until
from tests.triggerer_support import WaitOn, read_journal

pytestmark = pytest.mark.anyio


class Parts:
    def __init__(self, store: Store, dagbag: DagBag, worker: Worker, triggerer: Triggerer):
        self.store = store
        self.dagbag = dagbag
        self.worker = worker
        self.triggerer = triggerer

    async def start(self, dag: DAG, run_id: str = "r1") -> None:
        self.dagbag.add_dag(dag)
        await self.store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
        now = await self.store.now()
        await self.store.create_dag_run(dag.dag_id, run_id, logical_date=now)

    async def tis(self, dag_id: str) -> dict[str, TaskInstance]:
        return {ti.task_id: ti for ti in await self.store.list_task_instances(dag_id=dag_id)}

    async def states(self, dag_id: str) -> dict[str, str]:
        return {k: v.state for k, v in (await self.tis(dag_id)).items()}


@contextlib.asynccontextmanager
async def engine_parts(store: Store, **triggerer_options: Any) -> AsyncIterator[Parts]:
    """A worker and a triggerer (no scheduler: nothing here may rely on its backstops)."""
    async with run_engine(
        store, scheduler=False, slots=8, triggerer_options=triggerer_options
    ) as engine:
        yield Parts(store, engine.dagbag, engine.worker, engine.triggerer)


def _flag(tmp_path: Path, key: str, journal: Path | None = None) -> dict[str, Any]:
    return {
        "flag": str(tmp_path / "go"),
        "key": key,
        "journal": None if journal is None else str(journal),
    }


async def test_capacity_is_never_exceeded_and_the_rest_waits_as_backlog(
    store: Store, tmp_path: Path
) -> None:
    """A full triggerer leaves the rest unowned, and claims it as soon as writing its events
    makes room (its poll is ten minutes away: only that wake-up can drain the backlog)."""
    with DAG(dag_id="cap") as dag:
        for i in range(10):
            WaitOn(task_id=f"w{i}", trigger="FlagTrigger", trigger_kwargs=_flag(tmp_path, f"k{i}"))
    seen: list[int] = []

    async with engine_parts(store, capacity=3, claim_batch=2, poll_interval_s=600) as parts:
        await parts.start(dag)

        async def held_full_and_backlog() -> bool:
            held = sum(r.held for r in await store.list_triggerers())
            seen.append(held)
            return held == 3 and await store.count_unowned_triggers() == 7

        await wait_until(held_full_and_backlog, what="3 held, 7 waiting unowned")
        (tmp_path / "go").touch()

        async def all_done() -> bool:
            seen.append(sum(r.held for r in await store.list_triggerers()))
            return set((await parts.states("cap")).values()) == {"success"}

        await wait_until(all_done, what="every task resumed through the backlog")
        assert parts.triggerer.peak_held <= 3
    assert max(seen) <= 3


async def test_identical_triggers_share_one_coroutine_and_its_event_resumes_every_task(
    store: Store, tmp_path: Path
) -> None:
    journal = tmp_path / "starts.log"
    with DAG(dag_id="dedup") as dag:
        for i in range(5):
            WaitOn(
                task_id=f"w{i}",
                trigger="FlagTrigger",
                trigger_kwargs=_flag(tmp_path, "same", journal),
            )
    async with engine_parts(store) as parts:
        await parts.start(dag)

        async def all_deferred_and_running() -> bool:
            states = await parts.states("dedup")
            return set(states.values()) == {"deferred"} and bool(read_journal(journal))

        await wait_until(all_deferred_and_running, what="5 tasks waiting on one running trigger")
        triggers = await store.list_triggers()
        assert [t.waiting for t in triggers] == [5]
        (tmp_path / "go").touch()

        async def all_done() -> bool:
            return set((await parts.states("dedup")).values()) == {"success"}

        await wait_until(all_done, what="the one event resumed all five tasks")
    assert [line[:2] for line in read_journal(journal)] == [["start", "same"]]
    assert await store.list_triggers() == []


@pytest.mark.parametrize("soft_fail", [False, True])
async def test_a_deferral_deadline_ends_the_task_on_the_triggerer_without_a_worker(
    store: Store, tmp_path: Path, soft_fail: bool
) -> None:
    with DAG(dag_id="deadline") as dag:
        WaitOn(
            task_id="w",
            trigger="FlagTrigger",
            trigger_kwargs=_flag(tmp_path, "never"),
            timeout=0.3,
            soft_fail=soft_fail,
        )
    async with engine_parts(store) as parts:
        await parts.start(dag)

        async def deferred() -> bool:
            return (await parts.states("deadline")) == {"w": "deferred"}

        await wait_until(deferred, what="the task deferred")
        # From here no worker exists: only the triggerer's timer can end the task.
        parts.worker.stop()

        async def worker_gone() -> bool:
            # (The try's row says deferred before its worker counts it finished: wait for the
            # worker to let go of it too, or its count moves after the snapshot below.)
            running = await store.list_task_instances(state="running")
            return not running and not parts.worker.running

        await wait_until(worker_gone)
        finished = parts.worker.finished

        async def ended() -> bool:
            return (await parts.states("deadline"))["w"] != "deferred"

        await wait_until(ended, what="the deadline ended the deferral")
        ti = (await parts.tis("deadline"))["w"]
        assert parts.worker.finished == finished
    assert ti.state == ("skipped" if soft_fail else "failed")
    assert "deferral timed out" in ti.error


async def test_a_trigger_that_blocks_the_loop_is_named_in_the_log(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="engine.triggerer")
    with DAG(dag_id="blocker") as dag:
        # It blocks again and again (times=0): on a loaded machine the watchdog's thread may
        # not get a core in time to see one single block.
        WaitOn(task_id="w", trigger="BlockingTrigger", trigger_kwargs={"block_s": 0.3, "times": 0})
    async with engine_parts(store, blocked_loop_s=0.08) as parts:
        await parts.start(dag)

        async def trigger_running() -> bool:
            return bool(await store.list_triggers()) and bool(parts.triggerer.held)

        await wait_until(trigger_running)
        trigger_id = (await store.list_triggers())[0].id
        # While the loop is blocked, the watchdog's thread names the trigger by its task's
        # name and its code's place (it reads nothing the loop owns); once the loop runs
        # again, the loop names its class too.
        names = {
            "blocked for over": f"trigger {trigger_id} at",
            "was blocked for": f"trigger {trigger_id} (tests.triggerer_support.BlockingTrigger)",
        }

        def lines(marker: str) -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if marker in r.getMessage() and names[marker] in r.getMessage()
            ]

        async def named_while_blocking_and_after() -> bool:
            return bool(lines("blocked for over")) and bool(lines("was blocked for"))

        await wait_until(named_while_blocking_and_after, what="log lines naming the trigger")
    # The line says where in the trigger's code the loop was stuck, and for how long.
    assert "triggerer_support.py" in lines("blocked for over")[0]
    assert "BlockingTrigger.run" in lines("blocked for over")[0]
    assert "loop was blocked for 0." in lines("was blocked for")[0]


async def test_a_trigger_that_keeps_blocking_the_loop_is_cancelled_and_its_task_fails(
    store: Store,
) -> None:
    with DAG(dag_id="offender") as dag:
        WaitOn(task_id="w", trigger="BlockingTrigger", trigger_kwargs={"block_s": 0.2, "times": 0})
    async with engine_parts(store, blocked_loop_s=0.08, cancel_blocking_after=2) as parts:
        await parts.start(dag)

        async def failed() -> bool:
            return (await parts.states("offender"))["w"] == "failed"

        await wait_until(failed, what="the offender cancelled and its task failed")
        ti = (await parts.tis("offender"))["w"]
        assert "blocked the triggerer's event loop 2 time(s)" in ti.error

        # The task's state is committed just before the writer lets go of the trigger.
        async def let_go() -> bool:
            return not parts.triggerer.held

        await wait_until(let_go, what="the triggerer to let go of the cancelled trigger")


async def test_a_trigger_that_raises_returns_or_hangs_in_cleanup_affects_only_its_own_task(
    store: Store, tmp_path: Path
) -> None:
    with DAG(dag_id="isolation") as dag:
        WaitOn(task_id="raises", trigger="RaisingTrigger")
        WaitOn(task_id="silent", trigger="SilentTrigger")
        WaitOn(task_id="hangs", trigger="HangingCleanupTrigger")
        WaitOn(task_id="good", trigger="FlagTrigger", trigger_kwargs=_flag(tmp_path, "good"))
    async with engine_parts(store, cleanup_timeout_s=0.2) as parts:
        await parts.start(dag)

        async def bad_ones_ended() -> bool:
            states = await parts.states("isolation")
            return (
                states["raises"] == "failed"
                and states["silent"] == "failed"
                and states["hangs"] == "success"
                and states["good"] == "deferred"
            )

        await wait_until(bad_ones_ended, what="each bad trigger ended only its own task")
        (tmp_path / "go").touch()

        async def good_done() -> bool:
            return (await parts.states("isolation"))["good"] == "success"

        await wait_until(good_done, what="the good trigger still fired")
        tis = await parts.tis("isolation")
    assert "the remote service said no" in tis["raises"].error
    assert "returned without yielding an event" in tis["silent"].error


async def test_the_status_page_sees_the_loop_blocked_and_by_which_trigger_class(
    store: Store,
) -> None:
    """The triggerer writes its loop's health with its lease renewals (no statement of its
    own): the blocks seen, the longest one's trigger class, the p99 of its lag."""
    with DAG(dag_id="health") as dag:
        WaitOn(task_id="w", trigger="BlockingTrigger", trigger_kwargs={"block_s": 0.3, "times": 0})
    async with engine_parts(store, blocked_loop_s=0.08, lease_s=1.5) as parts:
        await parts.start(dag)

        async def recorded() -> bool:
            fleet = await store.fleet()
            return bool(fleet.triggerers) and fleet.triggerers[0].blocked_loops > 0

        await wait_until(recorded, what="the triggerer's row to count a blocked loop")
        (row,) = (await store.fleet()).triggerers
    assert row.worst_blocker == "tests.triggerer_support.BlockingTrigger"
    assert row.worst_block_ms is not None
    assert row.worst_block_ms > 80
    assert row.loop_lag_p99_ms is not None
    assert row.version == "0.1.0"
