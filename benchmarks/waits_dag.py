"""What the waits benchmark runs inside the engine: a timer trigger that stamps when it fired,
and an operator that defers on it and records when it resumed.

Kept apart from :mod:`benchmarks.waits` so triggerers and workers import only this light
module (no click, no rich): their memory per wait is what the benchmark measures.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from operators.base import BaseOperator, Context
from triggers.base import TriggerEvent
from triggers.temporal import DateTimeTrigger

__all__ = ["DAG_ID", "SENSOR_POOL", "StampedTimerTrigger", "WaitOperator", "dag_file_source"]

DAG_ID = "bench_waits"

_journal_fd: dict[str, int] = {}


class StampedTimerTrigger(DateTimeTrigger):
    """The built-in :class:`DateTimeTrigger`, whose event also says when it fired."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "benchmarks.waits_dag.StampedTimerTrigger",
            {"moment": self.moment, "end_from_trigger": False},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        delay = (self.moment - dt.datetime.now(dt.UTC)).total_seconds()
        if delay > 0:
            await asyncio.sleep(delay)
        yield TriggerEvent({"due": self.moment.timestamp(), "fired": time.time()})


def _journal(folder: str, line: str) -> None:
    """Append one line to this process's journal (one O_APPEND write, no buffering)."""
    fd = _journal_fd.get(folder)
    if fd is None:
        path = os.path.join(folder, f"resumed-{os.getpid()}.log")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _journal_fd[folder] = fd
    os.write(fd, line.encode())


class WaitOperator(BaseOperator):
    """Defers on a timer due at ``t0 + seq / distinct * window`` (from the run's conf)."""

    def __init__(self, *, index: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.index = index

    async def execute(self, context: Context) -> None:
        conf = context["conf"]
        seq = conf["chunk"] * conf["chunk_size"] + self.index
        distinct = conf["distinct"]
        due = conf["t0"] + (seq % distinct) / distinct * conf["window"]
        self.defer(
            trigger=StampedTimerTrigger(dt.datetime.fromtimestamp(due, dt.UTC)),
            method_name="resumed",
            timeout=conf.get("timeout_s"),
        )

    async def resumed(self, context: Context, event: dict[str, float]) -> dict[str, float]:
        started = time.time()
        _journal(
            context["conf"]["journal"],
            f"{context['ti_id']} {event['due']!r} {event['fired']!r} {started!r}\n",
        )
        return {"due": event["due"], "fired": event["fired"], "resumed": started}


#: The pool of the waiting tasks with ``bench waits --pools`` (it counts deferred tasks).
SENSOR_POOL = "sensors"


def dag_file_source(chunk_size: int, *, pool: str | None = None) -> str:
    """A DAG file with ``chunk_size`` waiting tasks; each DAG run is one chunk of the waits.
    ``pool``: the tasks' pool (None: the default pool)."""
    pool_arg = "" if pool is None else f", pool={pool!r}"
    return (
        "from engine import DAG\n"
        "from benchmarks.waits_dag import DAG_ID, WaitOperator\n\n"
        "with DAG(dag_id=DAG_ID):\n"
        f"    for i in range({chunk_size}):\n"
        f"        WaitOperator(task_id=f'w{{i:05d}}', index=i{pool_arg})\n"
    )
