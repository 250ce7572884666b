"""DAG files in a folder: import errors by name, trigger classes importable by classpath,
reload on change."""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.dags.dagbag import DagBag
from engine.store import Store
from engine.testing import run_engine
from triggers.base import (
    TriggerSerializationError,
    decode_value,
    import_trigger_class,
    validate_trigger,
)


@pytest.fixture(autouse=True)
def isolated_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test's DAGs folder leaves sys.path, and its modules leave sys.modules, afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _uid() -> str:
    return uuid.uuid4().hex[:10]


_mtime_step = 0


def write(path: Path, source: str) -> Path:
    """Write a module and give it a modification time no earlier write had (a rewrite within
    the same second must still count as a change, for the DagBag and for cached bytecode)."""
    global _mtime_step
    _mtime_step += 10
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    stamp = path.stat().st_mtime + _mtime_step
    os.utime(path, (stamp, stamp))
    return path


def dag_source(dag_id: str, *task_ids: str, trailer: str = "") -> str:
    tasks = "\n".join(
        f"    PythonOperator(task_id={t!r}, python_callable=lambda: {t!r})" for t in task_ids
    )
    return (
        "from engine import DAG\n"
        "from operators.python import PythonOperator\n"
        f"with DAG(dag_id={dag_id!r}):\n{tasks}\n{trailer}"
    )


def test_a_broken_file_is_reported_by_name_and_the_others_load(tmp_path: Path) -> None:
    uid = _uid()
    write(tmp_path / f"a_good_{uid}.py", dag_source(f"first_{uid}", "t"))
    broken = write(tmp_path / f"b_broken_{uid}.py", "raise RuntimeError('broken on purpose')\n")
    syntax = write(tmp_path / f"c_syntax_{uid}.py", "def (:\n")
    cycle = write(
        tmp_path / f"d_cycle_{uid}.py",
        f"""
        from engine import DAG
        from operators.python import PythonOperator
        with DAG(dag_id="cyclic_{uid}"):
            x = PythonOperator(task_id="x", python_callable=print)
            y = PythonOperator(task_id="y", python_callable=print)
            x >> y >> x
        """,
    )
    write(tmp_path / f"e_good_{uid}.py", dag_source(f"last_{uid}", "t"))
    write(tmp_path / f"team_{uid}" / "etl.py", dag_source(f"nested_{uid}", "t"))
    write(tmp_path / f"_private_{uid}.py", "raise RuntimeError('never imported')\n")

    bag = DagBag(tmp_path)
    dags = bag.collect()

    assert set(dags) == {f"first_{uid}", f"last_{uid}", f"nested_{uid}"}
    assert set(bag.import_errors) == {str(broken), str(syntax), str(cycle)}
    assert "RuntimeError: broken on purpose" in bag.import_errors[str(broken)]
    assert "SyntaxError" in bag.import_errors[str(syntax)]
    assert "DagCycleError" in bag.import_errors[str(cycle)]
    assert dags[f"nested_{uid}"].fileloc == str(tmp_path / f"team_{uid}" / "etl.py")
    assert f"team_{uid}.etl" in sys.modules
    with pytest.raises(LookupError, match=f"no DAG 'missing_{uid}'"):
        bag.get_dag(f"missing_{uid}")


def test_the_same_dag_id_in_two_files_is_an_error_for_the_second(tmp_path: Path) -> None:
    uid = _uid()
    write(tmp_path / f"a_{uid}.py", dag_source(f"twice_{uid}", "one"))
    second = write(tmp_path / f"b_{uid}.py", dag_source(f"twice_{uid}", "two"))
    bag = DagBag(tmp_path)
    dags = bag.collect()
    assert set(dags[f"twice_{uid}"].tasks) == {"one"}
    assert f"DAG 'twice_{uid}' is also defined in" in bag.import_errors[str(second)]


def test_a_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DagBag(tmp_path / "nowhere")


_FOLDER_TRIGGER = """
    import asyncio
    from typing import Any
    from triggers.base import BaseTrigger, TriggerEvent

    class FolderTrigger(BaseTrigger):
        def __init__(self, label: str) -> None:
            self.label = label

        def serialize(self) -> tuple[str, dict[str, Any]]:
            return (__name__ + ".FolderTrigger", {"label": self.label})

        async def run(self):
            await asyncio.sleep(0.01)
            yield TriggerEvent("fired " + self.label)
"""


def test_a_trigger_class_in_the_dags_folder_is_importable_by_classpath(tmp_path: Path) -> None:
    module = f"folder_triggers_{_uid()}"
    write(tmp_path / f"{module}.py", _FOLDER_TRIGGER)
    DagBag(tmp_path)  # puts the folder on sys.path, as workers and triggerers do
    cls = import_trigger_class(f"{module}.FolderTrigger")
    stored = validate_trigger(cls(label="x"))  # type: ignore[call-arg]
    assert stored.classpath == f"{module}.FolderTrigger"
    assert decode_value(stored.kwargs) == {"label": "x"}


