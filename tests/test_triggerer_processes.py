"""Triggerers as real processes on one database: sharing, SIGKILL and adoption, SIGTERM.

The worker runs in the test's loop; the triggerers are ``python -m engine triggerer``
processes. Triggers fire when the test creates a flag file, and journal every start of
their ``run()`` with the process id, so the tests see who ran what and how often.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from engine import DAG
from engine.store import Store, TaskInstance
from engine.worker.worker import Worker
from tests import triggerer_faults as faults
from tests.helpers import wait_until
from tests.triggerer_faults import Spawn, spawn
from tests.triggerer_support import WaitOn, read_journal
from triggers.base import decode_value

__all__ = ["spawn"]  # the fixture

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # Only the worker runs in the test's loop here; the triggerers run uvloop in their own
    # processes. One backend keeps these process tests short.
    return ("asyncio", {"use_uvloop": True})


@contextlib.asynccontextmanager
async def worker_running(store: Store, dag: DAG) -> AsyncIterator[Worker]:
    """A worker in the test's loop, and a run of ``dag`` started."""
    async with faults.worker_running(store, dag) as worker:
        await faults.start_run(store, dag)
        yield worker


def _dag(dag_id: str, count: int, tmp_path: Path) -> DAG:
    with DAG(dag_id=dag_id) as dag:
        for i in range(count):
            WaitOn(
                task_id=f"w{i}",
                trigger="FlagTrigger",
                trigger_kwargs={
                    "flag": str(tmp_path / "go"),
                    "key": f"k{i}",
                    "journal": str(tmp_path / "starts.log"),
                },
                resumed_journal=str(tmp_path / "resumed.log"),
            )
    return dag


async def _held(store: Store) -> dict[int, int]:
    """Triggers held, by triggerer process id."""
    return {r.pid: r.held for r in await store.list_triggerers()}


async def _all_succeeded(store: Store, dag_id: str, count: int) -> list[TaskInstance]:
    async def done() -> bool:
        tis = await store.list_task_instances(dag_id=dag_id)
        return len(tis) == count and all(ti.state == "success" for ti in tis)

    await wait_until(done, what="every task resumed and succeeded")
    return await store.list_task_instances(dag_id=dag_id)


def _resumed_once_each(tmp_path: Path, tis: list[TaskInstance]) -> None:
    resumed = [int(line[1]) for line in read_journal(tmp_path / "resumed.log")]
    assert sorted(resumed) == sorted(ti.id for ti in tis)


@pytest.mark.parametrize("count", [2, 3])
async def test_triggerers_share_the_triggers_without_double_ownership(
    store: Store, tmp_path: Path, spawn: Spawn, count: int
) -> None:
    capacity = 4
    # One trigger more than any count-1 of them can hold: every triggerer must take a share.
    triggers = capacity * (count - 1) + 2
    dag = _dag("share", triggers, tmp_path)
    async with worker_running(store, dag):
        pids = {spawn(capacity=capacity).pid for _ in range(count)}
        samples: list[dict[int, int]] = []

        async def all_held() -> bool:
            held = await _held(store)
            samples.append(held)
            starts = read_journal(tmp_path / "starts.log")
            return sum(held.values()) == triggers and len(starts) == triggers

        await wait_until(all_held, what=f"{triggers} triggers held by {count} triggerers")
        held = samples[-1]
        assert set(held) == pids
        assert all(0 < n <= capacity for n in held.values())
        assert all(n <= capacity for sample in samples for n in sample.values())
        starts = read_journal(tmp_path / "starts.log")
        # Each trigger ran in exactly one triggerer, and each triggerer ran its share.
        assert sorted(key for _, key, _ in starts) == sorted(f"k{i}" for i in range(triggers))
        ran_in = {int(pid) for _, _, pid in starts}
        assert ran_in == pids
        (tmp_path / "go").touch()
        tis = await _all_succeeded(store, "share", triggers)
    _resumed_once_each(tmp_path, tis)


async def test_a_killed_triggerers_triggers_are_adopted_with_no_loss_and_no_double_resume(
    store: Store, tmp_path: Path, spawn: Spawn
) -> None:
    triggers = 6
    dag = _dag("failover", triggers, tmp_path)
    async with worker_running(store, dag):
        first = spawn(capacity=100, lease_s=1.5)

        async def first_runs_all() -> bool:
            held = await _held(store)
            started = len(read_journal(tmp_path / "starts.log"))
            return held.get(first.pid) == triggers and started == triggers

        await wait_until(first_runs_all, what="the first triggerer running every trigger")
        second = spawn(capacity=100, lease_s=1.5)

        async def second_registered() -> bool:
            return second.pid in await _held(store)

        await wait_until(second_registered)
        first.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(first.wait)

        async def adopted() -> bool:
            held = await _held(store)
            started = len(read_journal(tmp_path / "starts.log"))
            return held == {second.pid: triggers} and started == 2 * triggers

        await wait_until(adopted, what="the survivor adopting every trigger after the lease")
        starts = read_journal(tmp_path / "starts.log")
        by_pid = sorted((int(pid), key) for _, key, pid in starts)
        keys = sorted(f"k{i}" for i in range(triggers))
        assert [k for pid, k in by_pid if pid == first.pid] == keys
        assert [k for pid, k in by_pid if pid == second.pid] == keys
        (tmp_path / "go").touch()
        tis = await _all_succeeded(store, "failover", triggers)
    _resumed_once_each(tmp_path, tis)
    # Every event came from the survivor: the dead one could not have written any.
    assert {decode_value(ti.result)["pid"] for ti in tis} == {second.pid}


async def test_sigterm_releases_the_triggers_at_once(
    store: Store, tmp_path: Path, spawn: Spawn
) -> None:
    triggers = 3
    dag = _dag("release", triggers, tmp_path)
    async with worker_running(store, dag):
        # A lease far longer than any test: only the release can free the triggers.
        proc = spawn(capacity=100, lease_s=600)

        async def holds_all() -> bool:
            return (await _held(store)).get(proc.pid) == triggers

        await wait_until(holds_all)
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(proc.wait, 30) == 0
        assert await store.list_triggerers() == []
        assert await store.count_unowned_triggers() == triggers
