"""TriggerDagRunOperator on a real engine: a run of another DAG is created with its templated
conf and id, its id pushed as XCom; waiting deferred (one worker slot: the parent holds none
while the child runs) and not deferred, for a child that succeeds and one that fails (the
parent's error names the child's run); an existing run is reset or refused."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from engine import DAG
from engine.store import Store
from engine.testing import run_engine
from operators.python import PythonOperator
from operators.trigger_dagrun import TriggerDagRunOperator
from triggers.base import decode_value

pytestmark = pytest.mark.anyio

LOGICAL = dt.datetime(2026, 12, 1, 6, 0, tzinfo=dt.UTC)


def _child(dag_id: str, *, fail: bool = False) -> DAG:
    def work(dag_run: Any) -> Any:
        if fail:
            raise RuntimeError("the child's work failed")
        return dag_run.conf.get("n")

    with DAG(dag_id=dag_id) as dag:
        PythonOperator(task_id="work", python_callable=work)
    return dag


def _parent(dag_id: str, child: str, **options: Any) -> DAG:
    def after(ti: Any) -> Any:
        return ti.xcom_pull(task_ids="trigger", key="trigger_run_id")

    with DAG(dag_id=dag_id) as dag:
        TriggerDagRunOperator(
            task_id="trigger",
            trigger_dag_id=child,
            poke_interval=0.05,
            **options,
        ) >> PythonOperator(task_id="after", python_callable=after)
    return dag


async def _run(store: Store, parent: DAG, child: DAG, **engine: Any) -> dict[str, Any]:
    async with run_engine(store, **engine) as running:
        await running.add_dag(child)
        await running.start_run(parent, logical_date=LOGICAL)
        tis = await running.finish(parent.dag_id)
        tis["__fired__"] = running.triggerer.fired
        return tis


@pytest.mark.parametrize("deferrable", [True, False])
async def test_the_parent_waits_for_a_child_that_succeeds(store: Store, deferrable: bool) -> None:
    child = _child(f"child_ok_{deferrable}")
    parent = _parent(
        f"parent_ok_{deferrable}",
        child.dag_id,
        trigger_run_id="from_{{ run_id }}",
        conf={"n": "{{ ds }}"},
        wait_for_completion=True,
        deferrable=deferrable,
    )
    # One slot: a deferred parent holds none, so the child's task can run.
    tis = await _run(store, parent, child, slots=1 if deferrable else 2)
    assert tis["trigger"]["state"] == "success", tis["trigger"]["error"]
    assert decode_value(tis["after"]["result"]) == "from_run1"
    child_run = await store.get_dag_run(child.dag_id, "from_run1")
    assert child_run is not None
    assert child_run.state == "success"
    assert child_run.conf == {"n": "2026-12-01"}
    assert child_run.run_type == "manual"
    child_tis = await store.list_task_instances(dag_id=child.dag_id, run_id="from_run1")
    assert [decode_value(t.result) for t in child_tis] == ["2026-12-01"]
    assert (tis["__fired__"] >= 1) is deferrable
    assert tis["trigger"]["try_number"] == 1


@pytest.mark.parametrize("deferrable", [True, False])
async def test_a_child_that_fails_fails_the_parent_naming_its_run(
    store: Store, deferrable: bool
) -> None:
    child = _child(f"child_bad_{deferrable}", fail=True)
    parent = _parent(
        f"parent_bad_{deferrable}",
        child.dag_id,
        trigger_run_id="child_of_{{ run_id }}",
        wait_for_completion=True,
        deferrable=deferrable,
    )
    tis = await _run(store, parent, child, slots=1 if deferrable else 2)
    assert tis["trigger"]["state"] == "failed"
    assert "child_of_run1" in tis["trigger"]["error"]
    assert "failed" in tis["trigger"]["error"]
    assert tis["after"]["state"] == "upstream_failed"
    child_run = await store.get_dag_run(child.dag_id, "child_of_run1")
    assert child_run is not None
    assert child_run.state == "failed"


async def test_without_waiting_the_parent_ends_at_once_with_a_generated_run_id(
    store: Store,
) -> None:
    child = _child("child_nowait")
    parent = _parent("parent_nowait", child.dag_id, logical_date="2026-11-30T00:00:00+00:00")
    tis = await _run(store, parent, child)
    assert tis["trigger"]["state"] == "success"
    run_id = decode_value(tis["after"]["result"])
    assert run_id == "manual__2026-11-30T00:00:00+00:00"
    child_run = await store.get_dag_run(child.dag_id, run_id)
    assert child_run is not None
    assert child_run.logical_date == dt.datetime(2026, 11, 30, tzinfo=dt.UTC)


async def test_an_existing_run_is_reset_or_refused(store: Store) -> None:
    child = _child("child_again")
    first = _parent("parent_first", child.dag_id, trigger_run_id="fixed", wait_for_completion=True)
    refused = _parent("parent_refused", child.dag_id, trigger_run_id="fixed")
    skipped = _parent(
        "parent_skipped", child.dag_id, trigger_run_id="fixed", skip_when_already_exists=True
    )
    reset = _parent(
        "parent_reset",
        child.dag_id,
        trigger_run_id="fixed",
        reset_dag_run=True,
        wait_for_completion=True,
        deferrable=True,
    )
    async with run_engine(store) as engine:
        await engine.add_dag(child)
        for dag in (first, refused, skipped, reset):
            await engine.start_run(dag, logical_date=LOGICAL)
            tis = await engine.finish(dag.dag_id)
            if dag is first:
                assert tis["trigger"]["state"] == "success"
            elif dag is refused:
                assert tis["trigger"]["state"] == "failed"
                assert "already has a run 'fixed': reset_dag_run=True" in tis["trigger"]["error"]
            elif dag is skipped:
                assert tis["trigger"]["state"] == "skipped"
            else:
                assert tis["trigger"]["state"] == "success", tis["trigger"]["error"]
    child_tis = await store.list_task_instances(dag_id=child.dag_id, run_id="fixed")
    assert [(t.state, t.try_number) for t in child_tis] == [("success", 2)]  # ran again


async def test_an_unknown_dag_fails_the_task_saying_so(store: Store) -> None:
    parent = _parent("parent_unknown", "no_such_dag")
    async with run_engine(store) as engine:
        await engine.start_run(parent, logical_date=LOGICAL)
        tis = await engine.finish(parent.dag_id)
    assert tis["trigger"]["state"] == "failed"
    assert "no_such_dag" in tis["trigger"]["error"]


def test_bad_arguments_are_a_dag_files_error() -> None:
    with pytest.raises(ValueError, match="not run states"):
        TriggerDagRunOperator(task_id="t", trigger_dag_id="x", allowed_states=["done"])
    with pytest.raises(ValueError, match="overlap"):
        TriggerDagRunOperator(task_id="t", trigger_dag_id="x", failed_states=["success"])
    with pytest.raises(ValueError, match="trigger_dag_id must be a non-empty str"):
        TriggerDagRunOperator(task_id="t", trigger_dag_id="")
