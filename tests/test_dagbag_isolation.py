"""DAG files that end or hang the process importing them (sys.exit(), KeyboardInterrupt,
os._exit(), a loop that never ends) are import errors naming the file and the cause; the good
files next to them load and run, and a real scheduler on such a folder keeps running and stops
on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from engine.dags.dagbag import DagBag
from engine.store import Store, TaskOutcome
from engine.store.downstream import settle
from engine.testing import run_engine
from tests.helpers import WAIT_S, child_env, wait_until

#: Short, so the looping file costs little; the child's interpreter starts well within it.
TIMEOUT_S = 5.0


@pytest.fixture(autouse=True)
def isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _bad_folder(folder: Path, uid: str) -> dict[str, Path]:
    """A good DAG file next to files that exit, interrupt, end the process and loop forever.
    The looping file appends a line to ``tries.txt`` each time it is imported."""
    sources = {
        "good": f"""
            from engine import DAG
            from operators.python import PythonOperator
            with DAG(dag_id="good_{uid}"):
                PythonOperator(task_id="t", python_callable=lambda: "fine")
        """,
        "exits": "import sys\nsys.exit(3)\n",
        "interrupts": "raise KeyboardInterrupt\n",
        "os_exit": "import os\nos._exit(7)\n",
        "loops": f"""
            with open({str(folder / "tries.txt")!r}, "a") as f:
                f.write("try\\n")
            while True:
                pass
        """,
    }
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for kind, source in sources.items():
        files[kind] = folder / f"{kind}_{uid}.py"
        files[kind].write_text(textwrap.dedent(source))
    return files


def _check_errors(errors: dict[str, str], files: dict[str, Path]) -> None:
    assert set(errors) == {str(files[k]) for k in ("exits", "interrupts", "os_exit", "loops")}
    exits, interrupts = errors[str(files["exits"])], errors[str(files["interrupts"])]
    assert str(files["exits"]) in exits
    assert "sys.exit(3)" in exits
    assert str(files["interrupts"]) in interrupts
    assert "KeyboardInterrupt" in interrupts
    os_exit = errors[str(files["os_exit"])]
    assert str(files["os_exit"]) in os_exit
    assert "exit code 7" in os_exit
    loops = errors[str(files["loops"])]
    assert str(files["loops"]) in loops
    assert "dag_file_processor_timeout_s" in loops


def test_files_that_exit_interrupt_or_hang_are_import_errors(tmp_path: Path) -> None:
    uid = uuid.uuid4().hex[:8]
    files = _bad_folder(tmp_path, uid)
    bag = DagBag(tmp_path, processor_timeout_s=TIMEOUT_S)
    assert set(bag.collect()) == {f"good_{uid}"}
    _check_errors(bag.import_errors, files)
    assert (tmp_path / "tries.txt").read_text() == "try\n"

    # An unchanged file that overran is not tried again (each try would cost the timeout);
    # once it changes, it is.
    assert set(bag.collect()) == {f"good_{uid}"}
    assert (tmp_path / "tries.txt").read_text() == "try\n"
    files["loops"].write_text("x = 1\n")
    stamp = files["loops"].stat().st_mtime + 10
    os.utime(files["loops"], (stamp, stamp))
    bag.collect()
    assert str(files["loops"]) not in bag.import_errors


def test_a_slow_file_holds_up_no_other_file(tmp_path: Path) -> None:
    # Its import goes on in its own child while the files after it are checked; the bag waits
    # for it only when asked to (collect()) or when a DAG is not found without it.
    uid = uuid.uuid4().hex[:8]
    release, tries = tmp_path / "release", tmp_path / "tries.txt"
    (tmp_path / f"a_slow_{uid}.py").write_text(
        textwrap.dedent(f"""
            import os, time
            from engine import DAG
            from operators.python import PythonOperator
            with open({str(tries)!r}, "a") as f:
                f.write("try\\n")
            while not os.path.exists({str(release)!r}):
                time.sleep(0.02)
            with DAG(dag_id="slow_{uid}"):
                PythonOperator(task_id="t", python_callable=print)
        """)
    )
    (tmp_path / f"b_good_{uid}.py").write_text(
        textwrap.dedent(f"""
            from engine import DAG
            from operators.python import PythonOperator
            with DAG(dag_id="good_{uid}"):
                PythonOperator(task_id="t", python_callable=print)
        """)
    )
    bag = DagBag(tmp_path, processor_timeout_s=WAIT_S)
    assert set(bag.collect(wait_slow=False)) == {f"good_{uid}"}
    assert bag.slow_imports == [tmp_path / f"a_slow_{uid}.py"]
    assert bag.get_dag(f"good_{uid}").dag_id == f"good_{uid}"
    assert set(bag.collect(wait_slow=False)) == {f"good_{uid}"}
    assert tries.read_text() == "try\n"  # still the first import: not started again
    assert bag.import_errors == {}

    release.write_text("")
    assert bag.get_dag(f"slow_{uid}").dag_id == f"slow_{uid}"  # waited for, then loaded
    assert bag.slow_imports == []
    assert set(bag.collect(wait_slow=False)) == {f"good_{uid}", f"slow_{uid}"}


def test_a_file_that_exits_only_on_its_second_import_is_an_import_error(tmp_path: Path) -> None:
    """The child's import succeeds, the in-process one calls sys.exit(): caught as well."""
    marker = tmp_path / "imported-once"
    file = tmp_path / f"second_{uuid.uuid4().hex[:8]}.py"
    file.write_text(
        textwrap.dedent(f"""
            import os, sys
            if os.path.exists({str(marker)!r}):
                sys.exit("second time")
            open({str(marker)!r}, "w").close()
        """)
    )
    bag = DagBag(tmp_path, processor_timeout_s=TIMEOUT_S)
    assert bag.collect() == {}
    assert "second time" in bag.import_errors[str(file)]