def test_a_trigger_class_found_before_is_found_anew_once_its_module_changed(
    tmp_path: Path,
) -> None:
    """import_trigger_class answers a classpath it found before at once, but never with a
    class its module no longer holds: a module reloaded in place, imported anew (a DAG
    file's, after an edit) or a name bound to another class gives the class of now."""
    module = f"folder_triggers_{_uid()}"
    path = write(tmp_path / f"{module}.py", _FOLDER_TRIGGER)
    DagBag(tmp_path)
    first = import_trigger_class(f"{module}.FolderTrigger")
    assert import_trigger_class(f"{module}.FolderTrigger") is first

    # Reloaded in place (the same module object, a new class).
    write(path, _FOLDER_TRIGGER.replace('"fired "', '"fired again "'))
    importlib.invalidate_caches()
    reloaded = importlib.reload(sys.modules[module])
    second = import_trigger_class(f"{module}.FolderTrigger")
    assert second is reloaded.FolderTrigger
    assert second is not first

    # Imported anew (a new module object).
    del sys.modules[module]
    third = import_trigger_class(f"{module}.FolderTrigger")
    assert third is sys.modules[module].FolderTrigger
    assert third not in (first, second)

    # The name bound to another class, then to something that is no trigger class at all.
    class Other(first):  # type: ignore[misc, valid-type]
        pass

    sys.modules[module].FolderTrigger = Other  # type: ignore[attr-defined]
    assert import_trigger_class(f"{module}.FolderTrigger") is Other
    sys.modules[module].FolderTrigger = object  # type: ignore[attr-defined]
    with pytest.raises(TriggerSerializationError, match="not a BaseTrigger subclass"):
        import_trigger_class(f"{module}.FolderTrigger")


@pytest.mark.anyio
async def test_a_dag_deferring_to_a_folder_trigger_runs(store: Store, tmp_path: Path) -> None:
    uid = _uid()
    module = f"folder_triggers_{uid}"
    write(tmp_path / f"{module}.py", _FOLDER_TRIGGER)
    write(
        tmp_path / f"dag_{uid}.py",
        f"""
        from typing import Any
        from engine import DAG
        from operators.base import BaseOperator
        from {module} import FolderTrigger

        class Waits(BaseOperator):
            def execute(self, context: Any) -> None:
                self.defer(trigger=FolderTrigger("from the folder"), method_name="done")

            def done(self, context: Any, event: Any = None) -> Any:
                return event

        with DAG(dag_id="folder_{uid}"):
            Waits(task_id="waits")
        """,
    )
    bag = DagBag(tmp_path)
    dag = bag.get_dag(f"folder_{uid}")
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["waits"]["state"] == "success", tis["waits"]["error"]
    assert decode_value(tis["waits"]["result"]) == "fired from the folder"


def test_a_changed_file_is_reloaded(tmp_path: Path) -> None:
    uid = _uid()
    dag_id = f"reload_{uid}"
    path = write(tmp_path / f"reload_{uid}.py", dag_source(dag_id, "a"))
    bag = DagBag(tmp_path)
    first = bag.collect()[dag_id]
    assert set(first.tasks) == {"a"}
    assert bag.is_current(dag_id)

    # Unchanged: the same DAG object, no re-import.
    assert bag.collect()[dag_id] is first

    write(path, dag_source(dag_id, "a", "b"))
    assert not bag.is_current(dag_id)
    assert set(bag.collect()[dag_id].tasks) == {"a", "b"}

    # get_dag notices the change by itself.
    write(path, dag_source(dag_id, "c"))
    assert set(bag.get_dag(dag_id).tasks) == {"c"}
    assert bag.get_task(dag_id, "c").task_id == "c"


def test_a_check_shared_by_the_tries_of_a_claim_never_hides_an_earlier_edit(
    tmp_path: Path,
) -> None:
    """The tries of one claim share one stat of their DAG file (``checked_since``: when the
    claim's reply arrived); a try claimed after an edit never takes an older stat's word."""
    uid = _uid()
    dag_id = f"shared_{uid}"
    path = write(tmp_path / f"shared_{uid}.py", dag_source(dag_id, "a"))
    bag = DagBag(tmp_path)
    bag.collect()
    claimed = time.monotonic()
    assert bag.is_current(dag_id, checked_since=claimed)  # the claim's first try: a stat
    checked = bag._snapshot.checked[str(path)]
    assert checked > claimed
    # Its other tries take that stat's word (an edit saved now, after the claim, is the next
    # claim's to see)...
    write(path, dag_source(dag_id, "a", "b"))
    assert bag.is_current(dag_id, checked_since=claimed)
    # ... but a claim whose reply came after the edit never does: its first try looks again.
    later = time.monotonic()
    assert not bag.is_current(dag_id, checked_since=later)
    assert not bag.is_current(dag_id)
    assert set(bag.get_dag(dag_id).tasks) == {"a", "b"}
    # A reload starts afresh: no check of the old bag answers for the new one.
    assert str(path) not in bag._snapshot.checked
    assert bag.is_current(dag_id, checked_since=later)
    write(path, dag_source(dag_id, "c"))
    assert not bag.is_current(dag_id, checked_since=time.monotonic())
    assert set(bag.get_dag(dag_id).tasks) == {"c"}


