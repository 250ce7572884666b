"""A try ends as one value, whichever way its method ran: the same task run in a worker thread
(a plain ``def``), on the worker's loop (an ``async def``) and in a child process
(``isolation="process"``, both kinds of method) leaves the same recorded row, for every kind
of outcome (engine/worker/outcomes.py)."""

from __future__ import annotations

import datetime as dt
import textwrap
from pathlib import Path
from typing import Any

import pytest

from engine.dags.dagbag import DagBag
from engine.store import Store, TaskInstance
from engine.testing import run_engine
from tests.helpers import wait_until
from triggers.base import decode_value

pytestmark = pytest.mark.anyio

_DAG = """
    import asyncio
    import datetime as dt

    from engine import DAG
    from operators.base import (
        BaseOperator, FailTask, RescheduleRequested, SkipTask, TaskDeferred,
    )
    from triggers.base import SerializedTrigger, validate_trigger
    from triggers.temporal import DateTimeTrigger

    PAST = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    FAR = dt.datetime(2100, 1, 1, 2, tzinfo=dt.timezone(dt.timedelta(hours=2)))


    def end(kind, op, context):
        if kind == "returned":
            return {{"answer": 42, "values": [1, 2.5, "x"], "when": PAST}}
        if kind == "raised":
            raise ValueError("boom")
        if kind == "deferred":  # a trigger that fires in 2100
            op.defer(trigger=DateTimeTrigger(FAR), method_name="resume", kwargs={{"n": 1}},
                     timeout=dt.timedelta(hours=1))
        if kind == "resumed":  # a trigger that fires at once, with the same event for all
            op.defer(trigger=DateTimeTrigger(PAST), method_name="resume", kwargs={{"n": 1}})
        if kind == "rescheduled":
            # (Within ten years: a month after the run's logical date, given at +02:00.)
            at = context["logical_date"] + dt.timedelta(days=30)
            raise RescheduleRequested(at.astimezone(dt.timezone(dt.timedelta(hours=2))))
        if kind == "skipped":
            raise SkipTask("nothing to do")
        if kind == "failed":
            raise FailTask("no point retrying")
        # Deferrals built by hand, bypassing defer()'s checks:
        if kind == "nan_timeout":
            raise TaskDeferred(trigger=validate_trigger(DateTimeTrigger(FAR)),
                               method_name="resume", kwargs={{}}, timeout_s=float("nan"))
        if kind == "unencodable_kwargs":
            raise TaskDeferred(trigger=validate_trigger(DateTimeTrigger(FAR)),
                               method_name="resume", kwargs={{"x": object()}}, timeout_s=None)
        if kind == "unserialized_trigger":  # kwargs left a dict, not encoded
            good = validate_trigger(DateTimeTrigger(FAR))
            trigger = SerializedTrigger(good.classpath, {{"moment": FAR}}, good.dedup_key)
            raise TaskDeferred(trigger=trigger, method_name="resume", kwargs={{}},
                               timeout_s=None)
        if kind == "unstorable":
            return object()
        raise AssertionError(kind)


    class Sync(BaseOperator):
        def __init__(self, *, kind, **kwargs):
            super().__init__(**kwargs)
            self.kind = kind

        def execute(self, context):
            return end(self.kind, self, context)

        def resume(self, context, event, n):
            return {{"event": event, "n": n}}


    class Async(Sync):
        async def execute(self, context):
            await asyncio.sleep(0)
            return end(self.kind, self, context)

        async def resume(self, context, event, n):
            await asyncio.sleep(0)
            return {{"event": event, "n": n}}


    with DAG({dag_id!r}):
        for task_id, cls, isolation in (
            ("thread", Sync, "none"),
            ("loop", Async, "none"),
            ("child", Sync, "process"),
            ("child_async", Async, "process"),
        ):
            cls(task_id=task_id, kind={kind!r}, isolation=isolation, retries=1,
                retry_delay=dt.timedelta(hours=1))
"""

VARIANTS = ("thread", "loop", "child", "child_async")
PAST = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)


async def _run(
    store: Store, tmp_path: Path, kind: str, settled: str, *, logical_date: dt.datetime = PAST
) -> dict[str, TaskInstance]:
    """Run the four variants of ``kind`` until each is in state ``settled``; their rows."""
    dags = tmp_path / "dags"
    dags.mkdir()
    dag_id = f"outcome_{kind}"
    (dags / "outcome_dag.py").write_text(textwrap.dedent(_DAG.format(dag_id=dag_id, kind=kind)))
    dagbag = DagBag(dags)
    dag = dagbag.get_dag(dag_id)
    assert not dagbag.import_errors, dagbag.import_errors
    await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
    await store.create_dag_run(dag_id, "run1", logical_date=logical_date)
    tis: dict[str, TaskInstance] = {}

    async def all_settled() -> bool:
        nonlocal tis
        tis = {ti.task_id: ti for ti in await store.list_task_instances(dag_id=dag_id)}
        return len(tis) == len(VARIANTS) and all(t.state == settled for t in tis.values())

    async with run_engine(store, dagbag=dagbag, slots=4):
        await wait_until(all_settled, what=f"the {kind} tasks to be {settled}")
    return tis


