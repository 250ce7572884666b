"""A trigger module in the DAGs folder that changes is imported again by a running triggerer:
triggers claimed after the change run the new code, triggers already running keep theirs (their
class and their module's globals), and a changed file that no longer imports fails the new
triggers with an error naming it while the running ones go on.

``TriggerClasses`` is tested in this process on a DAGs folder of the test's own; the end to end
test runs a scheduler, a worker and a triggerer as processes on the test's database."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.store import Store
from engine.triggerer.classes import TriggerClasses
from tests.helpers import wait_until
from tests.processes import Children, explained
from triggers.base import BaseTrigger, TriggerEvent, TriggerSerializationError, decode_value

_TRIGGER = """
    import asyncio
    import os

    from triggers.base import BaseTrigger, TriggerEvent

    VERSION = {version!r}{padding}


    class FlagTrigger(BaseTrigger):
        \"\"\"Fires once the file ``flag`` exists, with this module's VERSION.\"\"\"

        def __init__(self, flag):
            self.flag = flag

        def serialize(self):
            return ("{module}.FlagTrigger", {{"flag": self.flag}})

        async def run(self):
            open(self.flag + ".started", "w").close()  # noqa: ASYNC230
            while not os.path.exists(self.flag):
                await asyncio.sleep(0.05)
            yield TriggerEvent({{"version": VERSION, "flag": self.flag}})
"""

_DAG = """
    from engine import DAG
    from operators.base import BaseOperator
    from {module} import FlagTrigger


    class WaitForFlag(BaseOperator):
        def execute(self, context):
            flag = {flags!r} + "/" + context["run_id"]
            self.defer(trigger=FlagTrigger(flag), method_name="resumed")

        def resumed(self, context, event):
            return event


    with DAG(dag_id="reload"):
        WaitForFlag(task_id="wait")
