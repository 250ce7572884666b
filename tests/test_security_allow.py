"""The trigger allow-list (setting ``trigger_allow``): a row written straight into the triggers
table cannot make the triggerer import a module or call a function the list does not match.

The attacker here is whoever can write to the database: the tests rewrite a stored trigger
row with a plain SQL UPDATE, bypassing ``defer()`` and its checks, then start a real triggerer
(built by ``engine.launch.app.make_triggerer`` from settings, as the ``deferral triggerer`` command
does) on the real store. Marker files prove what never ran or was never imported.
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest

from engine import DAG
from engine.config import Settings, load_settings
from engine.dags.dagbag import DagBag
from engine.launch.app import make_triggerer, make_worker, trigger_allow_list
from engine.security.allow import TriggerAllowList, dags_folder_modules
from engine.store import Store, TaskInstance
from engine.worker.worker import Worker
from operators.base import BaseOperator, Context
from tests.helpers import wait_until
from tests.triggerer_support import WaitOn
from triggers.base import TriggerSerializationError, encode_value, rebuild_trigger
from triggers.python import PythonTrigger

pytestmark = pytest.mark.anyio

DAG_ID = "allow"
ENDED = frozenset({"success", "failed", "skipped"})


def _settings(tmp_path: Path, **changes: Any) -> Settings:
    dags = tmp_path / "dags"
    dags.mkdir(exist_ok=True)
    return Settings(
        dags_folder=str(dags), triggerer_poll_interval_s=0.2, worker_poll_interval_s=0.2
    ).replace(**changes)


def _waiting_dag(tmp_path: Path) -> DAG:
    """One task that defers on a trigger that never fires (the flag is never created)."""
    with DAG(dag_id=DAG_ID) as dag:
        WaitOn(
            task_id="wait",
            trigger="FlagTrigger",
            trigger_kwargs={"flag": str(tmp_path / "never"), "key": "k"},
        )
    return dag


async def _task(store: Store) -> TaskInstance:
    (ti,) = await store.list_task_instances(dag_id=DAG_ID)
    return ti


async def _start_run(store: Store, dagbag: DagBag, dag: DAG) -> None:
    dagbag.add_dag(dag)
    await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
    await store.create_dag_run(dag.dag_id, "r1", logical_date=await store.now())


@contextlib.asynccontextmanager
async def _deferred_then_rewritten(
    store: Store, db_url: str, tmp_path: Path, classpath: str, kwargs: dict[str, Any]
) -> AsyncIterator[None]:
    """A task deferred on a harmless trigger whose row an attacker then rewrites; the worker
    keeps running (no triggerer yet) so the refusal can end the task."""
    dagbag = DagBag(None)
    worker = Worker(store, dagbag, slots=2, poll_interval_s=0.2, heartbeat_s=1.0)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        try:
            await _start_run(store, dagbag, _waiting_dag(tmp_path))

            async def deferred() -> bool:
                return (await _task(store)).state == "deferred"

            await wait_until(deferred, what="the task deferred")
            conn = await asyncpg.connect(db_url)
            try:
                status = await conn.execute(
                    "UPDATE deferral_triggers SET classpath = $1, kwargs = $2",
                    classpath,
                    encode_value(kwargs),
                )
            finally:
                await conn.close()
            assert status == "UPDATE 1"
            yield
        finally:
            worker.stop()


async def _run_triggerer_until_task_ends(store: Store, settings: Settings) -> TaskInstance:
    triggerer = make_triggerer(store, settings)
    async with anyio.create_task_group() as tg:
        await tg.start(triggerer.run)
        try:

            async def ended() -> bool:
                return (await _task(store)).state in ENDED

            await wait_until(ended, what="the task ended")
        finally:
            triggerer.stop()
    return await _task(store)


async def test_a_stored_row_naming_a_shell_callable_never_runs_it_and_fails_its_task(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    evil = {
        "check": "asyncio.create_subprocess_shell",
        "kwargs": {"cmd": f"touch {marker}"},
        "poll_interval": 0.0,
        "end_from_trigger": False,
    }
    async with _deferred_then_rewritten(
        store, db_url, tmp_path, "triggers.python.PythonTrigger", evil
    ):
        ti = await _run_triggerer_until_task_ends(store, _settings(tmp_path))
    assert not marker.exists(), "the shell command ran"
    assert ti.state == "failed"
    assert "trigger_allow" in ti.error
    assert "kwarg 'check'" in ti.error
    # The refused value is a kwarg: it stays out of the message.
    assert "create_subprocess_shell" not in ti.error


async def test_a_classpath_outside_the_list_is_refused_before_its_module_is_imported(
    store: Store, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module is importable (on sys.path) but neither built in nor in the DAGs folder."""
    module = f"evil_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "imported"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / f"{module}.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).touch()\n"
        "from tests.triggerer_support import FlagTrigger as EvilTrigger\n"
    )
    monkeypatch.syspath_prepend(str(elsewhere))
    async with _deferred_then_rewritten(
        store, db_url, tmp_path, f"{module}.EvilTrigger", {"flag": "x", "key": "k"}
    ):
        ti = await _run_triggerer_until_task_ends(store, _settings(tmp_path))
    assert not marker.exists(), "the module was imported"
    assert module not in sys.modules
    assert ti.state == "failed"
    assert "trigger_allow" in ti.error