def _recorded(ti: TaskInstance) -> dict[str, Any]:
    """What the try left, as the four variants must share it."""
    return {
        "state": ti.state,
        "try_number": ti.try_number,
        "result": ti.result,
        # (an error may name its task: each variant is a task of its own)
        "error": None if ti.error is None else ti.error.replace(f".{ti.task_id}:", ".TASK:"),
        "next_method": ti.next_method,
        "trigger_id": ti.trigger_id,
        "retry_at": ti.retry_at,
    }


def _same(tis: dict[str, TaskInstance]) -> dict[str, Any]:
    """The row every variant recorded (asserted equal across them)."""
    rows = {v: _recorded(tis[v]) for v in VARIANTS}
    assert all(rows[v] == rows["thread"] for v in VARIANTS), rows
    return rows["thread"]


async def test_a_returned_value_is_recorded_alike(store: Store, tmp_path: Path) -> None:
    row = _same(await _run(store, tmp_path, "returned", "success"))
    assert row["try_number"] == 1
    assert row["error"] is None
    assert decode_value(row["result"]) == {"answer": 42, "values": [1, 2.5, "x"], "when": PAST}


async def test_a_raised_error_is_recorded_alike(store: Store, tmp_path: Path) -> None:
    tis = await _run(store, tmp_path, "raised", "up_for_retry")
    for variant in VARIANTS:
        ti = tis[variant]
        assert (ti.try_number, ti.result, ti.trigger_id) == (1, None, None), variant
        # The task's traceback: from its own frames down to the error, none of the engine's.
        assert ti.error.startswith("Traceback (most recent call last):"), (variant, ti.error)
        assert ti.error.endswith("ValueError: boom"), (variant, ti.error)
        assert ", in end\n" in ti.error, (variant, ti.error)
        assert "engine/worker" not in ti.error, (variant, ti.error)
    assert len({ti.retry_at is not None for ti in tis.values()}) == 1


async def test_a_deferral_is_recorded_alike(store: Store, tmp_path: Path) -> None:
    tis = await _run(store, tmp_path, "deferred", "deferred")
    row = _same(tis)
    assert row["next_method"] == "resume"
    assert row["try_number"] == 1
    # One trigger for all four (same classpath and kwargs: the same deduplication key).
    trigger = await store.get_trigger(row["trigger_id"])
    assert trigger is not None
    assert trigger.classpath == "triggers.temporal.DateTimeTrigger"
    assert trigger.waiting == len(VARIANTS)
    # The deferral's own timeout (an hour from when each deferred) bounds each wait.
    now = await store.now()
    for variant in VARIANTS:
        ti = tis[variant]
        assert ti.trigger_timeout_at is not None
        assert ti.started_at is not None
        assert ti.started_at + dt.timedelta(hours=1) <= ti.trigger_timeout_at, variant
        assert ti.trigger_timeout_at <= now + dt.timedelta(hours=1), variant


async def test_a_resumed_method_gets_the_same_event_and_kwargs(
    store: Store, tmp_path: Path
) -> None:
    row = _same(await _run(store, tmp_path, "resumed", "success"))
    assert row["try_number"] == 1
    assert decode_value(row["result"]) == {"event": PAST, "n": 1}


async def test_a_reschedule_is_recorded_alike(store: Store, tmp_path: Path) -> None:
    logical_date = (await store.now()).replace(microsecond=0)
    tis = await _run(store, tmp_path, "rescheduled", "up_for_reschedule", logical_date=logical_date)
    row = _same(tis)
    assert row["retry_at"] == logical_date + dt.timedelta(days=30)
    assert row["error"] is None


async def test_a_skip_is_recorded_alike(store: Store, tmp_path: Path) -> None:
    row = _same(await _run(store, tmp_path, "skipped", "skipped"))
    assert (row["try_number"], row["result"], row["error"]) == (1, None, None)


async def test_a_failtask_is_recorded_alike(store: Store, tmp_path: Path) -> None:
    row = _same(await _run(store, tmp_path, "failed", "failed"))
    assert row["try_number"] == 1  # a retry is left, but FailTask does not use it
    assert row["error"] == "FailTask: no point retrying"


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("nan_timeout", "InvalidDeferral: the deferral timeout must be a finite number"),
        ("unencodable_kwargs", "InvalidDeferral: the resume kwargs are not plain data: "),
        ("unserialized_trigger", "InvalidDeferral: the trigger is not a serialized trigger"),
    ],
)
async def test_an_invalid_deferral_is_refused_alike(
    store: Store, tmp_path: Path, kind: str, why: str
) -> None:
    row = _same(await _run(store, tmp_path, kind, "failed"))
    assert row["try_number"] == 1  # refused for good: no retry
    assert row["error"].startswith(f"the task's deferral is invalid: {why}"), row["error"]
    assert await store.list_triggers() == []


async def test_an_unstorable_result_is_refused_alike(store: Store, tmp_path: Path) -> None:
    row = _same(await _run(store, tmp_path, "unstorable", "failed"))
    assert row["try_number"] == 1
    assert row["error"].startswith(
        "task outcome_unstorable.TASK: XCom 'return_value' cannot be stored as its value: the "
        "value is a builtins.object"
    )
