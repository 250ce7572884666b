"""A deferred task's log tells its wait (issue 23, item 5): when it deferred (to which
trigger, its kwargs with secrets masked, its timeout), when its trigger fired (and what it
sent, masked), where it resumed; and the task page shows the trigger's own lines after it
fired."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine import DAG
from engine.store import Store
from engine.testing import run_engine
from engine.web.app import make_app
from tests.log_triggers import KeyedOperator

pytestmark = pytest.mark.anyio

SECRET = "hunter2-s3cr3t"


async def test_a_deferred_try_s_log_says_when_it_deferred_fired_and_resumed(
    store: Store,
) -> None:
    with DAG(dag_id="keyed") as dag:
        KeyedOperator(task_id="wait")
    async with run_engine(store, dags=[dag]) as engine:
        tis = await engine.run_dag(dag, "r1")
    assert tis["wait"]["state"] == "success"

    logs = await store.task_logs("keyed", "r1", "wait")
    messages = [line.message for line in logs.lines]
    assert not any(SECRET in m for m in messages), messages
    (deferred,) = [m for m in messages if m.startswith("deferred to trigger")]
    assert "tests.log_triggers.KeyedTrigger" in deferred
    assert "timeout 600s" in deferred
    assert "resumes at done" in deferred
    assert '"tag":"wait"' in deferred
    assert '"password":"***"' in deferred
    (fired,) = [m for m in messages if m.startswith("trigger fired at")]
    assert '"api_key":"***"' in fired
    assert "resuming at done on worker" in fired
    # In order: the deferral, then the resume (one try, its lines in time order).
    assert messages.index(deferred) < messages.index(fired)
    assert all(line.level == "INFO" for line in logs.lines if line.message in (deferred, fired))

    # The trigger's own lines stay linked to the try after it fired: the page shows them.
    (trigger_id,) = logs.trigger_ids
    async with TestClient(TestServer(make_app(store))) as client:
        response = await client.get(
            "/task", params={"dag_id": "keyed", "run_id": "r1", "task_id": "wait"}
        )
        page = await response.text()
    assert response.status == 200, page
    assert f"Log of trigger {trigger_id}" in page
    assert "checking wait" in page
    assert "deferred to trigger tests.log_triggers.KeyedTrigger" in page
    assert SECRET not in page


async def test_an_earlier_try_s_page_shows_the_triggers_it_waited_on(store: Store) -> None:
    """A try the page shows after a retry keeps its trigger's lines."""
    with DAG(dag_id="keyed_retry") as dag:
        KeyedOperator(task_id="wait")
    async with run_engine(store, dags=[dag]) as engine:
        await engine.run_dag(dag, "r1")
    logs = await store.task_logs("keyed_retry", "r1", "wait", 1)
    (trigger_id,) = logs.trigger_ids
    params: dict[str, Any] = {"dag_id": "keyed_retry", "run_id": "r1", "task_id": "wait", "try": 1}
    async with TestClient(TestServer(make_app(store))) as client:
        page = await (await client.get("/task", params=params)).text()
    assert f"Log of trigger {trigger_id}" in page
