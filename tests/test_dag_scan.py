"""The scheduler scans its DAGs folder beside its loop: a DAG file that hangs at import holds
up no scheduling pass (runs still end, readiness holds), and a folder of big unchanged DAGs is
imported and written once, not at every rescan."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import psutil
import pytest

from engine.dags.dagbag import DagBag
from engine.scheduler.dagsync import request_rescan, sync_dags
from engine.scheduler.scheduler import Scheduler
from engine.security.keys import Keyring
from engine.store import Store
from tests.conftest import TEST_FERNET_KEY
from tests.helpers import WAIT_S, free_port, wait_until
from tests.processes import Children, explained

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})  # (as the engine's processes run)


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


# -- a file that hangs at import -------------------------------------------------------------

_CANARY = """
    from engine import DAG
    from operators.python import PythonOperator

    with DAG("canary"):
        PythonOperator(task_id="sing", python_callable=lambda: "tweet")
"""

# Imports at once, until the test puts the block marker down: then the import waits for the
# release marker (the hang is the fault under test, not a wait of the test's).
_SLOW = """
    import os
    import time
    from engine import DAG
    from operators.python import PythonOperator

    if os.path.exists({block!r}):
        with open({started!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        while not os.path.exists({release!r}):
            time.sleep(0.02)

    with DAG("slow"):
        PythonOperator(task_id={task_id!r}, python_callable=lambda: 1)
"""


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], env=env, capture_output=True, timeout=60
    )


@pytest.mark.subprocess
@pytest.mark.parametrize("when", ["on_change", "at_start"])
async def test_a_dag_file_hanging_at_import_holds_up_no_scheduling_pass(
    store: Store, children: Children, tmp_path: Path, when: str
) -> None:
    # The slow file hangs when it changes under a running scheduler (on_change: its scan
    # re-imports it) or from the first scan on (at_start). Meanwhile runs of other DAGs run and
    # end, a new DAG file is found when `dags trigger` asks for it, and /readyz stays ready.
    dags = tmp_path / "dags"
    dags.mkdir()
    block, started, release = (tmp_path / n for n in ("block", "started", "release"))
    slow = dags / "a_slow.py"  # first in the folder's order: scanned before the canary

    def write_slow(task_id: str) -> None:
        source = _SLOW.format(
            block=str(block), started=str(started), release=str(release), task_id=task_id
        )
        slow.write_text(textwrap.dedent(source))

    if when == "at_start":
        block.write_text("")
        write_slow("after")
    else:
        write_slow("before")
    (dags / "canary.py").write_text(textwrap.dedent(_CANARY))
    port = free_port()
    children.env.update(
        DEFERRAL_DAGS_FOLDER=str(dags),
        DEFERRAL_DAG_RESCAN_INTERVAL_S="0.2",
        DEFERRAL_DAG_FILE_PROCESSOR_TIMEOUT_S="600",  # the hang must not end by itself
    )
    # (The CLI without the folder: it asks the scheduler, as on a machine without the files.)
    cli_env = {k: v for k, v in children.env.items() if k != "DEFERRAL_DAGS_FOLDER"}
    readyz = f"http://127.0.0.1:{port}/readyz"

    async def slow_tasks() -> list[str]:
        dag = await store.get_dag("slow")
        return [] if dag is None else [t["task_id"] for t in dag.tasks]

    async def known(dag_id: str) -> bool:
        return await store.get_dag(dag_id) is not None

    async def run_state(dag_id: str, run_id: str) -> str | None:
        run = await store.get_dag_run(dag_id, run_id)
        return None if run is None else run.state

    async with explained(children):
        children.start("scheduler", "--metrics-port", str(port), name="scheduler")
        children.start("worker", name="worker")
        await wait_until(lambda: known("canary"), what="the first scan")
        if when == "on_change":

            async def recorded_before() -> bool:
                return await slow_tasks() == ["before"]

            await wait_until(recorded_before, what="the first scan")
            block.write_text("")
            write_slow("after")  # changed: the next scan imports it, and hangs there

        async def hanging() -> bool:
            return started.exists()

        await wait_until(hanging, what="the scheduler's scan to hang in the slow file")
        answers: list[int] = []

        async def ended_while_ready(dag_id: str, run_id: str) -> bool:
            answers.append(await anyio.to_thread.run_sync(_get, readyz))
            return await run_state(dag_id, run_id) not in (None, "running", "queued")

        trigger = await anyio.to_thread.run_sync(
            lambda: _cli(cli_env, "dags", "trigger", "canary", "--run-id", "c1")
        )
        assert trigger.returncode == 0, trigger.stderr.decode()
        # Before the fix the scan ran in the loop's pass: the run's end waited for the import
        # (and /readyz failed once the pass was 15 s late).
        await wait_until(lambda: ended_while_ready("canary", "c1"), what="the canary run")
        assert await run_state("canary", "c1") == "success"

        # A new file, asked for by `dags trigger`: the rescan it asks for does not wait for the
        # slow file either.
        (dags / "canary2.py").write_text(textwrap.dedent(_CANARY).replace("canary", "canary2"))
        trigger = await anyio.to_thread.run_sync(
            lambda: _cli(cli_env, "dags", "trigger", "canary2", "--run-id", "c2")
        )
        assert trigger.returncode == 0, trigger.stderr.decode()
        await wait_until(lambda: ended_while_ready("canary2", "c2"), what="the second canary")
        assert await run_state("canary2", "c2") == "success"
        assert answers
        assert set(answers) == {200}, answers
        assert not release.exists()
        assert await slow_tasks() == ([] if when == "at_start" else ["before"])  # still hanging

        release.write_text("")

        async def recorded_after() -> bool:
            return await slow_tasks() == ["after"]

        await wait_until(recorded_after, what="the slow file to be recorded")


async def test_a_dag_whose_file_is_slow_to_import_stays_active(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A scheduler (re)started while the file hangs at import: the scan that does not wait for
    # it must not take it for a file gone (no more scheduled runs of its DAG).
    monkeypatch.setattr(sys, "path", list(sys.path))
    dags = tmp_path / "dags"
    dags.mkdir()
    block, started, release = (tmp_path / n for n in ("block", "started", "release"))
    slow = dags / "a_slow.py"

    def write_slow(task_id: str) -> None:
        source = _SLOW.format(
            block=str(block), started=str(started), release=str(release), task_id=task_id
        )
        slow.write_text(textwrap.dedent(source))

    write_slow("before")
    running = DagBag(dags)  # a worker's, say
    await sync_dags(store, running)
    block.write_text("")
    write_slow("after")
    bag = DagBag(dags, processor_timeout_s=600)  # a scheduler started now
    await sync_dags(store, bag, wait_slow=False)
    assert bag.slow_imports == [slow]
    assert [(d.dag_id, d.is_active) for d in await store.list_dags()] == [("slow", True)]

    # The worker's bag, which loaded the file before it changed, hands its import off too, but
    # to run the DAG it waits for the file's new code.
    running.collect(wait_slow=False)
    assert running.slow_imports == [slow]
    release.write_text("")
    assert list(running.get_dag("slow").tasks) == ["after"]


async def test_a_scheduler_stopped_mid_scan_ends_the_import_and_blames_no_file(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """stop() while the scan waits for a file importing in its child: the child ends with the
    scan, and that is no import error of the file (the scan's thread, which nobody waits for
    any more, logged one: 'ended the process that imported it (exit code -9)', the child
    killed at the process's exit). The next scan imports the file as if never tried."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    dags = tmp_path / "dags"
    dags.mkdir()
    block, started, release = (tmp_path / n for n in ("block", "started", "release"))
    block.write_text("")
    source = _SLOW.format(block=str(block), started=str(started), release=str(release), task_id="t")
    (dags / "a_slow.py").write_text(textwrap.dedent(source))
    bag = DagBag(dags, processor_timeout_s=600)
    scheduler = Scheduler(store, bag, interval_s=0.05, dag_rescan_interval_s=3600)
    try:
        with caplog.at_level(logging.INFO, logger="engine"), anyio.fail_after(WAIT_S):
            async with anyio.create_task_group() as tg:
                await tg.start(scheduler.run)

                async def importing() -> bool:
                    return started.exists() and started.read_text().endswith("\n")

                await wait_until(importing, what="the scan's child to import the slow file")
                child = psutil.Process(int(started.read_text()))
                scheduler.stop()

            async def scan_over() -> bool:  # (the scan's thread, once its child ended)
                return not child.is_running() and not any(
                    t.name == "dag-scan" for t in threading.enumerate()
                )

            await wait_until(scan_over, what="the scan's child and thread to end")
        assert not bag.import_errors
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        assert not await store.import_errors()
    finally:
        release.write_text("")
    # Not taken for a failure (or an overrun): the next scan imports the file.
    assert list(bag.collect()) == ["slow"]


async def test_a_dag_the_database_refuses_is_logged_and_the_others_are_recorded(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A NUL in a description: PostgreSQL refuses the text. The scan went down with it (and
    # with it the scheduler's loop); the scan is now beside the loop and must go on too.
    monkeypatch.setattr(sys, "path", list(sys.path))
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "a_bad.py").write_text(
        textwrap.dedent(_CANARY).replace('"canary"', '"bad", description="a\\x00b"')
    )
    (dags / "b_good.py").write_text(textwrap.dedent(_CANARY))
    scheduler = Scheduler(store, DagBag(dags), interval_s=0.05, dag_rescan_interval_s=3600)
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)

        async def recorded() -> bool:
            return [d.dag_id for d in await store.list_dags()] == ["canary"]

        await wait_until(recorded, what="the good DAG to be recorded")
        assert await request_rescan(store)  # the scan goes on
        passes = scheduler.housekeeping_passes

        async def passing() -> bool:
            return scheduler.housekeeping_passes > passes

        await wait_until(passing, what="the scheduling loop to go on")
        scheduler.stop()
    assert scheduler.recorder.refused >= 2  # refused at each scan (a rescan may come twice)
    assert "DAG bad" in caplog.text
    assert "cannot be recorded" in caplog.text


# -- big DAGs, unchanged ---------------------------------------------------------------------

_CHAIN = """
    from engine import DAG
    from operators.python import PythonOperator

    with DAG("chain_5000"):
        previous = None
        for i in range(5000):
            task = PythonOperator(task_id=f"t{i}", python_callable=print)
            if previous is not None:
                previous >> task
            previous = task
"""

_WIDE = """
    from engine import DAG
    from operators.python import PythonOperator

    with DAG("wide_5000"):
        start = PythonOperator(task_id="start", python_callable=print)
        for i in range({width}):
            start >> PythonOperator(task_id=f"t{{i}}", python_callable=print)
"""


class _Statements:
    """The statements the store's connections sent (asyncpg's query logger)."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    def attach(self, conn: asyncpg.Connection) -> None:
        conn.add_query_logger(lambda record: self.queries.append(record.query))

    def count(self, marker: str) -> int:
        return sum(marker in q for q in self.queries)


async def test_a_folder_of_big_unchanged_dags_is_imported_and_written_once(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "chain_5000.py").write_text(textwrap.dedent(_CHAIN))
    wide = dags / "wide_5000.py"
    wide.write_text(textwrap.dedent(_WIDE.format(width=4999)))
    statements = _Statements()
    upserts = "INSERT INTO deferral_dags"
    store = await Store.connect(
        db_url, pool_size=4, keyring=Keyring([TEST_FERNET_KEY]), on_connect=statements.attach
    )
    bag = DagBag(dags, processor_timeout_s=120)
    scheduler = Scheduler(store, bag, dag_rescan_interval_s=3600)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(scheduler.run)

            async def recorded() -> bool:
                return {d.dag_id for d in await store.list_dags()} == {"chain_5000", "wide_5000"}

            await wait_until(recorded, timeout_s=120, what="the first scan")
            first = statements.count(upserts)
            assert first == 2
            for _ in range(3):
                assert await request_rescan(store)
            # Before the fix every rescan serialized both DAGs again (17 s of CPU for the
            # chain's priorities) and sent them whole for the database to compare.
            assert statements.count(upserts) == first
            assert (bag.imports, scheduler.recorder.serialized, scheduler.recorder.written) == (
                2,
                2,
                2,
            )

            # A rewrite with the same bytes: neither imported nor written again.
            wide.write_text(textwrap.dedent(_WIDE.format(width=4999)))
            assert await request_rescan(store)
            assert (bag.imports, bag.unchanged_rewrites, statements.count(upserts)) == (2, 1, 2)

            # A changed file: that file alone is imported, its DAG alone written.
            wide.write_text(textwrap.dedent(_WIDE.format(width=4998)))
            assert await request_rescan(store)
            assert (bag.imports, scheduler.recorder.serialized, statements.count(upserts)) == (
                3,
                3,
                3,
            )
            dag = await store.get_dag("wide_5000")
            assert dag is not None
            assert len(dag.tasks) == 4999
            scheduler.stop()
    finally:
        await store.close()


async def test_a_dag_row_changed_behind_the_schedulers_back_is_written_again(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The hash decides, not what this process remembers: a row another writer changed (an
    # older scheduler, a restored database) is written again at the next scan.
    monkeypatch.setattr(sys, "path", list(sys.path))
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "wide.py").write_text(textwrap.dedent(_WIDE.format(width=3)))
    bag = DagBag(dags)
    scheduler = Scheduler(store, bag, dag_rescan_interval_s=3600)
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)

        async def tasks() -> int:
            dag = await store.get_dag("wide_5000")
            return -1 if dag is None else len(dag.tasks)

        async def recorded(n: int) -> Any:
            return await tasks() == n

        await wait_until(lambda: recorded(4), what="the first scan")
        await store.upsert_dag("wide_5000", str(dags / "wide.py"), [], None)
        assert await tasks() == 0
        assert await request_rescan(store)
        assert await tasks() == 4
        assert (bag.imports, scheduler.recorder.serialized) == (1, 2)
        scheduler.stop()