"""

_mtime_step = 0


def write(path: Path, source: str) -> Path:
    """Write a file with a modification time no earlier write had."""
    global _mtime_step
    _mtime_step += 10
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    stamp = path.stat().st_mtime + _mtime_step
    os.utime(path, (stamp, stamp))
    return path


def trigger_source(version: str, module: str) -> str:
    # A longer line for each version: the file's size changes too.
    return _TRIGGER.format(version=version, module=module, padding="  #" + "-" * len(version) * 3)


@pytest.fixture
def dags(tmp_path: Path) -> Iterator[Path]:
    """A DAGs folder on sys.path; the modules imported from it are forgotten afterwards."""
    folder = tmp_path / "dags"
    folder.mkdir()
    sys.path.insert(0, str(folder))
    before = set(sys.modules)
    try:
        yield folder
    finally:
        sys.path.remove(str(folder))
        for name in set(sys.modules) - before:
            if getattr(sys.modules[name], "__file__", "") and str(
                sys.modules[name].__file__
            ).startswith(str(folder)):
                del sys.modules[name]


def _build(cls: type[BaseTrigger], flag: Path) -> BaseTrigger:
    return cls(flag=str(flag))  # type: ignore[call-arg]


async def _first_event(trigger: BaseTrigger) -> Any:
    async for event in trigger.run():
        assert isinstance(event, TriggerEvent)
        return event.payload
    raise AssertionError("no event")


def test_a_changed_module_gives_new_classes_and_old_triggers_keep_their_code(
    dags: Path, caplog: pytest.LogCaptureFixture
) -> None:
    module = "reload_unit_a"
    file = write(dags / f"{module}.py", trigger_source("v1", module))
    classes = TriggerClasses(dags)
    classpath = f"{module}.FlagTrigger"
    v1 = classes.load(classpath)
    old = _build(v1, dags / "go")

    classes.check({classpath})  # unchanged: the same class
    assert classes.load(classpath) is v1

    write(file, trigger_source("v2", module))
    with caplog.at_level(logging.INFO, logger="engine.triggerer"):
        classes.check({classpath})
        v2 = classes.load(classpath)
    assert v2 is not v1
    new = _build(v2, dags / "go")
    (dags / "go").touch()
    assert asyncio.run(_first_event(old))["version"] == "v1"
    assert asyncio.run(_first_event(new))["version"] == "v2"
    reloads = [r.getMessage() for r in caplog.records if "imported again" in r.getMessage()]
    assert len(reloads) == 1, reloads
    assert module in reloads[0], reloads
    assert str(file) in reloads[0], reloads


def test_a_changed_module_that_no_longer_imports_fails_new_triggers_until_fixed(
    dags: Path, caplog: pytest.LogCaptureFixture
) -> None:
    module = "reload_unit_b"
    file = write(dags / f"{module}.py", trigger_source("v1", module))
    classes = TriggerClasses(dags)
    classpath = f"{module}.FlagTrigger"
    v1 = classes.load(classpath)
    old = _build(v1, dags / "go")

    write(file, "raise RuntimeError('half-edited')\n")
    classes.check({classpath})
    for _ in range(2):  # the error is kept: the file is not run again for every trigger
        with pytest.raises(TriggerSerializationError) as caught:
            classes.load(classpath)
        assert str(file) in str(caught.value), caught.value
        assert "RuntimeError: half-edited" in str(caught.value), caught.value
        classes.check({classpath})
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]

    (dags / "go").touch()
    assert asyncio.run(_first_event(old))["version"] == "v1"  # the running one goes on

    write(file, trigger_source("v3", module))
    classes.check({classpath})
    v3 = classes.load(classpath)
    assert asyncio.run(_first_event(_build(v3, dags / "go")))["version"] == "v3"


def test_a_module_of_a_package_in_the_dags_folder_is_imported_again(dags: Path) -> None:
    write(dags / "reload_pkg" / "__init__.py", "")
    module = "reload_pkg.trig"
    file = write(dags / "reload_pkg" / "trig.py", trigger_source("v1", module))
    classes = TriggerClasses(dags)
    classpath = f"{module}.FlagTrigger"
    old = _build(classes.load(classpath), dags / "go")
    write(file, trigger_source("v2", module))
    classes.check({classpath})
    new = _build(classes.load(classpath), dags / "go")
    assert sys.modules["reload_pkg"].trig is sys.modules[module]  # the package sees the new one
    (dags / "go").touch()
    assert asyncio.run(_first_event(old))["version"] == "v1"
    assert asyncio.run(_first_event(new))["version"] == "v2"


def test_modules_outside_the_dags_folder_are_not_watched(dags: Path, tmp_path: Path) -> None:
    classes = TriggerClasses(tmp_path / "elsewhere")
    module = "reload_unit_c"
    file = write(dags / f"{module}.py", trigger_source("v1", module))
    v1 = classes.load(f"{module}.FlagTrigger")
    write(file, trigger_source("v2", module))
    classes.check({f"{module}.FlagTrigger"})
    assert classes.load(f"{module}.FlagTrigger") is v1


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # The loops under test run in the child processes; the test's own loop only watches.
    return ("asyncio", {"use_uvloop": True})


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_a_running_triggerer_runs_new_triggers_on_the_changed_code(
    store: Store, children: Children, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    flags = tmp_path / "flags"
    flags.mkdir()
    module = "mytrig"
    trigger_file = write(dags / f"{module}.py", trigger_source("v1", module))
    write(dags / "reload_dag.py", _DAG.format(module=module, flags=str(flags)))
    children.env["DEFERRAL_DAGS_FOLDER"] = str(dags)
    children.env["DEFERRAL_TRIGGERER_POLL_INTERVAL_S"] = "0.2"

    async def recorded() -> bool:
        return any(d.dag_id == "reload" for d in await store.list_dags())

    async def running(run_id: str) -> bool:
        # Started: its code imported (a claimed trigger may not have been imported yet).
        return (flags / f"{run_id}.started").exists()

    async def ended(*run_ids: str) -> bool:
        for run_id in run_ids:
            run = await store.get_dag_run("reload", run_id)
            if run is None or run.state not in ("success", "failed"):
                return False
        return True

    async with explained(children):
        for kind in ("scheduler", "worker", "triggerer"):
            children.start(kind, name=kind)
        await wait_until(recorded, what="the DAG recorded")

        await store.create_dag_run("reload", "a", logical_date=await store.now())
        await wait_until(lambda: running("a"), what="task A's trigger running")

        write(trigger_file, trigger_source("v2", module))
        await store.create_dag_run("reload", "b", logical_date=await store.now())
        await wait_until(lambda: running("b"), what="task B's trigger running")

        (flags / "a").touch()
        (flags / "b").touch()
        await wait_until(lambda: ended("a", "b"), what="both runs ended")

        results = {}
        for run_id in ("a", "b"):
            (ti,) = await store.list_task_instances(dag_id="reload", run_id=run_id)
            assert ti.state == "success", ti
            assert ti.result is not None
            results[run_id] = decode_value(ti.result)
        assert results["a"]["version"] == "v1", results
        assert results["b"]["version"] == "v2", results
        log = (children.logs / "triggerer.log").read_text()
        reloads = [line for line in log.splitlines() if "imported again" in line]
        assert len(reloads) == 1, log
        assert module in reloads[0], reloads
        assert str(trigger_file) in reloads[0], reloads
