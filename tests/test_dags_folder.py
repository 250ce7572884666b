"""The DAGs folder as users meet it: processes that need one refuse to start without it, files
named like the engine's packages are reported by name, an import error is logged once per
change of its file, and ``dags trigger`` explains an unknown DAG (or gets a running scheduler
to find a new one) instead of telling to pass a ``--dags`` that was passed.

Real processes on the test database; the scheduler's rescan interval is a setting, so a test
sees several rescans without waiting ten seconds for each."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from click.testing import CliRunner

from engine.cli import cli
from engine.config import ConfigError, Settings, load_settings
from engine.dags.dagbag import DagBag
from engine.store import Store
from tests.helpers import REPO_ROOT, child_env, wait_until
from tests.processes import Children, explained
from tests.processes import process_env as _env
from triggers.base import ImportPathError, import_object

_GOOD_DAG = """
    from engine import DAG
    from operators.python import PythonOperator

    with DAG(dag_id={dag_id!r}):
        PythonOperator(task_id="t", python_callable=lambda: 1)
"""

_mtime_step = 0


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # The loops under test run in the child processes; the test's own loop only watches.
    return ("asyncio", {"use_uvloop": True})


def write(path: Path, source: str) -> Path:
    """Write a file with a modification time no earlier write had (a rewrite within the same
    second still counts as a change)."""
    global _mtime_step
    _mtime_step += 10
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    stamp = path.stat().st_mtime + _mtime_step
    os.utime(path, (stamp, stamp))
    return path


@pytest.fixture
def isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The test's DAGs folder leaves sys.path, and its modules sys.modules, afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _run_cli(
    env: dict[str, str], *args: str, cwd: Path, timeout_s: float = 60.0
) -> tuple[int, str]:
    """``python -m engine ARGS`` in its own process group; a command still running after
    ``timeout_s`` (it started instead of refusing) is killed with its children and fails."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"deferral {' '.join(args)} kept running:\n{out.decode(errors='replace')}")
    return proc.returncode, out.decode(errors="replace")


# -- item 3: a DAGs folder is required -------------------------------------------------------


@pytest.mark.subprocess
@pytest.mark.parametrize("command", ["scheduler", "worker", "standalone"])
def test_a_process_that_needs_dags_refuses_to_start_without_a_folder(
    db_url: str, tmp_path: Path, command: str
) -> None:
    env = child_env(DATABASE_URL=db_url, HOME=str(tmp_path / "home"))
    code, out = _run_cli(env, command, cwd=tmp_path)
    assert code == 2, out
    assert "--dags" in out, out
    assert "DEFERRAL_DAGS_FOLDER" in out, out
    assert "Traceback" not in out, out


