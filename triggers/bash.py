"""Wait until a shell command exits with status 0, running it with asyncio subprocesses.

The command gets a clean environment, never the environment of the process that runs it
(:func:`clean_env`): the same rule as ``BashOperator``'s, so the database URL, keys and
``DEFERRAL_*`` secrets of a worker or a triggerer never reach it. Each run is bounded in time
(``command_timeout``) and in the output kept and logged (``max_output_bytes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from triggers.base import TriggerEvent
from triggers.polling import DEFAULT_POLL_INTERVAL_S, PollingTrigger

__all__ = [
    "COMMAND_OPTIONS",
    "DEFAULT_COMMAND_TIMEOUT_S",
    "DEFAULT_MAX_OUTPUT_BYTES",
    "KEPT_ENV",
    "BashCommandTimeout",
    "BashTrigger",
    "clean_env",
    "end_command",
    "start_command",
]

#: What every command gets of the environment of the process that runs it (those that are
#: set), plus every ``LC_*`` locale variable: enough for a shell to find programs, a home, a
#: locale, a time zone and a temporary folder. Nothing else of a worker's or a triggerer's
#: environment (the database URL, ``DEFERRAL_CONN_*`` secrets, cloud credentials) reaches a
#: command unless the task names it.
KEPT_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR")

#: How long one run of a sensor's command may take (seconds).
DEFAULT_COMMAND_TIMEOUT_S = 300.0
#: How much of one run's output is kept and logged (bytes); the rest is counted, not kept.
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
#: The options of a command, as :class:`BashTrigger` takes them (besides ``bash_command``):
#: ``BashSensor`` takes the same and hands them on, with the trigger's defaults and checks.
COMMAND_OPTIONS = (
    "env",
    "append_env",
    "pass_env",
    "cwd",
    "retry_exit_code",
    "command_timeout",
    "max_output_bytes",
)
#: Output is read (and a line without a newline logged) in pieces of this many bytes.
_CHUNK = 8192
#: How much unread output a run's pipe buffers before it stops reading (asyncio's default).
_LIMIT = 64 * 1024


def clean_env(environ: Mapping[str, str], pass_env: Sequence[str] = ()) -> dict[str, str]:
    """The variables of ``environ`` a command may see: :data:`KEPT_ENV`, ``LC_*`` and the
    names in ``pass_env``."""
    keep = set(KEPT_ENV) | set(pass_env)
    return {k: v for k, v in environ.items() if k in keep or k.startswith("LC_")}


class BashCommandTimeout(RuntimeError):
    """One run of the command took longer than its ``command_timeout``."""


class BashTrigger(PollingTrigger):
    """Runs ``bash -c bash_command`` every ``poll_interval`` seconds until it exits with 0.

    A non-zero status means "not yet", unless ``retry_exit_code`` is set: then only that
    status means "not yet", and any other ends the wait with the event payload
    ``{"exit_code": n, "error": "..."}`` (on which ``BashSensor`` fails without retries).
    A run longer than ``command_timeout`` seconds is killed (its whole process group) and
    fails the check (retries apply). At most ``max_output_bytes`` of each run's output are
    kept and logged.

    The environment: the running process's variables that :func:`clean_env` keeps (with
    those named in ``pass_env``), then ``env``; with ``append_env=False``, ``env`` alone; and
    ``DEFERRAL_DAG_ID``, ``DEFERRAL_RUN_ID``, ``DEFERRAL_TASK_ID`` (``task``: those three).

    It runs a command its kwargs hold (``runs_commands``): a triggerer with an encryption key
    builds it only from kwargs the engine stored encrypted, never from a plaintext row.
    """

    runs_commands = True

    def __init__(
        self,
        bash_command: str,
        *,
        env: Mapping[str, str] | None = None,
        append_env: bool = True,
        pass_env: Sequence[str] = (),
        cwd: str | None = None,
        retry_exit_code: int | None = None,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT_S,
        max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
        task: Sequence[str] = ("", "", ""),
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        end_from_trigger: bool = False,
    ) -> None:
        super().__init__(poll_interval=poll_interval, end_from_trigger=end_from_trigger)
        if not isinstance(bash_command, str) or not bash_command.strip():
            raise ValueError("bash_command must be a non-empty string")
        self.bash_command = bash_command
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.append_env = bool(append_env)
        if isinstance(pass_env, str) or not all(isinstance(n, str) for n in pass_env):
            raise ValueError("pass_env must be a list of variable names")
        self.pass_env = list(pass_env)
        self.cwd = cwd
        if retry_exit_code is not None and (
            isinstance(retry_exit_code, bool) or not isinstance(retry_exit_code, int)
        ):
            raise TypeError(f"retry_exit_code must be an int or None, got {retry_exit_code!r}")
        self.retry_exit_code = retry_exit_code
        if (
            isinstance(command_timeout, bool)
            or not isinstance(command_timeout, int | float)
            or not (math.isfinite(command_timeout) and command_timeout > 0)
        ):
            raise ValueError(
                f"command_timeout must be a positive number of seconds, got {command_timeout!r}"
            )
        self.command_timeout = float(command_timeout)
        if (
            isinstance(max_output_bytes, bool)
            or not isinstance(max_output_bytes, int)
            or max_output_bytes < 0
        ):
            raise ValueError(f"max_output_bytes must be an int >= 0, got {max_output_bytes!r}")
        self.max_output_bytes = max_output_bytes
        ids = list(task)
        if len(ids) != 3 or not all(isinstance(i, str) for i in ids):
            raise ValueError("task must be (dag_id, run_id, task_id)")
        self.task = ids

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.bash.BashTrigger",
            {
                "bash_command": self.bash_command,
                "env": self.env,
                "append_env": self.append_env,
                "pass_env": self.pass_env,
                "cwd": self.cwd,
                "retry_exit_code": self.retry_exit_code,
                "command_timeout": self.command_timeout,
                "max_output_bytes": self.max_output_bytes,
                "task": self.task,
                **self._base_kwargs(),
            },
        )

    def environment(self) -> dict[str, str]:
        """The command's environment, from the running process's."""
        base = clean_env(os.environ, self.pass_env) if self.append_env else {}
        dag_id, run_id, task_id = self.task
        return {
            **base,
            **self.env,
            "DEFERRAL_DAG_ID": dag_id,
            "DEFERRAL_RUN_ID": run_id,
            "DEFERRAL_TASK_ID": task_id,
        }

    async def check(self) -> Any:
        code = await self.run_command()
        if code == 0:
            return True
        if self.retry_exit_code is not None and code != self.retry_exit_code:
            # An event, not a TaskFailedEvent: the sensor fails without retries, as it does
            # in poke mode (the command said the condition will never be true).
            return TriggerEvent(
                {
                    "exit_code": code,
                    "error": f"command exited with status {code} (not 0, and not "
                    f"retry_exit_code {self.retry_exit_code}): {self.bash_command}",
                }
            )
        self.log.info("command exited with status %s: not yet", code)
        return None

    async def run_command(self) -> int:
        """Run the command once, logging its output (up to ``max_output_bytes``); its exit
        status. BashCommandTimeout past ``command_timeout``."""
        proc, transport = await start_command(
            ["bash", "-c", self.bash_command],
            stdin=asyncio.subprocess.DEVNULL,
            env=self.environment(),
            cwd=self.cwd,
        )
        try:
            async with asyncio.timeout(self.command_timeout):
                await self._log_output(proc)
                return await proc.wait()
        except TimeoutError:
            raise BashCommandTimeout(
                f"command ran longer than command_timeout ({self.command_timeout:g}s) and was "
                f"killed: {self.bash_command}"
            ) from None
        finally:
            await asyncio.shield(end_command(proc, transport))

    async def _log_output(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        kept = dropped = 0
        pending = b""
        while True:
            chunk = await proc.stdout.read(_CHUNK)
            pending += chunk
            lines = pending.split(b"\n")
            pending = lines.pop() if chunk else b""
            if len(pending) >= _CHUNK:  # a long line without a newline: logged in pieces
                lines.append(pending)
                pending = b""
            for line in lines:
                if not chunk and not line:
                    continue
                room = self.max_output_bytes - kept
                if room <= 0:
                    dropped += len(line) + 1
                    continue
                kept += min(len(line) + 1, room)
                dropped += max(0, len(line) + 1 - room)
                self.log.info("%s", line[:room].decode(errors="replace"))
            if not chunk:
                break
        if dropped:
            self.log.warning(
                "about %d more bytes of output not kept (max_output_bytes=%d)",
                dropped,
                self.max_output_bytes,
            )


async def start_command(
    args: Sequence[str], **options: Any
) -> tuple[asyncio.subprocess.Process, asyncio.SubprocessTransport]:
    """Start ``args`` in a session of its own (its process group is killed with it), its
    stdout and stderr on one pipe read as ``proc.stdout``; the process and its transport,
    which :func:`end_command` closes. ``options``: those of ``loop.subprocess_exec``."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.subprocess_exec(
        lambda: asyncio.subprocess.SubprocessStreamProtocol(limit=_LIMIT, loop=loop),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        **options,
    )
    return asyncio.subprocess.Process(transport, protocol, loop), transport


async def end_command(
    proc: asyncio.subprocess.Process, transport: asyncio.SubprocessTransport
) -> None:
    """Kill the command's process group if it still runs, let go of its output and reap it.

    Its output pipe ends when every process holding it has ended, not when the command has:
    one it started (killed with the group a moment later, or one that left the group) may
    still hold it. Until this side of the pipe is closed, the event loop watches it: uvloop
    then refuses to close (``OSError: [Errno 16] Device or resource busy`` when warnings are
    errors), Python 3.11's ``wait()`` does not return (it waits for the pipes too), and a
    long-lived triggerer would keep a descriptor per such run. So it is closed first (what
    the command wrote and was not read yet is dropped), and this returns once the loop has
    let go of the pipe and the command is reaped."""
    if proc.returncode is None:
        _kill_group(proc.pid)
    pipe = transport.get_pipe_transport(1)
    if pipe is not None:
        pipe.close()
    await proc.wait()
    assert proc.stdout is not None
    while await proc.stdout.read(_CHUNK):  # the end of the pipe, as the loop hands it on
        pass
    transport.close()


def _kill_group(pid: int) -> None:
    """Kill the command and whatever it started (its own session: ``start_new_session``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
