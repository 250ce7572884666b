"""Run one task of a DAG in this process, on a scratch database: ``deferral tasks test``.

The quickest loop for a DAG author. A fresh database is created on the configured server (the
embedded one by default; next to ``DEFERRAL_DATABASE_URL`` when that user may create
databases), the DAG is recorded there with only the chosen task (its upstream tasks ignored,
its retries not used: one try, as Airflow's ``tasks test``), and a worker and a triggerer run
in this process (:func:`engine.testing.harness.run_engine`, no scheduler) until the task has ended —
a deferral is handed to the in-process triggerer and resumed on the in-process worker, with
no polling delay: both wake on the database's notifications. The database is dropped
afterwards, whatever happened.

What the task and its trigger log (records bound to the task instance or its trigger, from
loggers outside the engine's own, plus the engine's warnings about them), each deferral
(classpath and kwargs), each resume (method and event), and the outcome (state, try, result,
error) come back in a :class:`TaskTestReport`; ``on_line`` also gets them as text lines as they
happen. Everything reported is masked (:func:`mask_secrets`, engine.masking).
"""

from __future__ import annotations

import datetime as dt
import math
import os
import secrets
from collections.abc import Callable
from typing import Any

import anyio
import asyncpg

from engine import masking
from engine.config import Settings
from engine.dags.dag import DAG
from engine.dags.dagbag import DagBag
from engine.dags.timetables import manual_run_interval
from engine.launch.app import trigger_allow_list
from engine.security.keys import Keyring, generate_key
from engine.store import database_url
from engine.store.databases import create_database, drop_database
from engine.testing.harness import run_engine
from engine.testing.taskrecord import (
    LogLine,
    Recorder,
    RecordingStore,
    SeenDeferral,
    SeenResume,
    TaskTestReport,
    capturing,
    mask_secrets,
    show,
)
from engine.usercode import logsink
from triggers.base import decode_value

__all__ = [
    "LogLine",
    "ScratchDatabaseError",
    "SeenDeferral",
    "SeenResume",
    "TaskTestReport",
    "mask_secrets",
    "run_task_test",
    "scratch_database_name",
    "show",
]

#: Scratch databases are named ``<prefix><pid>_<random>``: a leftover (a killed command) is
#: recognisable, and two commands at once never pick the same name.
SCRATCH_PREFIX = "deferral_tasktest_"
_ENDED = ("success", "failed", "skipped", "upstream_failed")


class ScratchDatabaseError(RuntimeError):
    """No scratch database could be created on the configured server."""


def scratch_database_name() -> str:
    return f"{SCRATCH_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"


def one_task_structure(dag: DAG, task_id: str) -> list[dict[str, Any]]:
    """The DAG's stored structure with only ``task_id``: no upstream (it is scheduled at
    once), a leaf, and no retries (one try)."""
    (task,) = [t for t in dag.serialize_tasks() if t["task_id"] == task_id]
    return [{**task, "upstream": [], "is_leaf": True, "retries": 0}]


async def run_task_test(
    settings: Settings,
    dagbag: DagBag,
    dag_id: str,
    task_id: str,
    *,
    logical_date: dt.datetime | None = None,
    conf: dict[str, Any] | None = None,
    on_line: Callable[[str], None] | None = None,
    timeout_s: float = math.inf,
) -> TaskTestReport:
    """Run ``task_id`` of ``dag_id`` (a DAG of ``dagbag``, already collected) once, on a
    scratch database, with a worker and a triggerer in this event loop; returns the report.

    Raises :class:`ScratchDatabaseError` when the server does not let us create a database,
    :class:`engine.testing.harness.EngineTimeout` when the task has not ended after ``timeout_s``.
    """
    dag = dagbag.dags[dag_id]
    structure = one_task_structure(dag, task_id)
    admin_url = await anyio.to_thread.run_sync(database_url, settings)
    name = scratch_database_name()
    try:
        url = await create_database(admin_url, name)
    except asyncpg.InsufficientPrivilegeError as exc:
        where = "DEFERRAL_DATABASE_URL" if settings.database_url else "the embedded server"
        raise ScratchDatabaseError(
            f"cannot create a scratch database on {where} ({exc}); give its user CREATEDB, or "
            "unset DEFERRAL_DATABASE_URL to use the embedded server"
        ) from None
    recorder = Recorder(on_line)
    try:
        with capturing(recorder), logsink.tee_streams():
            # A throwaway key: what the task stores is sealed, and forgotten with the database.
            store = await RecordingStore.connect(
                url, pool_size=4, keyring=Keyring([generate_key()])
            )
            assert isinstance(store, RecordingStore)
            store.recorder = recorder
            try:
                return await _run(
                    store, settings, dagbag, dag, structure, task_id, name, logical_date, conf,
                    recorder, timeout_s,
                )  # fmt: skip
            finally:
                with anyio.move_on_after(5, shield=True):
                    await store.close()
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(30):
            await drop_database(admin_url, name)


async def _run(
    store: RecordingStore,
    settings: Settings,
    dagbag: DagBag,
    dag: DAG,
    structure: list[dict[str, Any]],
    task_id: str,
    database: str,
    logical_date: dt.datetime | None,
    conf: dict[str, Any] | None,
    recorder: Recorder,
    timeout_s: float,
) -> TaskTestReport:
    await store.upsert_dag(dag.dag_id, dag.fileloc, structure, dag.description)
    # As Airflow's `tasks test`, the task runs whatever its pool and queue: its pool is made
    # on the scratch database if need be, and the worker here serves its queues.
    task = dag.tasks[task_id]
    await store.ensure_pool(task.pool, max(task.pool_slots, 1))
    # The logical date and data interval `deferral dags trigger` would give a manual run.
    when, interval = manual_run_interval(
        dag.timetable, dag.timezone, logical_date or await store.now()
    )
    run_id = f"tasks_test__{when.isoformat()}"
    async with run_engine(
        store,
        dagbag=dagbag,
        scheduler=False,
        slots=1,
        capacity=10,
        default_deferrable=settings.default_deferrable,
        trigger_allow=trigger_allow_list(settings),
        triggerer_options={
            "blocked_loop_s": settings.triggerer_blocked_loop_s,
            "cleanup_timeout_s": settings.triggerer_cleanup_timeout_s,
            "cancel_blocking_after": settings.triggerer_cancel_blocking_after,
            "max_block_s": settings.triggerer_max_block_s,
            "queues": (task.trigger_queue,),
        },
        worker_options={"queues": (task.queue,)},
    ) as engine:
        await store.create_dag_run(
            dag.dag_id,
            run_id,
            logical_date=when,
            conf=conf,
            data_interval=(interval.start, interval.end),
        )
        ti = await engine.wait_for_state(
            dag.dag_id, task_id, _ENDED, run_id=run_id, timeout_s=timeout_s
        )
    result = ti["result"]
    return TaskTestReport(
        dag_id=dag.dag_id,
        task_id=task_id,
        run_id=run_id,
        logical_date=when,
        database=database,
        state=ti["state"],
        try_number=ti["try_number"],
        result=None if result is None else mask_secrets(decode_value(result)),
        error=None if ti["error"] is None else masking.redact_text(ti["error"]),
        log=recorder.log,
        deferrals=recorder.deferrals,
        resumes=recorder.resumes,
        trigger_ends=recorder.trigger_ends,
    )
