"""The sensor that waits until a shell command exits with status 0."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from operators.base import Context, FailTask
from operators.sensors.base import BaseSensorOperator
from triggers.base import BaseTrigger, TriggerEvent
from triggers.bash import COMMAND_OPTIONS, BashTrigger

__all__ = ["BashSensor"]


class BashSensor(BaseSensorOperator):
    """Waits until ``bash -c bash_command`` exits with status 0.

    Any other status means "not yet", unless ``retry_exit_code`` is set: then only that status
    means "not yet", and any other fails the sensor at once, without retries. Each run of the
    command is killed after ``command_timeout`` seconds (a failure: retries apply) and keeps
    and logs at most ``max_output_bytes`` of its output.

    Every mode runs the command the same way: in poke and reschedule mode on the worker, with
    ``deferrable=True`` on the triggerer with asyncio subprocesses (no worker slot held). The
    command gets ``BashOperator``'s clean environment: the variables of the process running
    it that ``operators.bash.KEPT_ENV`` names (and ``LC_*``), those named in ``pass_env``, then
    ``env`` (with ``append_env=False``, ``env`` alone), and ``DEFERRAL_DAG_ID``,
    ``DEFERRAL_RUN_ID``, ``DEFERRAL_TASK_ID``. ``bash_command`` and ``env`` are templated.
    """

    template_fields = ("bash_command", "env")

    def __init__(self, *, bash_command: str, **kwargs: Any) -> None:
        # The command's options (COMMAND_OPTIONS: env, append_env, pass_env, cwd,
        # retry_exit_code, command_timeout, max_output_bytes) are BashTrigger's, with its
        # defaults and its checks; the rest are the sensor's.
        options = {name: kwargs.pop(name) for name in COMMAND_OPTIONS if name in kwargs}
        super().__init__(**kwargs)
        self.bash_command = bash_command
        # Checked now, not when the first check runs: a bad argument is a DAG file's error.
        checked = self._trigger(("", "", ""), options)
        for name in COMMAND_OPTIONS:
            setattr(self, name, getattr(checked, name))

    def _trigger(
        self, task: Sequence[str], options: Mapping[str, Any] | None = None
    ) -> BashTrigger:
        if options is None:
            options = {name: getattr(self, name) for name in COMMAND_OPTIONS}
        try:
            return BashTrigger(self.bash_command, **options, task=task, **self.trigger_kwargs())
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"task {self.task_id}: {exc}") from None

    def trigger(self, context: Context) -> BaseTrigger:
        ids = (context.get("dag_id", ""), context.get("run_id", ""), context.get("task_id", ""))
        return self._trigger(ids)

    def poke(self, context: Context) -> Any:
        result = super().poke(context)
        if isinstance(result, TriggerEvent):  # a status other than retry_exit_code
            _failed(result.payload)
        return result

    def execute_complete(self, context: Context, event: Any = None) -> Any:
        _failed(event)
        return None


def _failed(payload: Any) -> None:
    """Fail (no retries) on the trigger's payload for a status other than retry_exit_code."""
    if isinstance(payload, dict) and "error" in payload:
        raise FailTask(str(payload["error"]))
