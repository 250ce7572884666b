from __future__ import annotations

import pytest

from engine import DAG
from engine.store import Store
from engine.testing import run_engine
from operators.python import PythonOperator

pytestmark = pytest.mark.anyio


def _answer() -> int:
    return 42


async def test_a_python_task_runs_and_its_result_is_stored(store: Store) -> None:
    with DAG(dag_id="smoke") as dag:
        PythonOperator(task_id="answer", python_callable=_answer)
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["__run__"]["state"] == "success"
    assert tis["answer"]["state"] == "success"