@pytest.mark.subprocess
def test_a_dags_folder_from_the_config_file_that_does_not_exist_is_refused(
    db_url: str, tmp_path: Path
) -> None:
    (tmp_path / "deferral.toml").write_text('[deferral]\ndags_folder = "no_such_folder"\n')
    env = child_env(DATABASE_URL=db_url, HOME=str(tmp_path / "home"))
    code, out = _run_cli(env, "worker", cwd=tmp_path)
    assert code == 2, out
    assert "no_such_folder" in out, out
    assert "cannot use the database" not in out, out


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_triggerer_without_a_dags_folder_warns_and_still_runs(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    children = Children(_env(db_url, tmp_path), logs)
    try:
        async with explained(children):
            proc = children.start("triggerer", name="triggerer")

            async def registered() -> bool:
                return bool(await store.list_triggerers())

            await wait_until(registered, what="the triggerer to register")
            log = (logs / "triggerer.log").read_text()
            assert "no DAGs folder" in log
            assert "DEFERRAL_DAGS_FOLDER" in log
            # Every line names its process, the ones written before the triggerer starts too.
            warning = next(line for line in log.splitlines() if "no DAGs folder" in line)
            assert f"triggerer[{proc.pid}]" in warning, warning
            proc.send_signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(proc.wait, 30.0) == 0
    finally:
        children.stop_all()


def test_a_trigger_module_that_is_not_found_names_the_dags_folder_setting() -> None:
    with pytest.raises(ImportPathError, match="DEFERRAL_DAGS_FOLDER"):
        import_object("no_such_dag_module_q7.MyTrigger", "trigger classpath")


# -- item 4: names the engine's packages (and the standard library) own -----------------------


@pytest.mark.usefixtures("isolated_imports")
def test_files_named_like_engine_packages_are_reported_and_the_others_load(
    tmp_path: Path,
) -> None:
    write(tmp_path / "triggers.py", "class MyTrigger: ...\n")
    write(tmp_path / "engine.py", "x = 1\n")
    write(tmp_path / "operators" / "__init__.py", "")
    write(tmp_path / "operators" / "custom.py", _GOOD_DAG.format(dag_id="in_operators"))
    write(tmp_path / "json.py", "x = 1\n")
    write(tmp_path / "orders.py", _GOOD_DAG.format(dag_id="orders"))

    bag = DagBag(tmp_path)
    dags = bag.collect()

    assert set(dags) == {"orders"}, dict(bag.import_errors)
    errors = dict(bag.import_errors)
    assert set(errors) == {
        str(tmp_path / "triggers.py"),
        str(tmp_path / "engine.py"),
        str(tmp_path / "operators"),
        str(tmp_path / "json.py"),
    }
    assert "engine's own package 'triggers'" in errors[str(tmp_path / "triggers.py")]
    assert "rename it" in errors[str(tmp_path / "triggers.py")]
    assert "my_triggers.py" in errors[str(tmp_path / "triggers.py")]
    assert "my_operators" in errors[str(tmp_path / "operators")]
    assert "standard library" in errors[str(tmp_path / "json.py")]
    # The engine's packages and the standard library's module are still what they were.
    for name in ("triggers", "engine", "operators"):
        assert Path(sys.modules[name].__file__ or "").is_relative_to(REPO_ROOT), name
    assert not Path(sys.modules["json"].__file__ or "").is_relative_to(tmp_path)

    # Renamed as told, the file loads.
    (tmp_path / "operators" / "custom.py").unlink()
    write(tmp_path / "my_custom.py", _GOOD_DAG.format(dag_id="in_operators"))
    assert "in_operators" in bag.collect()


# -- item 5: import errors once per change; dags trigger -------------------------------------


@pytest.mark.usefixtures("isolated_imports")
def test_an_import_error_is_logged_once_per_change_of_its_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="engine.dags.dagbag")
    broken = write(tmp_path / "broken.py", "def (:\n")
    bag = DagBag(tmp_path)

    def errors() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.levelno >= logging.ERROR and "broken" in r.getMessage()
        ]

    for _ in range(3):
        bag.collect()
    assert len(errors()) == 1, errors()
    first = errors()[0].splitlines()
    assert (
        first[0]
        == f"DAG file {broken} failed to import: SyntaxError: invalid syntax (at {broken}:1)"
    )
    assert any(line.startswith("Traceback") for line in first[1:])
    assert bag.newly_reported == ()

    write(broken, "raise RuntimeError('still broken')\n")
    bag.collect()
    bag.collect()
    assert len(errors()) == 2, errors()
    assert "RuntimeError: still broken" in errors()[1].splitlines()[0]

    write(broken, _GOOD_DAG.format(dag_id="fixed"))
    assert "fixed" in bag.collect()
    write(broken, "def (:\n")  # broken again as the first time: reported again
    bag.collect()
    assert len(errors()) == 3, errors()


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_scheduler_logs_a_broken_file_once_per_change_and_the_next_rescan(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    write(dags / "good.py", _GOOD_DAG.format(dag_id="good"))
    broken = write(dags / "broken.py", "def (:\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    env = _env(db_url, tmp_path, dags)
    env.update(DEFERRAL_DAG_RESCAN_INTERVAL_S="0.2", DEFERRAL_LOG_LEVEL="DEBUG")
    children = Children(env, logs)
    log_file = logs / "scheduler.log"

    def still_failing() -> int:
        return log_file.read_text().count(f"DAG file {broken} still fails to import")

    try:
        async with explained(children):
            children.start("scheduler", name="scheduler")

            async def rescanned(times: int) -> bool:
                return still_failing() >= times

            await wait_until(lambda: rescanned(3), what="three rescans of the broken file")
            log = log_file.read_text()
            assert log.count(f"DAG file {broken} failed to import: SyntaxError") == 1, log
            assert log.count("Traceback (most recent call last)") == 1, log
            assert "next scan in 0.2 s (setting dag_rescan_interval_s)" in log, log
            assert any(d.dag_id == "good" for d in await store.list_dags())

            write(broken, "raise RuntimeError('changed error')\n")
            seen = still_failing()

            async def reported_again() -> bool:
                return still_failing() >= seen + 3

            await wait_until(reported_again, what="three rescans of the changed file")
            log = log_file.read_text()
            assert log.count(f"DAG file {broken} failed to import: RuntimeError") == 1, log
            assert log.count("Traceback (most recent call last)") == 2, log
    finally:
        children.stop_all()


def _invoke(db_url: str, *args: str, dags: Path | None = None) -> tuple[int, str]:
    env: dict[str, str | None] = {"DEFERRAL_DATABASE_URL": db_url, "DEFERRAL_DAGS_FOLDER": None}
    result = CliRunner().invoke(cli, [*args, *(["--dags", str(dags)] if dags else [])], env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


@pytest.mark.usefixtures("isolated_imports")
def test_an_import_error_traceback_shows_the_dag_files_frames_not_the_engines(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """A syntax error's traceback was a screen of dagparse.py, importlib and <frozen ...>
    frames; it shows the file, its line and the caret, and a runtime error the DAG files'
    frames only."""
    caplog.set_level(logging.ERROR, logger="engine.dags.dagbag")
    broken = write(tmp_path / "broken_syntax.py", "x = 1\nwith open('f') as f\n    pass\n")
    write(tmp_path / "helper_lib.py", "def f():\n    raise ValueError('in helper')\n")
    raising = write(tmp_path / "uses_helper.py", "import helper_lib\nhelper_lib.f()\n")
    bag = DagBag(tmp_path)
    bag.collect()
    errors = dict(bag.import_errors)
    for path in (broken, raising):
        text = errors[str(path)]
        assert text.startswith("Traceback (most recent call last):"), text
        for machinery in ("dagparse.py", "dagbag.py", "importlib", "<frozen"):
            assert machinery not in text, text
    assert f'File "{broken}", line 2' in errors[str(broken)]
    assert "^" in errors[str(broken)]
    assert errors[str(raising)].splitlines()[1:] == [
        f'  File "{raising}", line 2, in <module>',
        "    helper_lib.f()",
        f'  File "{tmp_path / "helper_lib.py"}", line 2, in f',
        "    raise ValueError('in helper')",
        "ValueError: in helper",
    ]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "dagparse.py" not in logged, logged


@pytest.mark.usefixtures("isolated_imports")
def test_dags_trigger_of_a_broken_file_names_it_and_the_error(db_url: str, tmp_path: Path) -> None:
    broken = write(tmp_path / "my_dag.py", "def (:\n")
    write(tmp_path / "other.py", _GOOD_DAG.format(dag_id="other"))
    code, out = _invoke(db_url, "dags", "trigger", "my_dag", dags=tmp_path)
    assert code == 2, out
    error = next(line for line in out.splitlines() if line.startswith("error:"))
    assert str(broken) in out, out
    assert "SyntaxError: invalid syntax" in error, out
    assert "pass --dags" not in out, out
    assert "start a scheduler" not in out, out


def test_dags_trigger_without_a_folder_or_a_scheduler_names_both_ways_to_give_one(
    db_url: str,
) -> None:
    code, out = _invoke(db_url, "dags", "trigger", "nowhere")
    assert code == 2, out
    assert "nowhere" in out, out
    assert "--dags" in out, out
    assert "DEFERRAL_DAGS_FOLDER" in out, out


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_dags_trigger_gets_a_running_scheduler_to_find_a_new_file(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    env = _env(db_url, tmp_path, dags)
    env["DEFERRAL_DAG_RESCAN_INTERVAL_S"] = "3600"  # no scheduled rescan during the test
    children = Children(env, logs)
    try:
        async with explained(children):
            children.start("scheduler", name="scheduler")

            async def first_scan_logged() -> bool:
                return "recorded 0 DAG(s)" in (logs / "scheduler.log").read_text()

            await wait_until(first_scan_logged, what="the scheduler's first scan")
            write(dags / "brand_new.py", _GOOD_DAG.format(dag_id="brand_new"))
            trigger_env = _env(db_url, tmp_path)  # no DAGs folder: only the scheduler has it
            code, out = await anyio.to_thread.run_sync(
                lambda: _run_cli(
                    trigger_env, "dags", "trigger", "brand_new", "--run-id", "r1", cwd=tmp_path
                )
            )
            assert code == 0, out
            assert await store.get_dag_run("brand_new", "r1") is not None
    finally:
        children.stop_all()


# -- the setting ---------------------------------------------------------------------------------


def test_the_rescan_interval_is_a_setting() -> None:
    assert Settings().dag_rescan_interval_s == 10.0
    env = {"DEFERRAL_DAG_RESCAN_INTERVAL_S": "2.5"}
    assert load_settings(env).dag_rescan_interval_s == 2.5
    with pytest.raises(ConfigError, match="dag_rescan_interval_s"):
        Settings(dag_rescan_interval_s=0)