async def test_a_pattern_naming_a_prefix_does_not_allow_a_longer_classpath(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    """``tests.triggerer_support.Flag`` is a prefix of the row's classpath, not a match."""
    settings = _settings(tmp_path, trigger_allow=("triggers.*", "tests.triggerer_support.Flag"))
    async with _deferred_then_rewritten(
        store,
        db_url,
        tmp_path,
        "tests.triggerer_support.FlagTrigger",
        {"flag": str(tmp_path / "go"), "key": "k", "journal": None},
    ):
        (tmp_path / "go").touch()  # the trigger would fire at once if it were started
        ti = await _run_triggerer_until_task_ends(store, settings)
    assert ti.state == "failed"
    assert "trigger_allow" in ti.error


async def test_an_allowed_classpath_runs_and_resumes_its_task(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    """The same path with a full pattern: the refusals above are the list, not a broken row."""
    settings = _settings(tmp_path, trigger_allow=("tests.triggerer_support.FlagTrigger",))
    async with _deferred_then_rewritten(
        store,
        db_url,
        tmp_path,
        "tests.triggerer_support.FlagTrigger",
        {"flag": str(tmp_path / "go"), "key": "k", "journal": None},
    ):
        (tmp_path / "go").touch()
        ti = await _run_triggerer_until_task_ends(store, settings)
    assert ti.state == "success", ti.error


class DeferOnPython(BaseOperator):
    """Defers on a PythonTrigger whose check is ``check``."""

    def __init__(self, *, check: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check = check

    def execute(self, context: Context) -> None:
        self.defer(trigger=PythonTrigger(self.check, poll_interval=60), method_name="done")

    def done(self, context: Context, event: Any) -> Any:
        return event


@pytest.mark.parametrize(
    "make_task",
    [
        pytest.param(
            lambda tmp: WaitOn(
                task_id="wait",
                trigger="FlagTrigger",
                trigger_kwargs={"flag": str(tmp / "never"), "key": "k"},
            ),
            id="classpath",
        ),
        pytest.param(
            lambda tmp: DeferOnPython(task_id="wait", check="asyncio.tasks.sleep"), id="callable"
        ),
    ],
)
async def test_the_worker_refuses_at_defer_time_and_writes_no_trigger(
    store: Store, tmp_path: Path, make_task: Any
) -> None:
    settings = _settings(tmp_path, trigger_allow=("triggers.*",))
    worker = make_worker(store, settings)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        try:
            with DAG(dag_id=DAG_ID) as dag:
                make_task(tmp_path)
            await _start_run(store, worker.dagbag, dag)

            async def ended() -> bool:
                return (await _task(store)).state in ENDED

            await wait_until(ended, what="the task ended")
        finally:
            worker.stop()
    ti = await _task(store)
    assert ti.state == "failed"
    assert "trigger_allow" in ti.error
    assert ti.trigger_id is None
    assert await store.count_unowned_triggers() == 0


def test_patterns_match_in_full_never_by_prefix() -> None:
    allow = TriggerAllowList(["triggers.*", "myproj.triggers.JobDone", "ops.check_?"])
    assert allow("triggers.python.PythonTrigger")
    assert allow("myproj.triggers.JobDone")
    assert not allow("myproj.triggers.JobDoneTrigger")
    assert not allow("myproj.triggers")
    assert not allow("triggersx.Evil")
    assert allow("ops.check_a")
    assert not allow("ops.check_ab")
    assert not allow("asyncio.create_subprocess_shell")


def test_a_judgement_asked_again_is_the_same_and_the_memo_stays_bounded() -> None:
    allow = TriggerAllowList(["triggers.*", "ops.check_?"])
    names = ["triggers.x.T", "ops.check_a", "ops.check_ab", "evil.T"] * 3
    assert [allow(n) for n in names] == [True, True, False, False] * 3
    # A stream of made-up classpaths (anyone writing trigger rows can vary them) does not
    # grow the memo without end, and the answers stay right past its size.
    for i in range(3 * 4096):
        assert allow(f"triggers.m{i}.T")
        assert not allow(f"evil{i}.T")
    assert len(allow._by_pattern) <= 4096
    assert allow("ops.check_b")
    assert not allow("ops.check_bc")


def test_the_default_is_the_builtins_and_the_dags_folder_modules(tmp_path: Path) -> None:
    # Unique names: a module of that name imported from elsewhere would be left out.
    orders, pkg, late = (f"{n}_{uuid.uuid4().hex[:8]}" for n in ("orders", "pkg", "late"))
    dags = tmp_path / "dags"
    (dags / pkg).mkdir(parents=True)
    (dags / pkg / "__init__.py").write_text("")
    (dags / f"{orders}.py").write_text("")
    (dags / "os.py").write_text("")  # shadows nothing: os is the standard library's
    (dags / "data").mkdir()  # no Python in it
    assert dags_folder_modules(dags) == {orders, pkg}
    allow = trigger_allow_list(Settings(dags_folder=str(dags)))
    assert allow("triggers.temporal.DateTimeTrigger")
    assert allow(f"{orders}.FileLandedTrigger")
    assert allow(f"{pkg}.sub.Trigger")
    assert not allow(f"{orders}_evil.Trigger")
    assert not allow(orders)
    assert not allow("os.system")
    assert not allow("data.Trigger")
    (dags / f"{late}.py").write_text("")  # a DAG file added while the process runs
    assert allow(f"{late}.LateTrigger")


def test_the_setting_reads_a_comma_separated_environment_variable() -> None:
    settings = load_settings({"DEFERRAL_TRIGGER_ALLOW": "triggers.*, myproj.triggers.*,"})
    assert settings.trigger_allow == ("triggers.*", "myproj.triggers.*")
    assert load_settings({}).trigger_allow is None


def test_a_callable_a_dags_module_only_imported_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``orders.*`` allows what orders.py defines, not what it imports: a row naming
    ``orders.create_subprocess_shell`` must not reach asyncio's function."""
    name = f"orders_{uuid.uuid4().hex[:8]}"
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / f"{name}.py").write_text(
        "from asyncio import create_subprocess_shell  # noqa: F401\n"
        "async def ready() -> bool:\n    return True\n"
    )
    monkeypatch.syspath_prepend(str(dags))
    allow = trigger_allow_list(Settings(dags_folder=str(dags)))
    marker = tmp_path / "ran"
    kwargs = {"check": f"{name}.create_subprocess_shell", "kwargs": {"cmd": f"touch {marker}"}}
    assert allow(kwargs["check"])  # the pattern alone would let it through
    with pytest.raises(TriggerSerializationError, match=r"defined in module 'asyncio\.subprocess'"):
        rebuild_trigger("triggers.python.PythonTrigger", kwargs)
    assert not marker.exists()
    # What the module defines itself is still allowed and builds.
    built = rebuild_trigger("triggers.python.PythonTrigger", {"check": f"{name}.ready"})
    assert isinstance(built, PythonTrigger)
