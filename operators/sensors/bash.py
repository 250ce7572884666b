"""The sensor that waits until a shell command exits with status 0."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from operators.base import Context, FailTask
from operators.sensors.base import BaseSensorOperator
from triggers.base import BaseTrigger, TriggerEvent
from triggers.bash import DEFAULT_COMMAND_TIMEOUT_S, DEFAULT_MAX_OUTPUT_BYTES, BashTrigger

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

    def __init__(
        self,
        *,
        bash_command: str,
        env: Mapping[str, str] | None = None,
        append_env: bool = True,
        pass_env: Sequence[str] = (),
        cwd: str | None = None,
        retry_exit_code: int | None = None,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.bash_command = bash_command
        self.env = dict(env or {})
        self.append_env = bool(append_env)
        self.pass_env = list(pass_env)
        self.cwd = cwd
        self.retry_exit_code = retry_exit_code
        self.command_timeout = command_timeout
        self.max_output_bytes = max_output_bytes
        # Checked now, not when the first check runs: a bad argument is a DAG file's error.
        self._trigger(("", "", ""))

    def _trigger(self, task: Sequence[str]) -> BashTrigger:
        try:
            return BashTrigger(
                self.bash_command,
                env=self.env,
                append_env=self.append_env,
                pass_env=self.pass_env,
                cwd=self.cwd,
                retry_exit_code=self.retry_exit_code,
                command_timeout=self.command_timeout,
                max_output_bytes=self.max_output_bytes,
                task=task,
                **self.trigger_kwargs(),
            )
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
