"""Badly behaved triggers, and a way to run ``python -m engine triggerer`` processes, for the
triggerer fault tests (tests/test_triggerer_*.py). Importable by the triggerer processes."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import DAG
from engine.store import Store, TaskInstance
from engine.testing import run_engine
from engine.worker.worker import Worker
from operators.base import BaseOperator, Context
from tests.conftest import REPO
from tests.helpers import child_env
from tests.triggerer_support import journal
from triggers.base import BaseTrigger, TaskEndEvent, TriggerEvent

MODULE = "tests.triggerer_faults"

Spawn = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def spawn(db_url: str, tmp_path: Path) -> Iterator[Spawn]:
    """Start triggerer processes (``**settings``: DEFERRAL_TRIGGERER_<NAME> values); kills
    those still running at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(capacity: int = 1000, **settings: float) -> subprocess.Popen[bytes]:
        env = child_env(
            DATABASE_URL=db_url,
            TRIGGERER_POLL_INTERVAL_S="0.2",
            **{f"TRIGGERER_{k.upper()}": str(v) for k, v in settings.items()},
        )
        log = (tmp_path / f"triggerer-{len(procs)}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "triggerer", "--capacity", str(capacity)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=log,
        )
        log.close()
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


class Misbehaving(BaseTrigger):
    """Does one bad thing (``how``) in its ``run()`` or ``cleanup()``."""

    def __init__(self, how: str) -> None:
        self.how = how

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{MODULE}.Misbehaving", {"how": self.how}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        if self.how == "SystemExit":
            raise SystemExit(3)
        if self.how == "KeyboardInterrupt":
            raise KeyboardInterrupt
        if self.how == "GeneratorExit":
            raise GeneratorExit
        if self.how == "CancelledError":
            # What awaiting a cancelled inner task surfaces as.
            inner = asyncio.get_running_loop().create_task(asyncio.Event().wait())
            await asyncio.sleep(0)
            inner.cancel()
            await inner
        if self.how == "child SystemExit":
            # A task of the trigger's own: asyncio re-raises its SystemExit out of the loop.
            async def child() -> None:
                raise SystemExit(5)

            await asyncio.gather(child())
        if self.how == "bare TaskEndEvent":
            yield TaskEndEvent("done?")
        yield TriggerEvent(self.how)

    async def cleanup(self) -> None:
        if self.how == "cleanup SystemExit":
            raise SystemExit(4)


class NotAGenerator(BaseTrigger):
    """``run()`` is a coroutine (async def without yield), not an async generator."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{MODULE}.NotAGenerator", {}

    async def run(self) -> TriggerEvent:  # type: ignore[override]
        return TriggerEvent("never an async generator")


class FlagThenDelay(BaseTrigger):
    """Journals its start, waits for the file ``flag``, then ``delay_s`` more, then fires."""

    def __init__(self, flag: str, key: str, delay_s: float = 0.0, journal: str | None = None):
        self.flag = flag
        self.key = key
        self.delay_s = delay_s
        self.journal = journal

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{MODULE}.FlagThenDelay", {
            "flag": self.flag,
            "key": self.key,
            "delay_s": self.delay_s,
            "journal": self.journal,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        journal(self.journal, f"start {self.key} {os.getpid()}")
        # Another process creates the file: polling is the only way to see it.
        while not os.path.exists(self.flag):  # noqa: ASYNC110, ASYNC240
            await asyncio.sleep(0.1)
        await asyncio.sleep(self.delay_s)
        yield TriggerEvent({"key": self.key, "pid": os.getpid()})


class Sleeper(BaseTrigger):
    """Journals its start, blocks the event loop with ``time.sleep(block_s)``, then waits."""

    def __init__(self, block_s: float, journal: str) -> None:
        self.block_s = block_s
        self.journal = journal

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{MODULE}.Sleeper", {"block_s": self.block_s, "journal": self.journal}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        journal(self.journal, f"start sleeper {os.getpid()}")
        await asyncio.sleep(0.1)  # let the timer beside it start first
        time.sleep(self.block_s)  # noqa: ASYNC251 - the bug this trigger stands for
        await asyncio.Event().wait()
        yield TriggerEvent(None)  # pragma: no cover - never reached


class WaitFor(BaseOperator):
    """Defers on ``trigger`` (a class name of this module, with its kwargs); the resumed
    method journals the task instance and returns the event."""

    def __init__(
        self,
        *,
        trigger: str,
        trigger_kwargs: dict[str, Any] | None = None,
        resumed_journal: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.trigger = trigger
        self.trigger_kwargs = trigger_kwargs or {}
        self.resumed_journal = resumed_journal

    async def execute(self, context: Context) -> None:
        cls = getattr(importlib.import_module(MODULE), self.trigger)
        self.defer(trigger=cls(**self.trigger_kwargs), method_name="resumed")

    async def resumed(self, context: Context, event: Any) -> Any:
        journal(self.resumed_journal, f"resumed {context['ti_id']} {os.getpid()}")
        return event


@contextlib.asynccontextmanager
async def worker_running(store: Store, *dags: DAG, slots: int = 16) -> AsyncIterator[Worker]:
    """A worker in the test's loop, with the DAGs recorded (no runs started)."""
    async with run_engine(
        store, dags=dags, slots=slots, triggerer=False, scheduler=False
    ) as engine:
        yield engine.worker


async def start_run(store: Store, dag: DAG, run_id: str = "r1") -> None:
    await store.create_dag_run(dag.dag_id, run_id, logical_date=await store.now())


async def tis_of(store: Store, dag_id: str) -> dict[str, TaskInstance]:
    return {ti.task_id: ti for ti in await store.list_task_instances(dag_id=dag_id)}
