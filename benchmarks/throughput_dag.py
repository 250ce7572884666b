"""What the throughput benchmark runs inside the engine: a no-op task, and a task that defers
once on a timer already due and resumes to a no-op that journals when it started.

Kept apart from :mod:`benchmarks.throughput` so workers import only this light module (no
click, no rich, no pgqueuer).
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from benchmarks.waits_dag import StampedTimerTrigger, _journal
from operators.base import BaseOperator, Context

__all__ = ["CYCLES_DAG_ID", "TASKS_DAG_ID", "DeferOnceOperator", "NoopOperator", "dag_file_source"]

TASKS_DAG_ID = "bench_throughput_tasks"
CYCLES_DAG_ID = "bench_throughput_cycles"


class NoopOperator(BaseOperator):
    """Does nothing: what is measured is the engine's cost of a task (claim, run, finish)."""

    async def execute(self, context: Context) -> None:
        return None


class DeferOnceOperator(BaseOperator):
    """Defers on a timer due now (it fires at once) and resumes to a no-op.

    The trigger's event carries the time ``execute`` deferred (``due``) and the time the
    trigger fired; the resumed method appends ``ti_id due fired started`` to the run's
    journal (one line per resume: the benchmark counts lost and doubled resumes)."""

    async def execute(self, context: Context) -> None:
        self.defer(
            trigger=StampedTimerTrigger(dt.datetime.fromtimestamp(time.time(), dt.UTC)),
            method_name="resumed",
        )

    async def resumed(self, context: Context, event: dict[str, Any]) -> None:
        started = time.time()
        _journal(
            context["conf"]["journal"],
            f"{context['ti_id']} {event['due']!r} {event['fired']!r} {started!r}\n",
        )


def dag_file_source(tasks_chunk: int, cycles_chunk: int) -> str:
    """A DAG file with the two DAGs, of ``tasks_chunk`` no-op tasks and ``cycles_chunk``
    deferring ones (independent tasks); a DAG run is one chunk of the N tasks (or cycles)."""
    return (
        "from engine import DAG\n"
        "from benchmarks.throughput_dag import (\n"
        "    CYCLES_DAG_ID, TASKS_DAG_ID, DeferOnceOperator, NoopOperator,\n"
        ")\n\n"
        "with DAG(dag_id=TASKS_DAG_ID):\n"
        f"    for i in range({tasks_chunk}):\n"
        "        NoopOperator(task_id=f't{i:05d}')\n\n"
        "with DAG(dag_id=CYCLES_DAG_ID):\n"
        f"    for i in range({cycles_chunk}):\n"
        "        DeferOnceOperator(task_id=f'd{i:05d}')\n"
    )
