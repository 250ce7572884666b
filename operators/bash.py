"""Run a shell command as a task, without holding a thread."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

from operators.base import BaseOperator, Context, SkipTask

__all__ = ["BashCommandFailed", "BashOperator"]


class BashCommandFailed(RuntimeError):
    """The command exited with a non-zero status."""


class BashOperator(BaseOperator):
    """Runs ``bash -c bash_command``; its output is logged and the last line is the result.

    Exit code ``skip_on_exit_code`` (99 by default) ends the task as skipped; any other
    non-zero code fails it. ``env`` is added to the worker's environment (or replaces it
    with ``append_env=False``).
    """

    def __init__(
        self,
        *,
        bash_command: str,
        env: Mapping[str, str] | None = None,
        append_env: bool = True,
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
        self.cwd = cwd
        self.skip_on_exit_code = skip_on_exit_code

    async def execute(self, context: Context) -> str | None:
        env = {**os.environ, **self.env} if self.append_env else dict(self.env)
        env.update(
            DEFERRAL_DAG_ID=context.get("dag_id", ""),
            DEFERRAL_RUN_ID=context.get("run_id", ""),
            DEFERRAL_TASK_ID=context.get("task_id", ""),
        )
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            self.bash_command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            cwd=self.cwd,
            start_new_session=True,
        )
        last: str | None = None
        try:
            assert proc.stdout is not None
            async for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                self.log.info("%s", line)
                last = line
            code = await proc.wait()
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
            raise
        if code != 0 and code == self.skip_on_exit_code:
            raise SkipTask(f"command exited with {code}")
        if code != 0:
            raise BashCommandFailed(f"command exited with status {code}: {self.bash_command}")
        return last
