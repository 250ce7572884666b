"""A pool shared by two worker processes: hundreds of tasks in a pool of 3, each writing when
it started and ended; the most that ever ran at once is exactly 3."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.dags.dagbag import DagBag
from engine.store import Store
from engine.testing import run_engine
from tests.helpers import wait_until
from tests.processes import Children, explained

#: Tasks per run, and runs.
TASKS = 100
RUNS = 3

_POOLED_DAG = """
    import os
    import random
    import time
    from engine import DAG
    from operators.python import PythonOperator

    def work(name, run_id):
        started = time.monotonic_ns()  # one clock for every process of the machine
        time.sleep(random.uniform(0.005, 0.02))  # a little work, so that tasks overlap
        ended = time.monotonic_ns()
        line = f"{{run_id}}.{{name}} {{started}} {{ended}} {{os.getpid()}}\\n".encode()
        fd = os.open({marks!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line)  # one append: lines of two processes never interleave
        finally:
            os.close(fd)

    with DAG(dag_id="pooled"):
        for i in range({tasks}):
            PythonOperator(task_id=f"t{{i}}", python_callable=work, pool="three",
                           op_kwargs={{"name": f"t{{i}}"}})
"""


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


def _alive(*procs: subprocess.Popen[bytes]) -> bool:
    return all(p.poll() is None for p in procs)


def _max_overlap(spans: list[tuple[int, int]]) -> int:
    """The most spans open at one instant (at one instant the ends come first: -1 sorts
    before 1)."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    open_now = most = 0
    for _, step in events:
        open_now += step
        most = max(most, open_now)
    return most


def test_max_overlap() -> None:
    assert _max_overlap([(0, 10), (5, 15), (10, 20)]) == 2  # ends at 10 before 10 starts
    assert _max_overlap([(0, 10), (1, 9), (2, 8), (11, 12)]) == 3
    assert _max_overlap([]) == 0


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_two_worker_processes_never_run_more_than_a_pools_slots(
    store: Store, children: Children, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marks = tmp_path / "marks.txt"
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "pooled_dag.py").write_text(
        textwrap.dedent(_POOLED_DAG).format(marks=str(marks), tasks=TASKS)
    )
    children.env["DEFERRAL_DAGS_FOLDER"] = str(dags)
    # A worker the pool holds back looks again this often (a worker is not woken when
    # another frees a slot): the two workers contend for every slot.
    children.env["DEFERRAL_WORKER_POLL_INTERVAL_S"] = "0.05"
    monkeypatch.setattr("sys.path", list(sys.path))  # (DagBag adds the DAGs folder)
    dag = DagBag(dags).get_dag("pooled")
    await store.set_pool("three", 3)

    async with explained(children), run_engine(store, worker=False, triggerer=False) as engine:
        # Two slots each: 3 at once needs both workers, and 4 slots in all would exceed it.
        workers = [children.start("worker", "--slots", "2", name=f"worker{i}") for i in (1, 2)]

        async def both_registered() -> bool:
            return len((await store.fleet()).workers) == 2 or not _alive(*workers)

        await wait_until(both_registered, what="both workers to register")
        assert _alive(*workers), children.output()
        run_ids = [f"run{i}" for i in range(RUNS)]
        for run_id in run_ids:
            await engine.start_run(dag, run_id)
        for run_id in run_ids:
            tis = await engine.finish("pooled", run_id, timeout_s=90)
            assert tis["__run__"]["state"] == "success", children.output()
        assert _alive(*workers), children.output()

    lines = [line.split() for line in marks.read_text().splitlines()]
    assert sorted(name for name, *_ in lines) == sorted(
        f"{run_id}.t{i}" for run_id in run_ids for i in range(TASKS)
    )
    assert len({pid for *_, pid in lines}) == 2  # both workers ran tasks
    spans = [(int(start), int(end)) for _, start, end, _ in lines]
    # (Each span lies inside its task's claim and the write of its end: at most the pool's
    # slots overlap, and with two workers of 2 slots the pool is full at times.)
    assert _max_overlap(spans) == 3
