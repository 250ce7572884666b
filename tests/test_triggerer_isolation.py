"""Whatever trigger code raises fails that trigger's tasks and nothing else, in a real
``python -m engine triggerer`` process: SystemExit, KeyboardInterrupt, GeneratorExit, a
CancelledError of its own, a cleanup() that raises, a run() that is no async generator, a
bare TaskEndEvent. The process stays up and the normal trigger beside them still fires."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from engine import DAG
from engine.store import Store
from tests.helpers import wait_until
from tests.triggerer_faults import Spawn, WaitFor, spawn, start_run, tis_of, worker_running
from tests.triggerer_support import read_journal

pytestmark = [pytest.mark.anyio, pytest.mark.subprocess]

__all__ = ["spawn"]  # the fixture

#: Task id -> what its trigger does, and what the task's error must say.
BAD = {
    "exit": ("SystemExit", "SystemExit: 3"),
    "cancel": ("CancelledError", "CancelledError"),
    "interrupt": ("KeyboardInterrupt", "KeyboardInterrupt"),
    "genexit": ("GeneratorExit", "GeneratorExit"),
    "bare_end": ("bare TaskEndEvent", "yielded a bare TaskEndEvent"),
    "child_exit": ("child SystemExit", "raised SystemExit: 5"),
}


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})  # the triggerer runs in its own process


def _dag(tmp_path: Path, dag_id: str) -> DAG:
    with DAG(dag_id=dag_id) as dag:
        for task_id, (how, _error) in BAD.items():
            WaitFor(task_id=task_id, trigger="Misbehaving", trigger_kwargs={"how": how})
        WaitFor(task_id="not_a_generator", trigger="NotAGenerator")
        # Fires, then its cleanup() raises SystemExit: the task resumes all the same.
        WaitFor(
            task_id="cleanup_exit",
            trigger="Misbehaving",
            trigger_kwargs={"how": "cleanup SystemExit"},
            resumed_journal=str(tmp_path / "resumed.log"),
        )
        WaitFor(
            task_id="normal",
            trigger="FlagThenDelay",
            trigger_kwargs={"flag": str(tmp_path / "go"), "key": "normal"},
            resumed_journal=str(tmp_path / "resumed.log"),
        )
    return dag


async def test_trigger_code_raising_anything_fails_only_its_own_tasks(
    store: Store, tmp_path: Path, spawn: Spawn
) -> None:
    dag = _dag(tmp_path, "isolation")
    proc = spawn()
    async with worker_running(store, dag):
        await start_run(store, dag)

        async def bad_ones_ended() -> bool:
            tis = await tis_of(store, "isolation")
            ended = [t for t in (*BAD, "not_a_generator") if tis[t].state == "failed"]
            return len(ended) == len(BAD) + 1 and tis["cleanup_exit"].state == "success"

        await wait_until(bad_ones_ended, what="every misbehaving trigger's task to end")
        assert proc.poll() is None, "the triggerer process ended"
        tis = await tis_of(store, "isolation")
        for task_id, (how, error) in BAD.items():
            assert error in tis[task_id].error, (task_id, how, tis[task_id].error)
        assert "must be an async generator" in tis["not_a_generator"].error
        assert tis["normal"].state == "deferred"

        # The triggerer is still running triggers: the normal one fires when told to.
        (tmp_path / "go").touch()

        async def normal_resumed() -> bool:
            return (await tis_of(store, "isolation"))["normal"].state == "success"

        await wait_until(normal_resumed, what="the normal trigger to fire and its task resume")
    assert proc.poll() is None, "the triggerer process ended"
    resumed = sorted(int(line[1]) for line in read_journal(tmp_path / "resumed.log"))
    assert resumed == sorted([tis["cleanup_exit"].id, tis["normal"].id])
    proc.terminate()
    assert await anyio.to_thread.run_sync(proc.wait, 30) == 0
