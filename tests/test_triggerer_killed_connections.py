"""A real triggerer process goes on through connections killed again and again.

Hundreds of tasks wait on triggers held by one ``python -m engine triggerer`` process; the
triggers fire while the test ends every other backend of the database with
``pg_terminate_backend`` round after round (the pool's, the listener's, the lease
thread's). No worker runs meanwhile (this is about the triggerer's loops): one resumes the
tasks afterwards. Every task resumes exactly once and the triggerer is still alive.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import asyncpg
import pytest

from engine import DAG
from engine.runtime.retry import with_db_retry
from engine.store import Store
from tests.helpers import WAIT_S, wait_until
from tests.triggerer_faults import Spawn, WaitFor, spawn, start_run, tis_of, worker_running
from tests.triggerer_support import read_journal

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

__all__ = ["spawn"]  # the fixture

COUNT = 300
#: Rounds of killing at least, and the pause between rounds (a pace, not a wait).
ROUNDS = 15
PACE_S = 0.2

KILL_ALL = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
"""
DEFERRED = "SELECT count(*) FROM deferral_task_instances WHERE state = 'deferred'"


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})  # the triggerer runs in its own process


async def test_the_triggerer_survives_every_connection_killed_again_and_again(
    store: Store, db_url: str, tmp_path: Path, spawn: Spawn
) -> None:
    resumed = tmp_path / "resumed.log"
    with DAG(dag_id="storm") as dag:
        for i in range(COUNT):
            WaitFor(
                task_id=f"w{i}",
                trigger="FlagThenDelay",
                # Spread over three seconds once the flag exists: events are written all
                # through the storm.
                trigger_kwargs={"flag": str(tmp_path / "go"), "key": f"k{i}", "delay_s": i / 100},
                resumed_journal=str(resumed),
            )
    proc = spawn(lease_s=2.0)
    async with worker_running(store, dag, slots=32):
        await start_run(store, dag)

        async def all_held() -> bool:
            rows = await store.list_triggerers()
            return len(rows) == 1 and rows[0].held == COUNT

        await wait_until(all_held, what=f"the triggerer holding {COUNT} triggers")
    # (The worker stopped: the storm is the triggerer's alone.)
    killer = await asyncpg.connect(db_url)
    try:
        (tmp_path / "go").touch()
        rounds = killed = 0
        with anyio.fail_after(WAIT_S * 2):
            while rounds < ROUNDS:
                killed += await killer.fetchval(KILL_ALL)
                rounds += 1
                await anyio.sleep(PACE_S)
                assert proc.poll() is None, f"the triggerer exited after {rounds} round(s)"

        # The storm is over; what it interrupted is written now. (Killing on until every
        # event is in starves a triggerer whose reconnect takes longer than a round on a
        # loaded machine: each round then ends its connections before it writes anything.)
        async def all_fired() -> bool:
            return await killer.fetchval(DEFERRED) == 0

        await wait_until(all_fired, what="every trigger's event written after the storm")
    finally:
        await killer.close()
    assert killed >= ROUNDS  # every round found the triggerer's connections to kill
    assert proc.poll() is None

    tis = await with_db_retry("read tasks", lambda: tis_of(store, "storm"))
    assert {ti.state for ti in tis.values()} == {"scheduled"}
    async with worker_running(store, dag, slots=32):

        async def all_succeeded() -> bool:
            tis = await tis_of(store, "storm")
            return all(ti.state == "success" for ti in tis.values())

        await wait_until(all_succeeded, what="every task resumed")
    journal = sorted(int(line[1]) for line in read_journal(resumed))
    assert journal == sorted(ti.id for ti in tis.values())  # each exactly once
    assert proc.poll() is None
