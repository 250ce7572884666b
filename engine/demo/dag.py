"""The demo DAG: a fleet of deferrable timer sensors and submit-and-wait jobs, each followed
by a small compute task, on a worker with a few slots.

:func:`add_demo_tasks` takes the sizes as arguments: ``deferral demo`` writes a DAG file that
calls it with the sizes asked for (:func:`dag_file_source`; no environment variable carries
them), and the bundled ``dags/deferral_demo.py`` calls it with the defaults. Timers fire
between ``window_s`` and ``2 * window_s`` seconds after the run's logical date.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from engine.demo.jobs import SubmitAndWait
from operators.base import Context
from operators.python import PythonOperator
from operators.sensors import TimeDeltaSensor

__all__ = [
    "DAG_ID",
    "DEFAULT_JOBS",
    "DEFAULT_SENSORS",
    "DEFAULT_WINDOW_S",
    "DESCRIPTION",
    "add_demo_tasks",
    "dag_file_source",
]

DEFAULT_SENSORS = 300
DEFAULT_JOBS = 20
DEFAULT_WINDOW_S = 10.0


class DemoTimerSensor(TimeDeltaSensor):
    """A TimeDeltaSensor whose resumed method reports when it started, against its due time."""

    def execute_complete(self, context: Context, event: Any = None) -> dict[str, float]:
        resumed = time.time()
        return {"due": self.target(context).timestamp(), "resumed": resumed}


def crunch(n: int) -> int:
    """A little compute for the downstream task."""
    return sum(i * i for i in range(1000 + n))


DAG_ID = "deferral_demo"
DESCRIPTION = "Deferrable sensors on a few worker slots"


def add_demo_tasks(
    *,
    sensors: int = DEFAULT_SENSORS,
    jobs: int = DEFAULT_JOBS,
    window_s: float = DEFAULT_WINDOW_S,
) -> None:
    """Add ``sensors`` timer sensors and ``jobs`` submit-and-wait jobs to the DAG whose
    ``with`` block is open (a DAG belongs to the file whose code opened it)."""
    for i in range(sensors):
        delay = window_s * (1 + i / max(sensors, 1))
        wait = DemoTimerSensor(
            task_id=f"wait_{i:04d}",
            delta=dt.timedelta(seconds=delay),
            deferrable=True,
            timeout=delay + 120,
        )
        wait >> PythonOperator(task_id=f"process_{i:04d}", python_callable=crunch, op_args=[i])
    for j in range(jobs):
        job = SubmitAndWait(task_id=f"job_{j:03d}", duration_s=3 + (j * 7) % 10)
        job >> PythonOperator(task_id=f"load_{j:03d}", python_callable=crunch, op_args=[j])


def dag_file_source(*, sensors: int, jobs: int, window_s: float) -> str:
    """A DAG file defining the demo DAG at these sizes."""
    return (
        '"""The deferral demo DAG, written by ``deferral demo``."""\n\n'
        "from engine import DAG\n"
        "from engine.demo.dag import DAG_ID, DESCRIPTION, add_demo_tasks\n\n"
        "with DAG(dag_id=DAG_ID, description=DESCRIPTION):\n"
        f"    add_demo_tasks(sensors={int(sensors)!r}, jobs={int(jobs)!r}, "
        f"window_s={float(window_s)!r})\n"
    )
