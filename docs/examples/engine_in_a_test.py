"""Test a DAG end to end with the in-process engine of ``engine.testing``.

``run_engine(store)`` starts a scheduler, a worker and a triggerer in the test's event loop
on the store's database; ``run_dag`` runs a DAG to its end, ``drain`` runs until nothing is
runnable now (it does not wait for triggers to fire) and ``wait_for_state`` waits for one
task instance. In a pytest file (with anyio's plugin and a ``store`` fixture that connects
to a fresh database, as ``Store.connect(url)``)::

    @pytest.mark.anyio
    async def test_pipeline(store):
        await check_pipeline(store, tmp_path / "ready")

(This folder is also a DAGs folder: importing this file defines no DAG.)
"""

from __future__ import annotations

from pathlib import Path

import anyio

from engine import DAG
from engine.store import Store
from engine.testing import run_engine
from operators.python import PythonOperator
from operators.sensors import FileSensor


def add(a: int, b: int) -> int:
    return a + b


def build(flag: Path) -> DAG:
    with DAG(dag_id="example_pipeline") as dag:
        first = PythonOperator(task_id="first", python_callable=add, op_args=[1, 2])
        second = PythonOperator(task_id="second", python_callable=add, op_args=[3, 4])
        wait = FileSensor(task_id="wait", filepath=str(flag), deferrable=True, poke_interval=0.05)
        last = PythonOperator(task_id="last", python_callable=add, op_args=[5, 6])
        first >> second >> wait >> last
    return dag


async def check_pipeline(store: Store, flag: Path) -> None:
    async with run_engine(store) as engine:
        await engine.start_run(build(flag))
        # Everything that can run now runs; the sensor's wait is handed to the triggerer.
        await engine.drain()
        tis = await engine.task_instances("example_pipeline")
        assert tis["first"]["state"] == tis["second"]["state"] == "success"
        assert tis["wait"]["state"] == "deferred"
        assert tis["last"]["state"] == "pending"
        # The world changes: the trigger fires, the sensor resumes, the run ends.
        await anyio.Path(flag).touch()
        await engine.wait_for_state("example_pipeline", "wait", "success")
        tis = await engine.finish("example_pipeline")
        assert tis["__run__"]["state"] == "success"
        assert tis["last"]["state"] == "success"
