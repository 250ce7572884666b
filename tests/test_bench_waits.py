"""The waits benchmark's DAG file: with ``--pools`` its waiting tasks name the pool the run
creates (the run itself takes minutes and real processes: run by hand, figures in
docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.waits_dag import DAG_ID, SENSOR_POOL, dag_file_source
from engine.dags.dagbag import DagBag


@pytest.mark.parametrize("pool", [None, SENSOR_POOL], ids=["default", "pools"])
def test_the_waiting_tasks_name_the_pool_asked_for(tmp_path: Path, pool: str | None) -> None:
    (tmp_path / "bench_waits_dag.py").write_text(dag_file_source(3, pool=pool))
    dag = DagBag(tmp_path).collect()[DAG_ID]
    tasks = dag.serialize_tasks()
    assert len(tasks) == 3
    assert {t["pool"] for t in tasks} == {pool or "default_pool"}
