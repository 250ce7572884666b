"""The demo DAG: a fleet of deferrable timer sensors and submit-and-wait jobs, each followed
by a small compute task, on a worker with a few slots.

Sizes come from the environment (``deferral demo`` sets them): DEFERRAL_DEMO_SENSORS,
DEFERRAL_DEMO_JOBS and DEFERRAL_DEMO_WINDOW_S (timers fire between WINDOW and 2*WINDOW
seconds after the run's logical date).
"""

from __future__ import annotations

import datetime as dt
import os
import time
from typing import Any

from engine import DAG
from engine.demo.jobs import SubmitAndWait
from operators.base import Context
from operators.python import PythonOperator
from operators.sensors import TimeDeltaSensor

SENSORS = int(os.environ.get("DEFERRAL_DEMO_SENSORS", "300"))
JOBS = int(os.environ.get("DEFERRAL_DEMO_JOBS", "20"))
WINDOW_S = float(os.environ.get("DEFERRAL_DEMO_WINDOW_S", "10"))


class DemoTimerSensor(TimeDeltaSensor):
    """A TimeDeltaSensor whose resumed method reports when it started, against its due time."""

    def execute_complete(self, context: Context, event: Any = None) -> dict[str, float]:
        resumed = time.time()
        return {"due": self.target(context).timestamp(), "resumed": resumed}


def crunch(n: int) -> int:
    """A little compute for the downstream task."""
    return sum(i * i for i in range(1000 + n))


with DAG(dag_id="deferral_demo", description="Deferrable sensors on a few worker slots"):
    for i in range(SENSORS):
        delay = WINDOW_S * (1 + i / max(SENSORS, 1))
        wait = DemoTimerSensor(
            task_id=f"wait_{i:04d}",
            delta=dt.timedelta(seconds=delay),
            deferrable=True,
            timeout=delay + 120,
        )
        wait >> PythonOperator(task_id=f"process_{i:04d}", python_callable=crunch, op_args=[i])
    for j in range(JOBS):
        job = SubmitAndWait(task_id=f"job_{j:03d}", duration_s=3 + (j * 7) % 10)
        job >> PythonOperator(task_id=f"load_{j:03d}", python_callable=crunch, op_args=[j])