@pytest.mark.anyio
async def test_the_good_dag_next_to_bad_files_runs(store: Store, tmp_path: Path) -> None:
    uid = uuid.uuid4().hex[:8]
    files = _bad_folder(tmp_path / "dags", uid)
    bag = DagBag(tmp_path / "dags", processor_timeout_s=TIMEOUT_S)
    dags = await anyio.to_thread.run_sync(bag.collect)
    _check_errors(bag.import_errors, files)
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dags[f"good_{uid}"])
    assert tis["__run__"]["state"] == "success"


def _start_scheduler(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "engine", "scheduler"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.mark.subprocess
@pytest.mark.anyio
async def test_a_scheduler_on_a_folder_of_bad_files_keeps_running_and_stops_on_sigterm(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    uid = uuid.uuid4().hex[:8]
    dags = tmp_path / "dags"
    files = _bad_folder(dags, uid)
    env = child_env(
        DATABASE_URL=db_url,
        HOME=str(tmp_path / "home"),
        DAGS_FOLDER=str(dags),
        DAG_FILE_PROCESSOR_TIMEOUT_S=str(TIMEOUT_S),
        SCHEDULER_INTERVAL_S="0.2",
    )
    log = tmp_path / "scheduler.log"
    proc = _start_scheduler(env, log)
    try:

        async def synced() -> bool:
            assert proc.poll() is None, log.read_text()
            return f"good_{uid}" in {d.dag_id for d in await store.list_dags()}

        await wait_until(synced, what="the scheduler to record the good DAG")
        # Its loop goes on: acting as the worker here, the test ends the good DAG's task, and
        # the scheduler ends the run.
        await store.create_dag_run(f"good_{uid}", "r1", logical_date=await store.now())
        worker = await store.register_worker("test", 1, 1)
        (ti,) = (await store.claim_tasks(worker, 1)).claimed
        outcome = TaskOutcome(ti_id=ti.id, worker_id=worker, try_number=1, kind="success")
        finished = await store.finish_tasks([outcome])
        assert finished
        await settle(store, finished)

        async def run_ended() -> bool:
            assert proc.poll() is None, log.read_text()
            run = await store.get_dag_run(f"good_{uid}", "r1")
            return run is not None and run.state == "success"

        await wait_until(run_ended, what="the scheduler to end the run")
        proc.send_signal(signal.SIGTERM)
        code = await anyio.to_thread.run_sync(proc.wait, WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert code == 0, text
    for kind in ("exits", "interrupts", "os_exit", "loops"):
        assert str(files[kind]) in text, kind
    assert "dag_file_processor_timeout_s" in text
