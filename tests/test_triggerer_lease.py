"""The lease, kept outside the event loop by a thread whose session holds the triggerer's
advisory lock, with real ``python -m engine triggerer`` processes:

* a trigger that blocks the loop longer than the lease neither loses the lease nor stops the
  timer beside it for good: it is failed past ``triggerer_max_block_s`` and never started
  again;
* a SIGKILLed triggerer's triggers are adopted as soon as its session ends, long before its
  lease would lapse: none lost, none resumed twice.
"""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest

from engine import DAG
from engine.store import Store
from tests.helpers import wait_until
from tests.triggerer_faults import Spawn, WaitFor, spawn, start_run, tis_of, worker_running
from tests.triggerer_support import read_journal
from triggers.base import decode_value

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

__all__ = ["spawn"]  # the fixture


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})  # the triggerers run in their own processes


async def test_a_trigger_blocking_the_loop_past_the_lease_is_failed_and_the_timer_resumes(
    store: Store, tmp_path: Path, spawn: Spawn
) -> None:
    starts = tmp_path / "starts.log"
    with DAG(dag_id="blocker") as dag:
        # Blocks the loop for longer than the lease (1.5 s), and past the limit (0.5 s).
        WaitFor(
            task_id="sleeper",
            trigger="Sleeper",
            trigger_kwargs={"block_s": 2.5, "journal": str(starts)},
        )
        # A short timer beside it: fires 0.3 s after the flag, which exists from the start.
        (tmp_path / "go").touch()
        WaitFor(
            task_id="timer",
            trigger="FlagThenDelay",
            trigger_kwargs={"flag": str(tmp_path / "go"), "key": "timer", "delay_s": 0.3},
        )
    proc = spawn(lease_s=1.5, max_block_s=0.5)

    async def registered() -> bool:
        return len(await store.list_triggerers()) == 1

    await wait_until(registered, what="the triggerer to register")
    (registration,) = await store.list_triggerers()
    async with worker_running(store, dag):
        await start_run(store, dag)

        async def both_ended() -> bool:
            tis = await tis_of(store, "blocker")
            return (
                len(tis) == 2
                and tis["timer"].state == "success"
                and (tis["sleeper"].state == "failed")
            )

        await wait_until(both_ended, what="the timer resumed and the blocker failed")
    tis = await tis_of(store, "blocker")
    error = tis["sleeper"].error
    assert "blocked the triggerer's event loop for over 0.5s" in error
    assert "triggerer_max_block_s" in error
    assert "Sleeper.run" in error  # where it blocked
    # The failure was written while the loop was blocked, so the trigger row is gone: no
    # triggerer (this one after losing its lease, or another) can start it again.
    assert await store.list_triggers() == []
    assert [line[1] for line in read_journal(starts)] == ["sleeper"]
    # The lease outlived the block: the same registration, never reaped and registered again.
    assert [r.id for r in await store.list_triggerers()] == [registration.id]
    assert proc.poll() is None


async def test_a_killed_triggerers_triggers_are_adopted_when_its_session_ends(
    store: Store, tmp_path: Path, spawn: Spawn
) -> None:
    count = 20
    starts = tmp_path / "starts.log"
    resumed = tmp_path / "resumed.log"
    with DAG(dag_id="failover") as dag:
        for i in range(count):
            WaitFor(
                task_id=f"w{i}",
                trigger="FlagThenDelay",
                trigger_kwargs={
                    "flag": str(tmp_path / "go"),
                    "key": f"k{i}",
                    "journal": str(starts),
                },
                resumed_journal=str(resumed),
            )
    # A lease far longer than the test: only the end of the dead one's session can free its
    # triggers in time.
    first = spawn(lease_s=600)

    async def first_holds_all() -> bool:
        held = {r.pid: r.held for r in await store.list_triggerers()}
        return held.get(first.pid) == count and len(read_journal(starts)) == count

    async with worker_running(store, dag):
        await start_run(store, dag)
        await wait_until(first_holds_all, what="the first triggerer holding every trigger")
        second = spawn(lease_s=600)

        async def second_registered() -> bool:
            return second.pid in {r.pid for r in await store.list_triggerers()}

        await wait_until(second_registered, what="the second triggerer to register")
        first.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(first.wait)

        async def adopted() -> bool:
            held = {r.pid: r.held for r in await store.list_triggerers()}
            return held == {second.pid: count} and len(read_journal(starts)) == 2 * count

        await wait_until(adopted, what="the survivor adopting every trigger")
        (tmp_path / "go").touch()

        async def all_resumed() -> bool:
            tis = await tis_of(store, "failover")
            return all(ti.state == "success" for ti in tis.values())

        await wait_until(all_resumed, what="every task resumed")
    tis = await tis_of(store, "failover")
    journal = sorted(int(line[1]) for line in read_journal(resumed))
    assert journal == sorted(ti.id for ti in tis.values())  # none lost, none twice
    assert {decode_value(ti.result)["pid"] for ti in tis.values()} == {second.pid}
    assert second.poll() is None
