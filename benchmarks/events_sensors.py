"""The events benchmark's other half (see :mod:`benchmarks.events`): the same fleet done by
deferrable sensors that poll, imported only when it runs.

One DAG run holds one sensor task per source (as many as the watcher half's watchers). Each
sensor checks its source once on the worker, then defers to a polling trigger (the engine's
:class:`triggers.polling.PollingTrigger`, checking every ``poke_interval`` seconds on the
triggerer, each from a random phase); when its source holds an event the trigger fires and the
sensor's task resumes on the worker (``execute_complete``), which notes when. The source is
the same kind as the watchers': an in-process mailbox the driver writes to, so the difference
measured is the waiting model's, not the source's. A sensor serves one event and ends, so
the driver sends one event to each sensor, in random order, at the same rate.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from rich.console import Console

from benchmarks.events_run import IDLE_S, _background, _commits
from benchmarks.fleet_run import _machine
from benchmarks.schedule_run import _ms
from engine.config import load_settings
from engine.dags.dag import DAG
from engine.store import Store, database_url
from engine.store.databases import create_database, drop_database
from engine.testing import run_engine
from operators.base import Context
from operators.sensors.base import BaseSensorOperator
from triggers.base import BaseTrigger, TriggerEvent
from triggers.polling import PollingTrigger

__all__ = ["MailboxSensor", "MailboxTrigger", "run_sensors"]

console = Console(stderr=True)

#: Each sensor's outside source: the driver puts the event's send time (perf_counter) there.
MAILBOX: dict[str, float] = {}
#: Sources whose trigger is running on the triggerer (armed).
ARMED: set[str] = set()
#: When each sensor's task resumed on the worker after its trigger fired: key -> perf_counter.
RESUMED: dict[str, float] = {}


class MailboxTrigger(PollingTrigger):
    """Fires when ``MAILBOX[key]`` holds an event; checks every ``poll_interval`` seconds."""

    def __init__(self, key: str, *, poll_interval: float, end_from_trigger: bool = False) -> None:
        super().__init__(poll_interval=poll_interval, end_from_trigger=end_from_trigger)
        self.key = key

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "benchmarks.events_sensors.MailboxTrigger",
            {"key": self.key, **self._base_kwargs()},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # (On the triggerer; the worker's first check calls check() only.) The first wait is
        # a random part of the interval: a fleet whose sensors are armed again after each
        # event polls at every phase, not all at the moment the benchmark armed them.
        ARMED.add(self.key)
        await asyncio.sleep(random.uniform(0, self.poll_interval))
        async for event in super().run():
            yield event

    async def check(self) -> Any:
        sent = MAILBOX.get(self.key)
        return None if sent is None else {"sent": sent}


class MailboxSensor(BaseSensorOperator):
    """A deferrable sensor on one mailbox; its task notes when it resumed."""

    def __init__(self, *, key: str, **kwargs: Any) -> None:
        super().__init__(deferrable=True, **kwargs)
        self.key = key

    def trigger(self, context: Context) -> BaseTrigger:
        return MailboxTrigger(self.key, **self.trigger_kwargs())

    def execute_complete(self, context: Context, event: Any = None) -> Any:
        RESUMED.setdefault(self.key, time.perf_counter())
        return event


def run_sensors(
    *, sources: int, rate: float, poke_interval: float, keep_db: bool
) -> dict[str, Any]:
    return asyncio.run(_run(sources, rate, poke_interval, keep_db))


async def _run(sources: int, rate: float, poke_interval: float, keep_db: bool) -> dict[str, Any]:
    settings = load_settings()
    admin = await asyncio.to_thread(database_url, settings)
    db_name = f"bench_sensors_{uuid.uuid4().hex[:12]}"
    url = await create_database(admin, db_name)
    store = await Store.connect(url, pool_size=4)
    MAILBOX.clear()
    ARMED.clear()
    RESUMED.clear()
    keys = [f"s{i:05d}" for i in range(sources)]
    try:
        with DAG("bench_sensors", schedule=None, fileloc=__file__) as dag:
            for key in keys:
                MailboxSensor(task_id=key, key=key, poke_interval=poke_interval)
        async with run_engine(
            store, dags=[dag], capacity=sources + 10, poll_interval_s=1.0, slots=16
        ) as engine:
            load_before = os.getloadavg()[0]
            commits_before = await _commits(url, db_name)
            armed_at = time.perf_counter()
            await engine.start_run(dag, "bench")
            with console.status(f"arming {sources:,} sensors (poll every {poke_interval:g} s)"):
                deadline = time.perf_counter() + 600
                while True:
                    if len(ARMED) >= sources:
                        break
                    if time.perf_counter() > deadline:
                        raise RuntimeError(
                            f"only {len(ARMED):,} of {sources:,} sensors deferred in 10 minutes"
                        )
                    await asyncio.sleep(0.1)
            arming_s = time.perf_counter() - armed_at
            commits_armed = await _commits(url, db_name)
            with console.status(f"{IDLE_S:g} s without events (background transactions)"):
                background = await _background(url, db_name)
            commits_waiting = await _commits(url, db_name)
            driven_at = time.perf_counter()
            sent = await _drive(keys, rate, poke_interval)
            elapsed = time.perf_counter() - driven_at
            # (Less the counts' own transactions.)
            commits_end = await _commits(url, db_name)
            arming = commits_armed - commits_before - 1
            waiting = commits_end - commits_waiting - 1
            load_after = os.getloadavg()[0]
    finally:
        await store.close()
        if not keep_db:
            await drop_database(admin, db_name)
    resumed = [RESUMED[key] - at for key, at in sent.items() if key in RESUMED]
    total = len(sent)
    return {
        "scenario": "events-sensors",
        "poke_interval_s": poke_interval,
        "sensors": sources,
        "rate": rate,
        "events_sent": total,
        "events_reaching_a_task": len(resumed),
        "event_to_sensor_resumed_ms": _ms(resumed),
        "arming_s": round(arming_s, 2),
        "transactions_arming": arming,
        "transactions_waiting": waiting,
        "transactions_per_event": round((arming + waiting) / max(1, total), 3),
        "transactions_waiting_per_event": round(waiting / max(1, total), 3),
        "background_transactions_per_s": background,
        "elapsed_s": round(elapsed, 2),
        "load_1m_before": load_before,
        "load_1m_after": load_after,
        "machine": _machine(),
    }


async def _drive(keys: list[str], rate: float, poke_interval: float) -> dict[str, float]:
    """Send one event to each sensor, in random order, at ``rate``; wait until every sensor
    resumed (or two poll intervals and a minute after the last event)."""
    order = random.sample(keys, len(keys))
    sent: dict[str, float] = {}
    started = time.perf_counter()
    with console.status(f"{len(order):,} events at {rate:g}/s to {len(keys):,} sensors"):
        for i, key in enumerate(order):
            delay = started + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent[key] = MAILBOX[key] = time.perf_counter()
        deadline = time.perf_counter() + 2 * poke_interval + 60
        while True:
            if len(RESUMED) >= len(sent) or time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.05)
    return sent
