"""The view ``deferral_run_states``: what code outside the engine reads (the external task
trigger first), documented column by column, and the only relation its queries name."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import asyncpg
import pytest

from engine import DAG
from engine.store import Store
from operators.python import PythonOperator
from triggers.base import TaskFailedEvent
from triggers.external_task import TaskStateTrigger
from triggers.sqlfiles import load_queries

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "reference" / "triggers-and-sensors.md"
VIEW = "deferral_run_states"


def _documented_columns() -> list[tuple[str, str]]:
    text = DOC.read_text()
    block = text.split("<!-- run-states-columns:")[1].split("<!-- /run-states-columns -->")[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| `([a-z ]+)` \|", block, re.MULTILINE)
    assert rows, "the column table of the view is missing from the docs"
    return rows


async def test_the_documented_columns_are_the_views(db_url: str) -> None:
    conn = await asyncpg.connect(db_url)
    try:
        rows = await conn.fetch(
            """SELECT a.attname, format_type(a.atttypid, a.atttypmod) AS type
               FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
               WHERE c.relname = $1 AND c.relkind = 'v' AND a.attnum > 0
               ORDER BY a.attnum""",
            VIEW,
        )
    finally:
        await conn.close()
    assert [(r["attname"], r["type"]) for r in rows] == _documented_columns()


async def test_the_external_task_queries_read_the_view_and_nothing_else(db_url: str) -> None:
    named = {
        name
        for sql in load_queries("external_task.sql").values()
        for name in re.findall(r"\bdeferral_[a-z_]+\b", sql)
    }
    assert named == {VIEW}
    conn = await asyncpg.connect(db_url)
    try:
        kinds = await conn.fetch(
            "SELECT relname, relkind::text FROM pg_class WHERE relname = ANY ($1::text[])",
            sorted(named),
        )
    finally:
        await conn.close()
    assert {r["relname"]: r["relkind"] for r in kinds} == {VIEW: "v"}


async def test_nearest_runs_does_not_read_the_task_instances(db_url: str) -> None:
    # task_states is a subquery in the view's select list: a query that does not select it
    # must not pay for it (the planner drops unused columns of a view).
    sql = load_queries("external_task.sql")["nearest_runs"]
    conn = await asyncpg.connect(db_url)
    try:
        plan = await conn.fetchval(
            f"EXPLAIN (FORMAT JSON) {sql}", "d", dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        )
    finally:
        await conn.close()
    assert "deferral_task_instances" not in json.dumps(json.loads(plan))


async def test_task_state_trigger_sees_runs_and_task_states_through_the_view(
    store: Store, db_url: str
) -> None:
    moment = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    with DAG(dag_id="upstream_dag") as dag:
        PythonOperator(task_id="a", python_callable=lambda: 1)
        PythonOperator(task_id="b", python_callable=lambda: 2)
    await store.upsert_dag(dag.dag_id, "upstream_dag.py", dag.serialize_tasks(), None)
    await store.create_dag_run("upstream_dag", "first", logical_date=moment)
    await store.create_dag_run("upstream_dag", "second", logical_date=moment)

    waiting = TaskStateTrigger("upstream_dag", "a", moment, conn=db_url, states=["scheduled"])
    event = await waiting.check()
    assert event == {
        "dag_id": "upstream_dag",
        "task_id": "a",
        "run_id": "second",
        "state": "scheduled",
    }
    assert await TaskStateTrigger("upstream_dag", "nope", moment, conn=db_url).check() is None
    run = TaskStateTrigger("upstream_dag", None, moment, conn=db_url, states=["running"])
    assert (await run.check())["run_id"] == "second"
    elsewhere = moment + dt.timedelta(days=1)
    missing = TaskStateTrigger("upstream_dag", "a", elsewhere, conn=db_url, check_existence=True)
    ended = await missing.check()
    assert isinstance(ended, TaskFailedEvent)
    assert "nearest runs are at 2026-03-01T00:00:00+00:00" in str(ended.payload)
