"""Starting another DAG's run from a running task: what ``TriggerDagRunOperator`` asks its
``ti`` for (``await context["ti"].trigger_dag_run(...)``), done with the worker's store.

The run is created as ``deferral dags trigger`` creates one (a manual run behind the DAG's
``max_active_runs``, its data interval from the DAG's schedule). A run of that id that exists
already is cleared with ``reset`` (the store's clear: every task instance of it runs again,
and the run too if it had ended), else left alone and reported.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from engine.client.runs import create_manual_run
from engine.store import DuplicateRun
from engine.store.models import NewRun

if TYPE_CHECKING:
    from engine.store import Store

__all__ = ["trigger_dag_run"]


async def trigger_dag_run(
    store: Store,
    by: str,
    dag_id: str,
    *,
    run_id: str | None,
    conf: dict[str, Any],
    logical_date: dt.datetime | None,
    reset: bool,
) -> dict[str, Any]:
    """Create run ``run_id`` (None: ``manual__<logical date>``) of ``dag_id``; ``by`` names
    the task doing it (for the audit of a reset). Returns ``run_id``, ``logical_date``,
    ``state`` and ``existed`` (a run of that id was there: with ``reset`` it was cleared,
    else nothing was done). LookupError for an unknown DAG."""
    when = logical_date or await store.now()
    new = NewRun(
        dag_id=dag_id,
        run_id=run_id or "",
        logical_date=when,
        data_interval_start=when,
        data_interval_end=when,
        run_type="manual",
        conf=conf,
    )
    try:
        created_id, state = await create_manual_run(store, new)
    except DuplicateRun:
        if not run_id:
            raise
    else:
        run = await store.get_dag_run(dag_id, created_id)
        return {
            "run_id": created_id,
            "logical_date": run.logical_date if run is not None else when,
            "state": state,
            "existed": False,
        }
    existing = await store.get_dag_run(dag_id, run_id)
    if existing is None:  # (it went between the insert and this read)
        raise LookupError(f"DAG {dag_id} has no run {run_id!r} to reset")
    state = existing.state
    if reset:
        tis = await store.list_task_instances(dag_id=dag_id, run_id=run_id)
        await store.clear_tasks(
            [ti.id for ti in tis], who=by, via="TriggerDagRunOperator (reset_dag_run)"
        )
        run = await store.get_dag_run(dag_id, run_id)
        state = run.state if run is not None else state
    return {
        "run_id": run_id,
        "logical_date": existing.logical_date,
        "state": state,
        "existed": True,
    }
