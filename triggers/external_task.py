"""Wait for a task (or a whole run) of another DAG in the same engine to reach a state."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import asyncpg

from triggers.connections import DEFAULT_DEFERRAL_CONN_ID, aresolve_url
from triggers.polling import DEFAULT_POLL_INTERVAL_S, PollingTrigger
from triggers.sqlfiles import load_queries
from triggers.temporal import _aware

__all__ = ["TaskStateTrigger"]

DEFAULT_ALLOWED_STATES = ("success",)
DEFAULT_FAILED_STATES = ("failed", "upstream_failed")


class TaskStateTrigger(PollingTrigger):
    """Fires when task ``task_id`` of the run of ``dag_id`` at ``logical_date`` is in one of
    ``states`` (with ``task_id=None``: when the run itself is). A state in ``failed_states``
    ends the waiting task as failed (skipped with ``soft_fail``) without a worker hop, with a
    message naming the run. With ``run_id``, the run is that one, whatever its logical date
    (``logical_date`` may then be None).

    When no run of ``dag_id`` exists at that logical date, the trigger says so in its log at
    once, naming the nearest logical dates that do exist (the two DAGs' schedules do not line
    up: the classic trap); with ``check_existence`` it fails the task instead of waiting.

    It reads the engine's tables through ``conn`` (a URL or a connection id; ``deferral``,
    the default, falls back to ``DEFERRAL_DATABASE_URL``).
    """

    def __init__(
        self,
        dag_id: str,
        task_id: str | None,
        logical_date: dt.datetime | str | None,
        *,
        run_id: str | None = None,
        states: Sequence[str] = DEFAULT_ALLOWED_STATES,
        failed_states: Sequence[str] = DEFAULT_FAILED_STATES,
        check_existence: bool = False,
        soft_fail: bool = False,
        conn: str = DEFAULT_DEFERRAL_CONN_ID,
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        end_from_trigger: bool = False,
    ) -> None:
        super().__init__(poll_interval=poll_interval, end_from_trigger=end_from_trigger)
        self.dag_id = dag_id
        self.task_id = task_id
        if run_id is None and logical_date is None:
            raise ValueError("a TaskStateTrigger needs a logical_date or a run_id")
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ValueError(f"run_id must be a non-empty str, got {run_id!r}")
        self.run_id = run_id
        self.logical_date = None if logical_date is None else _aware(logical_date, "logical_date")
        self.states = sorted(set(states))
        self.failed_states = sorted(set(failed_states))
        if overlap := set(self.states) & set(self.failed_states):
            raise ValueError(f"states and failed_states overlap: {sorted(overlap)}")
        self.check_existence = bool(check_existence)
        self.soft_fail = bool(soft_fail)
        self.conn = conn
        self._warned = False

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.external_task.TaskStateTrigger",
            {
                "dag_id": self.dag_id,
                "task_id": self.task_id,
                "logical_date": self.logical_date,
                "run_id": self.run_id,
                "states": self.states,
                "failed_states": self.failed_states,
                "check_existence": self.check_existence,
                "soft_fail": self.soft_fail,
                "conn": self.conn,
                **self._base_kwargs(),
            },
        )

    @property
    def target(self) -> str:
        what = f"task {self.task_id} of DAG {self.dag_id}" if self.task_id else f"DAG {self.dag_id}"
        if self.run_id is not None:
            return f"{what} in run {self.run_id}"
        assert self.logical_date is not None
        return f"{what} at logical date {self.logical_date.isoformat()}"

    def _end(self, message: str) -> Any:
        from triggers.base import TaskFailedEvent, TaskSkippedEvent

        return TaskSkippedEvent(message) if self.soft_fail else TaskFailedEvent(message)

    async def check(self) -> Any:
        queries = load_queries("external_task.sql")
        conn = await asyncpg.connect(await aresolve_url(self.conn))
        if self.run_id is not None:
            try:
                row = await conn.fetchrow(
                    queries["run_state"], self.dag_id, self.run_id, self.task_id
                )
            finally:
                await conn.close()
            if row is None:
                return self._missing(f"DAG {self.dag_id} has no run {self.run_id!r}")
            return self._state_of(row)
        assert self.logical_date is not None
        try:
            row = await conn.fetchrow(
                queries["external_state"], self.dag_id, self.logical_date, self.task_id
            )
            nearest = []
            if row is None and not self._warned:
                nearest = [
                    r["logical_date"].isoformat()
                    for r in await conn.fetch(
                        queries["nearest_runs"], self.dag_id, self.logical_date
                    )
                ]
        finally:
            await conn.close()
        if row is None:
            message = (
                f"no run of DAG {self.dag_id} exists at logical date "
                f"{self.logical_date.isoformat()}"
                + (
                    f"; its nearest runs are at {', '.join(nearest)}"
                    if nearest
                    else "; it has no runs at all"
                )
                + " (check execution_delta / execution_date_fn)"
            )
            return self._missing(message)
        return self._state_of(row)

    def _state_of(self, row: Any) -> Any:
        if self.task_id is None:
            state = row["run_state"]
        elif not row["has_task"]:
            return self._missing(
                f"run {row['run_id']} of DAG {self.dag_id} has no task {self.task_id!r}"
            )
        else:
            state = row["task_state"]
        if state in self.states:
            return {
                "dag_id": self.dag_id,
                "task_id": self.task_id,
                "run_id": row["run_id"],
                "state": state,
            }
        if state in self.failed_states:
            return self._end(f"{self.target} is {state}")
        return None

    def _missing(self, message: str) -> Any:
        if self.check_existence:
            return self._end(message)
        if not self._warned:
            self._warned = True
            self.log.warning("%s; waiting for it to appear", message)
        return None
