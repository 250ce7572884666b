"""A deferred task's log tells its wait (issue 23, item 5): when it deferred (to which
trigger, its kwargs with secrets masked, its timeout), when its trigger fired (and what it
sent, masked), where it resumed; and the task page shows the trigger's own lines after it
fired."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine import DAG
from engine.store import Store
from engine.testing import run_engine
from engine.web.app import make_app
from operators.base import BaseOperator, Context
from tests.log_triggers import ChattyOperator, KeyedOperator
from tests.triggers_for_tests import RaisingTrigger

pytestmark = pytest.mark.anyio

SECRET = "hunter2-s3cr3t"


class DefersOnARaisingTrigger(BaseOperator):
    def execute(self, context: Context) -> None:
        self.defer(trigger=RaisingTrigger("the remote API is gone"), method_name="done")

    def done(self, context: Context, event: Any) -> Any:  # pragma: no cover - never resumes
        return event


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
    # The trigger's line, written as it fired: what it sent (masked), where the try resumes.
    (fired,) = [m for m in messages if m.startswith("trigger ") and " fired with event " in m]
    assert "(tests.log_triggers.KeyedTrigger)" in fired
    assert '"api_key":"***"' in fired
    assert "the try resumes at done" in fired
    # The claim's line: where it resumed and how long after the trigger fired.
    (resumed,) = [m for m in messages if m.startswith("resuming at done on worker")]
    assert "s after its trigger fired" in resumed
    # In order: the deferral, the trigger firing, the resume (one try, its lines in time
    # order), then what the resumed method logged.
    assert messages.index(deferred) < messages.index(fired) < messages.index(resumed)
    lines = {line.message: line for line in logs.lines}
    assert all(lines[m].level == "INFO" for m in (deferred, fired, resumed))
    assert lines[fired].logger == "engine.triggerer"

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


async def test_the_wait_s_lines_sit_between_what_the_try_logged_before_and_after_it(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    # The deferral's line is written with the deferral, the trigger's as it fires, the
    # resume's with the claim: what the try logged before deferring is stored first (before
    # the deferral is written), what the resumed method logs comes last.
    caplog.set_level(logging.INFO, logger="tests.log_triggers")
    with DAG(dag_id="chatty") as dag:
        ChattyOperator(task_id="wait")
    async with run_engine(store, dags=[dag]) as engine:
        tis = await engine.run_dag(dag, "r1")
    assert tis["wait"]["state"] == "success"
    messages = [line.message for line in (await store.task_logs("chatty", "r1", "wait")).lines]

    def at(prefix: str) -> int:
        (index,) = [i for i, m in enumerate(messages) if m.startswith(prefix)]
        return index

    assert (
        at("hello from execute")
        < at("deferred to trigger tests.log_triggers.ChattyTrigger")
        < at("trigger ")
        < at("resuming at done on worker")
        < at("hello from the resumed method")
    ), messages


async def test_a_trigger_that_fails_its_try_says_so_in_the_try_s_log(store: Store) -> None:
    with DAG(dag_id="fails_log") as dag:
        DefersOnARaisingTrigger(task_id="t")
    async with run_engine(store, dags=[dag]) as engine:
        tis = await engine.run_dag(dag, "r1")
    assert tis["t"]["state"] == "failed"
    lines = (await store.task_logs("fails_log", "r1", "t")).lines
    (failed,) = [line for line in lines if " failed the try: " in line.message]
    assert failed.level == "ERROR"
    assert failed.logger == "engine.triggerer"
    assert "RaisingTrigger" in failed.message
    assert "RuntimeError: the remote API is gone" in failed.message
    assert not any(line.message.startswith("resuming at") for line in lines)


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