def test_a_file_is_imported_again_only_when_its_content_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # cached bytecode must not be run
    uid = _uid()
    dag_id = f"same_{uid}"
    path = write(tmp_path / f"same_{uid}.py", dag_source(dag_id, "a"))
    bag = DagBag(tmp_path)
    assert set(bag.collect()[dag_id].tasks) == {"a"}
    assert bag.imports == 1

    # The same size and modification time, other bytes, put in place by a rename (as git and
    # deploy tools do): the inode tells, and the bytecode cached for the old bytes (checked by
    # modification time and size) is not run.
    before = path.stat()
    other = tmp_path / f"tmp_{uid}.txt"
    other.write_text(dag_source(dag_id, "b"))
    os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))
    other.replace(path)
    second = bag.collect()[dag_id]
    assert set(second.tasks) == {"b"}
    assert bag.imports == 2

    # Rewritten with the same bytes (a deploy copying the folder, a touch): a new stat, but the
    # content is compared and the module kept.
    write(path, dag_source(dag_id, "b"))
    assert not bag.is_current(dag_id)
    assert bag.collect()[dag_id] is second
    assert (bag.imports, bag.unchanged_rewrites) == (2, 1)
    assert bag.is_current(dag_id)  # the new stat is remembered: no reread before each task
    assert bag.get_dag(dag_id) is second
    assert (bag.imports, bag.unchanged_rewrites) == (2, 1)


def test_a_file_that_breaks_is_reported_and_loads_again_once_fixed(tmp_path: Path) -> None:
    uid = _uid()
    dag_id = f"fixme_{uid}"
    path = write(tmp_path / f"fixme_{uid}.py", dag_source(dag_id, "a"))
    bag = DagBag(tmp_path)
    assert set(bag.collect()) == {dag_id}

    write(path, "raise ImportError('half-saved file')\n")
    assert dag_id not in bag.collect()
    assert "half-saved file" in bag.import_errors[str(path)]

    write(path, dag_source(dag_id, "a", "b"))
    dags = bag.collect()
    assert str(path) not in bag.import_errors
    assert set(dags[dag_id].tasks) == {"a", "b"}


def test_a_removed_file_takes_its_dags_with_it(tmp_path: Path) -> None:
    uid = _uid()
    keep = write(tmp_path / f"keep_{uid}.py", dag_source(f"keep_{uid}", "a"))
    gone = write(tmp_path / f"gone_{uid}.py", dag_source(f"gone_{uid}", "a"))
    bag = DagBag(tmp_path)
    assert set(bag.collect()) == {f"keep_{uid}", f"gone_{uid}"}
    gone.unlink()
    assert set(bag.collect()) == {f"keep_{uid}"}
    assert keep.exists()


def test_a_reload_swaps_the_whole_bag_in_one_assignment(tmp_path: Path) -> None:
    """While a reload builds the new DAG map, a reader (the worker's loop, while the reload
    runs in a thread) sees the old complete map, never one with DAGs missing."""
    uid = _uid()
    write(tmp_path / f"a_{uid}.py", dag_source(f"a_{uid}", "t"))
    probed = tmp_path / f"b_{uid}.py"
    source = f"""
        from engine import DAG
        from operators.python import PythonOperator
        import tests.bag_probe as probe

        class ProbedDAG(DAG):
            @property
            def fileloc(self):
                return self._fileloc

            @fileloc.setter
            def fileloc(self, value):
                self._fileloc = value
                if probe.bag is not None:
                    probe.seen.append(sorted(probe.bag.dags))

        with ProbedDAG(dag_id="b_{uid}"):
            PythonOperator(task_id="t", python_callable=print)
        # version
        """
    write(probed, source.replace("version", "version 1"))
    bag = DagBag(tmp_path)
    assert set(bag.collect()) == {f"a_{uid}", f"b_{uid}"}
    probe = importlib.import_module("tests.bag_probe")
    probe.bag, probe.seen = bag, []
    try:
        write(probed, source.replace("version", "version 2"))
        assert set(bag.collect()) == {f"a_{uid}", f"b_{uid}"}
    finally:
        probe.bag = None
    assert probe.seen, "the probe did not run"
    assert all(keys == sorted([f"a_{uid}", f"b_{uid}"]) for keys in probe.seen), probe.seen
