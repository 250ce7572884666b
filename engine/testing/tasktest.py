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

import contextlib
import datetime as dt
import logging
import math
import os
import secrets
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio
import asyncpg
import msgspec

from engine import masking
from engine.config import Settings
from engine.dags.dag import DAG
from engine.dags.dagbag import DagBag
from engine.launch.app import trigger_allow_list
from engine.runtime import logs
from engine.security.keys import Keyring, generate_key
from engine.store import Store, database_url
from engine.store.databases import create_database, drop_database
from engine.store.models import (
    ClaimedTask,
    Deferral,
    FiredTriggers,
    TaskClaim,
    TimedOutTask,
    TriggerOutcome,
)
from engine.testing.harness import run_engine
from engine.usercode import logsink
from operators.defaults import DEFAULT_QUEUE
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

_MASK = masking.MASK


class ScratchDatabaseError(RuntimeError):
    """No scratch database could be created on the configured server."""


class LogLine(msgspec.Struct, frozen=True, kw_only=True):
    """One log record of the task or its trigger."""

    ts: float
    level: str
    logger: str
    message: str
    #: ``task`` (logged while the task ran) or ``trigger`` (by its trigger, on the triggerer).
    source: str
    exc: str | None = None


class SeenDeferral(msgspec.Struct, frozen=True, kw_only=True):
    """The task deferred: on this trigger, to resume at ``method_name``."""

    classpath: str
    #: The trigger's kwargs, secret-looking values masked (:func:`mask_secrets`).
    kwargs: Any
    method_name: str
    timeout_s: float | None


class SeenResume(msgspec.Struct, frozen=True, kw_only=True):
    """The task resumed at ``method_name`` with the trigger's event payload."""

    method_name: str
    event: Any


class TaskTestReport(msgspec.Struct, frozen=True, kw_only=True):
    """How the task's one try went (``deferral tasks test --json`` prints this object)."""

    dag_id: str
    task_id: str
    run_id: str
    logical_date: dt.datetime
    #: The scratch database the task ran on (dropped since).
    database: str
    state: str
    try_number: int
    result: Any
    error: str | None
    log: list[LogLine]
    deferrals: list[SeenDeferral]
    resumes: list[SeenResume]
    #: How a trigger ended the task itself (``TaskSuccessEvent`` ...) or its deferral timed
    #: out: ``{"kind": ..., "payload" | "error": ...}``; empty otherwise.
    trigger_ends: list[dict[str, Any]]


def mask_secrets(value: Any) -> Any:
    """``value`` with its secrets masked (:func:`engine.masking.redact`, the one
    masking function of the engine: registered secrets, sensitive key names such as
    ``password``, ``token``, ``api_key``, and secret shapes in text such as URL passwords)."""
    return masking.redact(value)


def scratch_database_name() -> str:
    return f"{SCRATCH_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"


def show(value: Any) -> str:
    """A value as JSON text when it is plain data, else its repr."""
    try:
        return msgspec.json.encode(value).decode()
    except (TypeError, ValueError, OverflowError):
        return repr(value)


class _Recorder:
    """What happened, in order: the report's lists, and ``on_line`` as it happens."""

    def __init__(self, on_line: Callable[[str], None] | None) -> None:
        self.on_line = on_line
        self.log: list[LogLine] = []
        self.deferrals: list[SeenDeferral] = []
        self.resumes: list[SeenResume] = []
        self.trigger_ends: list[dict[str, Any]] = []

    def say(self, line: str) -> None:
        if self.on_line is not None:
            # Called from the task's own context too: shown here, not stored as its log.
            with logsink.unbound():
                self.on_line(masking.redact_text(line))

    def deferred(self, deferral: Deferral) -> None:
        try:
            kwargs = mask_secrets(decode_value(deferral.kwargs))
        except (TypeError, ValueError, msgspec.DecodeError):
            kwargs = _MASK
        item = SeenDeferral(
            classpath=deferral.classpath,
            kwargs=kwargs,
            method_name=deferral.method_name,
            timeout_s=deferral.timeout_s,
        )
        self.deferrals.append(item)
        # A sensor defers with what is left of its timeout (59.9997 s of 60): rounded to 0.1 s.
        timeout = f" (timeout {round(item.timeout_s, 1):g}s)" if item.timeout_s is not None else ""
        self.say(f"deferred on {item.classpath} {show(item.kwargs)}{timeout}")

    def resumed(self, ti: ClaimedTask) -> None:
        assert ti.next_method is not None
        event = mask_secrets(decode_value(ti.next_event)) if ti.next_event else None
        self.resumes.append(SeenResume(method_name=ti.next_method, event=event))
        self.say(f"resumed at {ti.next_method} with {show(event)}")

    def trigger_ended(self, outcome: TriggerOutcome) -> None:
        end: dict[str, Any] = {"kind": outcome.kind}
        if outcome.kind == "failed":
            end["error"] = mask_secrets(outcome.error)
            self.say(f"the trigger failed the task: {outcome.error}")
        else:
            payload = decode_value(outcome.payload) if outcome.payload else None
            end["payload"] = mask_secrets(payload)
            self.say(f"the trigger ended the task as {outcome.kind} with {show(end['payload'])}")
        self.trigger_ends.append(end)

    def timed_out(self, moved: TimedOutTask) -> None:
        end = {"kind": "timeout", "error": f"the deferral timed out (now {moved.state})"}
        self.trigger_ends.append(end)
        self.say(end["error"])


