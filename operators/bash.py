"""Run a shell command as a task, without holding a thread."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from typing import Any

from operators.base import BaseOperator, Context, SkipTask
from triggers.bash import KEPT_ENV, clean_env, end_command, start_command

__all__ = ["KEPT_ENV", "BashCommandFailed", "BashOperator", "clean_env"]


class BashCommandFailed(RuntimeError):
    """The command exited with a non-zero status."""


class BashOperator(BaseOperator):
    """Runs ``bash -c bash_command``; its output is logged and the last line is the result.

    Exit code ``skip_on_exit_code`` (99 by default) ends the task as skipped; any other
    non-zero code fails it. The command runs in a process group of its own: a try stopped
    before it ends (its ``execution_timeout``, a worker's stop) kills the whole group, what
    the command started included.

    The command does not inherit the worker's environment: it gets a clean one
    (:data:`KEPT_ENV` and ``LC_*``), the worker's variables named in ``pass_env``, then
    ``env``; with ``append_env=False``, ``env`` alone. ``DEFERRAL_DAG_ID``,
    ``DEFERRAL_RUN_ID`` and ``DEFERRAL_TASK_ID`` are always set.

    ``bash_command`` and ``env`` are templated; a ``bash_command`` ending in ``.sh`` or
    ``.bash`` names a script in the DAG's folder (or ``template_searchpath``), rendered and run
    (end it with a space to run such a command as it is).
    """

    template_fields = ("bash_command", "env")
    template_ext = (".sh", ".bash")

    def __init__(
        self,
        *,
        bash_command: str,
        env: Mapping[str, str] | None = None,
        append_env: bool = True,
        pass_env: Sequence[str] = (),
        cwd: str | None = None,
        skip_on_exit_code: int | None = 99,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(bash_command, str) or not bash_command.strip():
            raise ValueError(f"task {self.task_id}: bash_command must be a non-empty string")
        self.bash_command = bash_command
        self.env = dict(env or {})
        self.append_env = append_env
        if isinstance(pass_env, str) or not all(isinstance(n, str) for n in pass_env):
            raise ValueError(f"task {self.task_id}: pass_env must be a list of variable names")
        self.pass_env = list(pass_env)
        self.cwd = cwd
        self.skip_on_exit_code = skip_on_exit_code

    async def execute(self, context: Context) -> str | None:
        base = clean_env(os.environ, self.pass_env) if self.append_env else {}
        env = {**base, **self.env}
        env.update(
            DEFERRAL_DAG_ID=context.get("dag_id", ""),
            DEFERRAL_RUN_ID=context.get("run_id", ""),
            DEFERRAL_TASK_ID=context.get("task_id", ""),
        )
        proc, transport = await start_command(
            ["bash", "-c", self.bash_command], env=env, cwd=self.cwd
        )
        last: str | None = None
        try:
            assert proc.stdout is not None
            async for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                self.log.info("%s", line)
                last = line
            code = await proc.wait()
        finally:
            # Stopped (its execution_timeout, a stop): what the command started goes too,
            # and nothing of it outlives the try (end_command).
            await asyncio.shield(end_command(proc, transport))
        if code != 0 and code == self.skip_on_exit_code:
            raise SkipTask(f"command exited with {code}")
        if code != 0:
            raise BashCommandFailed(f"command exited with status {code}: {self.bash_command}")
        return last
