"""Start a run of another DAG, and optionally wait for it to end."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Sequence
from typing import Any

from operators.base import BaseOperator, Context, SkipTask, to_seconds
from triggers.base import TaskFailedEvent, TaskSkippedEvent
from triggers.connections import DEFAULT_DEFERRAL_CONN_ID
from triggers.external_task import TaskStateTrigger
from triggers.polling import is_met

__all__ = ["XCOM_LOGICAL_DATE_ISO", "XCOM_RUN_ID", "DagRunFailed", "TriggerDagRunOperator"]

#: The XCom keys the operator pushes: the triggered run's id and its logical date (ISO 8601).
XCOM_RUN_ID = "trigger_run_id"
XCOM_LOGICAL_DATE_ISO = "trigger_logical_date_iso"

_RUN_STATES = ("queued", "running", "success", "failed")


class DagRunFailed(RuntimeError):
    """The triggered run ended in one of ``failed_states``."""


def _states(task_id: str, name: str, states: Sequence[str]) -> list[str]:
    if isinstance(states, str) or not all(isinstance(s, str) for s in states):
        raise TypeError(f"task {task_id}: {name} must be a list of run states, got {states!r}")
    unknown = sorted(set(states) - set(_RUN_STATES))
    if unknown:
        raise ValueError(
            f"task {task_id}: {name} has {unknown}, which are not run states "
            f"({', '.join(_RUN_STATES)})"
        )
    return sorted(set(states))


class TriggerDagRunOperator(BaseOperator):
    """Creates run ``trigger_run_id`` of DAG ``trigger_dag_id`` (no id: ``manual__<logical
    date>``) with ``conf``, at ``logical_date`` (default: now), as ``deferral dags trigger``
    does; pushes its id as the XCom ``trigger_run_id`` (and its logical date as
    ``trigger_logical_date_iso``).

    A run of that id that exists already is cleared and runs again with
    ``reset_dag_run=True``; otherwise the task fails saying so (or is skipped, with
    ``skip_when_already_exists=True``).

    With ``wait_for_completion=True`` the task ends when the run does: it succeeds when the
    run reaches one of ``allowed_states`` and fails, naming the run, when it reaches one of
    ``failed_states``; the run is checked every ``poke_interval`` seconds. With
    ``deferrable=True`` the wait is a trigger on a triggerer (no worker slot held);
    ``deferrable=None`` follows the engine's ``default_deferrable``. Without it, the task
    holds its slot while it waits.

    ``trigger_dag_id``, ``trigger_run_id``, ``logical_date`` and ``conf`` are templated.
    """

    template_fields = ("trigger_dag_id", "trigger_run_id", "logical_date", "conf")

    def __init__(
        self,
        *,
        trigger_dag_id: str,
        trigger_run_id: str | None = None,
        conf: dict[str, Any] | None = None,
        logical_date: dt.datetime | str | None = None,
        reset_dag_run: bool = False,
        wait_for_completion: bool = False,
        poke_interval: dt.timedelta | float = 60.0,
        allowed_states: Sequence[str] = ("success",),
        failed_states: Sequence[str] = ("failed",),
        skip_when_already_exists: bool = False,
        deferrable: bool | None = None,
        conn: str = DEFAULT_DEFERRAL_CONN_ID,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(trigger_dag_id, str) or not trigger_dag_id:
            raise ValueError(f"task {self.task_id}: trigger_dag_id must be a non-empty str")
        self.trigger_dag_id = trigger_dag_id
        self.trigger_run_id = trigger_run_id
        self.conf = conf
        self.logical_date = logical_date
        self.reset_dag_run = bool(reset_dag_run)
        self.wait_for_completion = bool(wait_for_completion)
        self.poke_interval = to_seconds(poke_interval, "poke_interval") or 0.0
        self.allowed_states = _states(self.task_id, "allowed_states", allowed_states)
        self.failed_states = _states(self.task_id, "failed_states", failed_states)
        if overlap := set(self.allowed_states) & set(self.failed_states):
            raise ValueError(
                f"task {self.task_id}: allowed_states and failed_states overlap: {sorted(overlap)}"
            )
        self.skip_when_already_exists = bool(skip_when_already_exists)
        self.deferrable = None if deferrable is None else bool(deferrable)
        self.conn = conn

    def defers(self, context: Context) -> bool:
        if self.deferrable is not None:
            return self.deferrable
        return bool(context.get("default_deferrable", False))

    # -- the arguments, as rendered -------------------------------------------------------

    def _conf(self) -> dict[str, Any]:
        conf = self.conf
        if conf is None:
            return {}
        if not isinstance(conf, dict) or not all(isinstance(k, str) for k in conf):
            raise TypeError(
                f"task {self.task_id}: conf must be a dict with str keys, got {type(conf).__name__}"
            )
        return conf

    def _logical_date(self) -> dt.datetime | None:
        when = self.logical_date
        if when is None or when == "":
            return None
        if isinstance(when, str):
            try:
                return dt.datetime.fromisoformat(when)
            except ValueError:
                raise ValueError(
                    f"task {self.task_id}: logical_date {when!r} is not an ISO 8601 date-time"
                ) from None
        if isinstance(when, dt.datetime):
            return when
        raise TypeError(
            f"task {self.task_id}: logical_date must be a datetime or an ISO 8601 str, got "
            f"{type(when).__name__}"
        )

    def _run_id(self) -> str | None:
        run_id = self.trigger_run_id
        if run_id is None or run_id == "":
            return None
        if not isinstance(run_id, str):
            raise TypeError(f"task {self.task_id}: trigger_run_id must be a str, got {run_id!r}")
        return run_id

    # -- the work ---------------------------------------------------------------------------

    async def execute(self, context: Context) -> None:
        ti: Any = context.get("ti")
        start = getattr(ti, "trigger_dag_run", None)
        if start is None:
            raise RuntimeError(
                f"task {self.task_id}: TriggerDagRunOperator runs on a worker's loop; it "
                "cannot run with isolation='process'"
            )
        run_id = self._run_id()
        created = await start(
            self.trigger_dag_id,
            run_id=run_id,
            conf=self._conf(),
            logical_date=self._logical_date(),
            reset=self.reset_dag_run,
        )
        run_id = created["run_id"]
        if created["existed"] and not self.reset_dag_run:
            message = (
                f"DAG {self.trigger_dag_id} already has a run {run_id!r}: reset_dag_run=True "
                "runs it again"
            )
            if self.skip_when_already_exists:
                raise SkipTask(message)
            raise RuntimeError(f"{message} (or skip_when_already_exists=True skips this task)")
        self.log.info(
            "%s run %s of DAG %s (%s)",
            "reset" if created["existed"] else "triggered",
            run_id,
            self.trigger_dag_id,
            created["state"],
        )
        ti.xcom_push(XCOM_RUN_ID, run_id)
        ti.xcom_push(XCOM_LOGICAL_DATE_ISO, created["logical_date"].isoformat())
        if not self.wait_for_completion:
            return None
        trigger = TaskStateTrigger(
            self.trigger_dag_id,
            None,
            None,
            run_id=run_id,
            states=self.allowed_states,
            failed_states=self.failed_states,
            conn=self.conn,
            poll_interval=self.poke_interval,
        )
        if self.defers(context):
            self.defer(trigger=trigger, method_name="execute_complete", kwargs={"run_id": run_id})
        while True:
            result = await trigger.check()
            if isinstance(result, TaskFailedEvent | TaskSkippedEvent):
                raise DagRunFailed(self._failed(run_id, str(result.payload)))
            if is_met(result):
                self.log.info("run %s of DAG %s is %s", run_id, self.trigger_dag_id, result)
                return None
            await asyncio.sleep(self.poke_interval)

    def execute_complete(self, context: Context, event: Any = None, run_id: str = "") -> None:
        """The triggered run reached one of ``allowed_states`` (a failed state ended the task
        on the triggerer already)."""
        state = event.get("state") if isinstance(event, dict) else None
        if state not in self.allowed_states:
            raise DagRunFailed(self._failed(run_id, f"it is {state}"))
        self.log.info("run %s of DAG %s is %s", run_id, self.trigger_dag_id, state)
        return None

    def _failed(self, run_id: str, why: str) -> str:
        return f"triggered run {run_id} of DAG {self.trigger_dag_id} did not succeed: {why}"