class _RecordingStore(Store):
    """The store of the scratch database, noting deferrals, resumes and trigger outcomes on
    their way to the database (the only task there is the one under test)."""

    recorder: _Recorder

    async def defer_task(self, ti_id: int, worker_id: int, deferral: Deferral) -> bool:
        ok = await super().defer_task(ti_id, worker_id, deferral)
        if ok:
            self.recorder.deferred(deferral)
        return ok

    async def reschedule_task(
        self, ti_id: int, worker_id: int, at: dt.datetime, *, try_number: int
    ) -> bool:
        ok = await super().reschedule_task(ti_id, worker_id, at, try_number=try_number)
        if ok:
            self.recorder.say(f"rescheduled to {at.isoformat()}")
        return ok

    async def claim_tasks(
        self,
        worker_id: int,
        limit: int,
        *,
        queues: Sequence[str] = (DEFAULT_QUEUE,),
        parallelism: int = 0,
    ) -> TaskClaim:
        claim = await super().claim_tasks(worker_id, limit, queues=queues, parallelism=parallelism)
        for ti in claim.claimed:
            if ti.next_method:
                self.recorder.resumed(ti)
        return claim

    async def fire_triggers(
        self, triggerer_id: int, outcomes: Sequence[TriggerOutcome]
    ) -> FiredTriggers:
        fired = await super().fire_triggers(triggerer_id, outcomes)
        for outcome in outcomes:
            if outcome.trigger_id in fired.accepted and outcome.kind != "event":
                self.recorder.trigger_ended(outcome)
        return fired

    async def timeout_deferrals(
        self, trigger_ids: Sequence[int] | None, *, grace_s: float = 0.0
    ) -> list[TimedOutTask]:
        moved = await super().timeout_deferrals(trigger_ids, grace_s=grace_s)
        for row in moved:
            self.recorder.timed_out(row)
        return moved


class _Capture(logging.Handler):
    """Keeps the records logged while the task or its trigger ran (bound ids say which)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__(logging.NOTSET)
        self.recorder = recorder

    @staticmethod
    def source(record: logging.LogRecord) -> str | None:
        ids = logs.bound()
        if "trigger" in ids:
            return "trigger"
        if "task" in ids:
            return "task"
        return None

    @staticmethod
    def shown(record: logging.LogRecord) -> bool:
        """Of the records bound to the task or its trigger: the ones of user code and the
        built-in operators and triggers, and the engine's warnings (a blocked loop, a thread
        past its timeout). The engine's info lines and its errors (the outcome, which the
        report gives) are left out."""
        if record.name == "engine" or record.name.startswith("engine."):
            return record.levelno == logging.WARNING
        return True

    def emit(self, record: logging.LogRecord) -> None:
        source = self.source(record)
        if source is None or not self.shown(record):
            return
        try:
            message = record.getMessage()
        except Exception:  # a bad format string in user code: show it as written
            message = str(record.msg)
        exc = None
        if record.exc_info and record.exc_info[0] is not None:
            exc = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        message = masking.redact_text(message)
        exc = None if exc is None else masking.redact_text(exc)
        line = LogLine(
            ts=record.created,
            level=record.levelname,
            logger=record.name,
            message=message,
            source=source,
            exc=exc,
        )
        self.recorder.log.append(line)
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        text = f"{stamp}.{int(record.msecs):03d} {record.levelname:<7} {record.name}: {message}"
        self.recorder.say(text + (f"\n{exc}" if exc else ""))


class _Quiet(logging.Filter):
    """On the process's own log handlers while the test runs: the task's and trigger's records
    are shown by the report (not twice), and the engine's info lines about starting and
    stopping its worker and triggerer are noise here."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _Capture.source(record) is not None:
            return False
        is_engine = record.name == "engine" or record.name.startswith("engine.")
        return not (is_engine and record.levelno < logging.WARNING)


@contextlib.contextmanager
def _capturing(recorder: _Recorder) -> Iterator[None]:
    root = logging.getLogger()
    capture = _Capture(recorder)
    quiet = _Quiet()
    handlers = [h for h in root.handlers if h is not capture]
    for handler in handlers:
        handler.addFilter(quiet)
    root.addHandler(capture)
    try:
        yield
    finally:
        root.removeHandler(capture)
        for handler in handlers:
            handler.removeFilter(quiet)


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
    recorder = _Recorder(on_line)
    try:
        with _capturing(recorder), logsink.tee_streams():
            # A throwaway key: what the task stores is sealed, and forgotten with the database.
            store = await _RecordingStore.connect(
                url, pool_size=4, keyring=Keyring([generate_key()])
            )
            assert isinstance(store, _RecordingStore)
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
    store: _RecordingStore,
    settings: Settings,
    dagbag: DagBag,
    dag: DAG,
    structure: list[dict[str, Any]],
    task_id: str,
    database: str,
    logical_date: dt.datetime | None,
    conf: dict[str, Any] | None,
    recorder: _Recorder,
    timeout_s: float,
) -> TaskTestReport:
    await store.upsert_dag(dag.dag_id, dag.fileloc, structure, dag.description)
    # As Airflow's `tasks test`, the task runs whatever its pool and queue: its pool is made
    # on the scratch database if need be, and the worker here serves its queues.
    task = dag.tasks[task_id]
    await store.ensure_pool(task.pool, max(task.pool_slots, 1))
    when = logical_date or await store.now()
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
        await store.create_dag_run(dag.dag_id, run_id, logical_date=when, conf=conf)
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
