"""A worker imports DAG files off its loop and once: at its start, and again for a try whose
file changed, with the tries that come meanwhile waiting for that one import.

A worker that has not imported a DAG when a burst of its tries arrives makes every try of the
burst wait for the import, each holding its pool's slot: a fleet's first due resumes on a
worker that ran none of its deferrals (docs/benchmarks.md, batched deferrals).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import asyncpg
import pytest

from engine.dags.dag import DAG
from engine.dags.dagbag import DagBag
from engine.store import Store
from engine.worker.attempt import Attempts
from engine.worker.trylogs import TryLogs
from tests.helpers import wait_until
from tests.processes import Children

pytestmark = [pytest.mark.anyio]

DAG_FILE = """
import os
from engine import DAG
from operators.python import PythonOperator

with open({marker!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")

with DAG(dag_id="imported") as dag:
    PythonOperator(task_id="t", python_callable=lambda: None)
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class CountingBag(DagBag):
    """Counts the loads the worker runs in a thread (``get_dag`` off the loop; ``get_task``
    calls it on the loop too, for a DAG loaded already)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.loads = 0
        self._count_lock = threading.Lock()

    def get_dag(self, dag_id: str) -> DAG:
        if threading.current_thread() is not threading.main_thread():
            with self._count_lock:
                self.loads += 1
        return super().get_dag(dag_id)


async def test_tries_that_wait_for_an_import_do_not_each_load_the_dag_again(
    store: Store, tmp_path: Path
) -> None:
    (tmp_path / "imported.py").write_text(DAG_FILE.format(marker=str(tmp_path / "marker")))
    bag = CountingBag(tmp_path)
    attempts = Attempts(
        store,
        bag,
        TryLogs(store),
        slots=10,
        default_deferrable=False,
        kill_grace_s=1.0,
        stopping={},
        freed=lambda _stopped: None,
        xcom_max_bytes=1 << 20,
    )
    tries: list[Any] = [SimpleNamespace(dag_id="imported", task_id="t") for _ in range(5)]
    ops: list[Any] = []

    async def operator(ti: Any) -> None:
        ops.append(await attempts._operator(ti))

    async with anyio.create_task_group() as tg:
        for ti in tries:
            tg.start_soon(operator, ti)
    assert len(ops) == 5
    assert all(op.task_id == "t" for op in ops)
    # One import for the five tries that came before the DAG was loaded.
    assert bag.loads == 1


@pytest.mark.subprocess
async def test_a_worker_imports_its_dags_folder_before_it_claims(
    db_url: str, children: Children, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    marker = tmp_path / "marker"
    (dags / "imported.py").write_text(DAG_FILE.format(marker=str(marker)))
    children.env["DEFERRAL_DAGS_FOLDER"] = str(dags)
    conn = await asyncpg.connect(db_url)
    try:
        children.start("worker", name="worker")

        async def registered() -> int | None:
            pid: int | None = await conn.fetchval("SELECT pid FROM deferral_workers LIMIT 1")
            return pid

        await wait_until(registered, what="the worker registered")
        pid = await registered()
    finally:
        await conn.close()
    # Imported in the worker's own process (its child parse writes another pid), before it
    # registered: no task of it was ever claimed.
    assert marker.exists(), "the worker registered without importing its DAGs folder"
    assert str(pid) in marker.read_text().split(), marker.read_text()


async def _imported_and_counted(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, CountingBag, Attempts, Any, list[str]]:
    """A DAG file imported once by a worker's Attempts, then every stat() of a DAG file
    counted: (its path, the bag, the attempts, a try of its task, the stats so far)."""
    from engine.dags import dagbag as dagbag_module

    path = tmp_path / "imported.py"
    path.write_text(DAG_FILE.format(marker=str(tmp_path / "marker")))
    bag = CountingBag(tmp_path)
    attempts = Attempts(
        store,
        bag,
        TryLogs(store),
        slots=10,
        default_deferrable=False,
        kill_grace_s=1.0,
        stopping={},
        freed=lambda _stopped: None,
        xcom_max_bytes=1 << 20,
    )
    ti: Any = SimpleNamespace(dag_id="imported", task_id="t")
    await attempts._operator(ti)  # (the first import)
    stats: list[str] = []
    real_stat = dagbag_module.file_stat

    def counted(path: Any) -> Any:
        stats.append(str(path))
        return real_stat(path)

    monkeypatch.setattr(dagbag_module, "file_stat", counted)
    return path, bag, attempts, ti, stats


async def test_a_try_looks_at_its_dag_file_once_and_sees_it_changed(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A try of a loaded DAG costs one stat() of its file (it ran two: the check and the
    lookup); a file changed since is imported again, and the try gets its new task."""
    path, bag, attempts, ti, stats = await _imported_and_counted(store, tmp_path, monkeypatch)
    op = await attempts._operator(ti)
    assert op.task_id == "t"
    assert stats == [str(path)]
    path.write_text(
        DAG_FILE.format(marker=str(tmp_path / "marker")).replace(
            'task_id="t"', 'task_id="t", retries=7'
        )
    )
    changed = await attempts._operator(ti)
    assert changed.retries == 7
    assert bag.loads == 2


async def test_the_tries_of_one_claim_share_one_stat_and_a_later_claim_sees_an_edit(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tries claimed together (one ``claimed_at``) look at their DAG file once between them;
    a try of a claim whose reply came after the file was saved looks again and runs the new
    code."""
    path, bag, attempts, ti, stats = await _imported_and_counted(store, tmp_path, monkeypatch)
    claimed_at = time.monotonic()
    for _ in range(3):
        assert (await attempts._operator(ti, claimed_at)).task_id == "t"
    assert stats == [str(path)]

    path.write_text(
        DAG_FILE.format(marker=str(tmp_path / "marker")).replace(
            'task_id="t"', 'task_id="t", retries=7'
        )
    )
    changed = await attempts._operator(ti, time.monotonic())
    assert changed.retries == 7
    assert bag.loads == 2
