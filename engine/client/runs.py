"""Create DAG runs and wait for them: what ``deferral dags trigger`` and tests use."""

from __future__ import annotations

import datetime as dt
from typing import Any

import anyio
import msgspec

from engine.config import Settings
from engine.dags.dagbag import NO_FOLDER_HINT, DagBag
from engine.runtime.wakeup import Wakeup
from engine.scheduler.dagruns import manual_data_interval
from engine.scheduler.dagsync import request_rescan, sync_dags
from engine.store import CHANNEL_RUNS, Store, TaskInstance, UnknownDag, open_store
from engine.store.models import NewRun

__all__ = ["RunOutcome", "create_manual_run", "trigger_dag", "wait_for_run", "wait_run"]


class RunOutcome(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    state: str
    tasks: list[TaskInstance]


async def wait_for_run(
    store: Store, dag_id: str, run_id: str, timeout_s: float | None = None, *, poll_s: float = 1.0
) -> str:
    """Wait until the run ends (woken by NOTIFY, polling as the backstop); returns its state,
    or ``running`` if ``timeout_s`` passed first."""
    wake = Wakeup()
    listener = store.listener(CHANNEL_RUNS)
    listener.on_notify(lambda _channel, _payload: wake.set())
    await listener.ensure_connected()
    try:
        with anyio.move_on_after(timeout_s):
            while True:
                run = await store.get_dag_run(dag_id, run_id)
                if run is None:
                    raise LookupError(f"no run {run_id!r} of DAG {dag_id!r}")
                if run.state not in ("running", "queued"):
                    return run.state
                await wake.wait(poll_s)
        return "running"
    finally:
        await listener.close()


async def _create(store: Store, run: NewRun) -> tuple[str, str]:
    """Create a manual run behind max_active_runs, its interval inferred from the DAG's
    schedule (a naive logical date is in the DAG's time zone; no run id: ``manual__<logical
    date>``); returns its run id and state (running or queued)."""
    when, start, end = await manual_data_interval(store, run.dag_id, run.logical_date)
    run = msgspec.structs.replace(
        run,
        run_id=run.run_id or f"manual__{when.isoformat()}",
        logical_date=when,
        data_interval_start=start,
        data_interval_end=end,
    )
    created = await store.create_queued_run(run)
    if created is None:
        raise UnknownDag(f"unknown DAG {run.dag_id!r}")
    return run.run_id, created[1]


async def create_manual_run(store: Store, run: NewRun) -> tuple[str, str]:
    """Create a manual run as ``deferral dags trigger`` does (what TriggerDagRunOperator uses);
    returns its run id and state. Raises UnknownDag, and DuplicateRun when the DAG has a run
    of that id already."""
    return await _create(store, run)


async def _create_run(store: Store, bag: DagBag | None, run: NewRun) -> tuple[str, str]:
    dag_id = run.dag_id
    try:
        return await _create(store, run)
    except UnknownDag:
        if bag is not None:
            raise UnknownDag(bag.missing_dag_message(dag_id)) from None
    if not await request_rescan(store, dag_id):
        raise UnknownDag(
            f"unknown DAG {dag_id!r}: no DAG of that id has been recorded, and no scheduler "
            f"answered a request to rescan its DAGs folder; {NO_FOLDER_HINT} to parse the "
            "folder here"
        ) from None
    try:
        return await _create(store, run)
    except UnknownDag:
        raise UnknownDag(
            f"unknown DAG {dag_id!r}: the running scheduler rescanned its DAGs folder and found "
            "no DAG of that id (its log names the files that failed to import); "
            f"{NO_FOLDER_HINT} to parse a folder here"
        ) from None


async def trigger_dag(
    settings: Settings,
    dag_id: str,
    run_id: str | None = None,
    conf: dict[str, Any] | None = None,
    wait: bool = False,
    timeout_s: float | None = None,
    logical_date: dt.datetime | None = None,
) -> RunOutcome:
    """Create a run of ``dag_id``. With a DAGs folder in the settings, the folder is parsed
    here first; without one, a DAG the database does not know yet makes the running schedulers
    rescan theirs (a new file need not wait for the next scan). Raises LookupError
    (:class:`UnknownDag`) saying why the DAG is unknown.

    ``logical_date`` defaults to now (the database clock); the run's data interval is
    inferred from the DAG's schedule. The run waits as ``queued`` while the DAG has
    ``max_active_runs`` runs running."""
    store = await open_store(settings)
    try:
        bag = None
        if settings.dags_folder:
            bag = DagBag(
                settings.dags_folder, processor_timeout_s=settings.dag_file_processor_timeout_s
            )
            await sync_dags(store, bag)
        when = logical_date or await store.now()
        new = NewRun(
            dag_id=dag_id,
            run_id=run_id or "",
            logical_date=when,
            data_interval_start=when,
            data_interval_end=when,
            run_type="manual",
            conf=conf or {},
        )
        run_id, state = await _create_run(store, bag, new)
        if not wait:
            return RunOutcome(run_id=run_id, state=state, tasks=[])
        return await _wait_outcome(store, dag_id, run_id, timeout_s)
    finally:
        await store.close()


async def wait_run(
    settings: Settings, dag_id: str, run_id: str, timeout_s: float | None = None
) -> RunOutcome:
    """Wait for an existing run to end (``running``: ``timeout_s`` passed first); returns its
    state and task instances. Raises LookupError when there is no such run."""
    store = await open_store(settings)
    try:
        return await _wait_outcome(store, dag_id, run_id, timeout_s)
    finally:
        await store.close()


async def _wait_outcome(
    store: Store, dag_id: str, run_id: str, timeout_s: float | None
) -> RunOutcome:
    state = await wait_for_run(store, dag_id, run_id, timeout_s)
    tasks = await store.list_task_instances(dag_id=dag_id, run_id=run_id)
    return RunOutcome(run_id=run_id, state=state, tasks=tasks)
