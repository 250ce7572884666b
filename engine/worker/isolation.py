"""Run a task's ``execute`` (or resumed method) in a child process the worker can stop.

A plain ``def`` runs in a worker thread, and Python cannot stop a thread: past its
``execution_timeout`` the task is failed but its thread runs on (holding its slot). An operator
built with ``isolation="process"`` is run here instead, in a child process that the timeout
ends: SIGTERM to its process group, then SIGKILL after a short grace.

The child is ``python -m engine.worker.isolation``, a fresh interpreter (not a fork of the worker,
so it shares none of the worker's threads, connections or memory). It finds the operator the way
the worker did: it imports the task's DAG file itself (the worker's ``sys.path`` is passed on
as ``PYTHONPATH``), so nothing of the operator needs to be picklable. The request (the file,
the DAG and task ids, the method, the context and the resume kwargs) comes on its stdin as
MessagePack; the reply goes to the stdout it was started with, while the task's own prints
go to stderr with its log lines. What the task did is classified in the child by the function
a worker thread uses (:func:`engine.worker.outcomes.outcome_of_call`) and comes back as that
:data:`~engine.worker.outcomes.TryOutcome`, as it is: the worker records it as it would a
thread's.

The child runs in a process group of its own, which the worker signals; and it watches its
worker: if the worker dies (even by SIGKILL), the child kills its own process group.

The child gets a clean environment, as a BashOperator command does
(:func:`operators.bash.clean_env`): no database URL, no Fernet keys, no ``DEFERRAL_*`` secrets.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import msgspec

from engine.worker.outcomes import Raised, Returned, TryOutcome, outcome_of_call
from operators.bash import clean_env

__all__ = [
    "DEFAULT_KILL_GRACE_S",
    "ChildEnded",
    "Request",
    "child_env",
    "run_isolated",
    "run_request",
]

log = logging.getLogger(__name__)

#: How long a child has between SIGTERM and SIGKILL once its task's time is up.
DEFAULT_KILL_GRACE_S = 5.0
#: A reply larger than this is refused (results are limited far below it).
MAX_REPLY_BYTES = 64 << 20
#: How often a child checks that its worker is still there.
PARENT_CHECK_S = 0.2
#: After the reply, how long the worker reads what the child wrote last.
READ_REST_S = 2.0
#: Of a line of the child's output, at most this many bytes are kept (the rest is counted as
#: cut), unless the caller asks for more.
MAX_OUTPUT_LINE = 256 << 10


class Request(msgspec.Struct, frozen=True):
    """What the child is to run."""

    folder: str | None
    file: str
    dag_id: str
    task_id: str
    #: The resumed method, or None for ``execute``.
    method: str | None
    #: ``encode_value`` of the context and of the keyword arguments (resume kwargs and event).
    context: bytes
    kwargs: bytes
    log_level: str = "INFO"
    #: How the child writes its log lines: "text", or "json" for a worker that stores them.
    log_format: str = "text"
    #: The worker's pid: the child ends itself (and its process group) once it is gone.
    parent_pid: int = 0
    #: A mapped instance's own arguments (``encode_data``; None: not mapped), and which of
    #: them came from upstream XComs (not rendered as templates).
    map_value: bytes | None = None
    map_resolved: list[str] = []


class ChildEnded(Exception):
    """The child ended without a reply (killed, crashed, or ``os._exit`` in the task)."""


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The child's environment: what a BashOperator command gets (no secrets), plus this
    process's ``sys.path`` as ``PYTHONPATH`` so that the engine and the DAG file import."""
    env = clean_env(environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


async def run_isolated(
    request: Request,
    *,
    timeout_s: float | None,
    kill_grace_s: float = DEFAULT_KILL_GRACE_S,
    on_output: Callable[[str, int], None] | None = None,
    max_line_bytes: int = 0,
) -> TryOutcome | None:
    """Run the request in a child process; how the try ended, or None if ``timeout_s`` passed first
    (the child is then gone: SIGTERM, and SIGKILL after ``kill_grace_s``). If the caller is
    cancelled, the child is stopped the same way. :class:`ChildEnded` if it died unanswered.

    ``on_output``: called with each line the child writes to its stderr (its log lines, in
    the format the request names, and its prints) and the bytes cut of it: of a line, what
    can be stored (``max_line_bytes``) is kept, with room for a JSON log line's quoting;
    None: they go where the worker's go."""
    keep = max(MAX_OUTPUT_LINE, 2 * max_line_bytes + 4096)
    proc = await anyio.open_process(
        [sys.executable, "-m", "engine.worker.isolation"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=None if on_output is None else subprocess.PIPE,
        env=child_env(os.environ),
        start_new_session=True,  # its process group is stopped with it
    )
    try:
        async with anyio.create_task_group() as tg:
            read_all = anyio.Event()
            if on_output is not None and proc.stderr is not None:
                tg.start_soon(_read_lines, proc.stderr, on_output, read_all, keep)
            else:
                read_all.set()
            reply: TryOutcome | None = None
            ended: ChildEnded | None = None  # (raised out of the task group, not in it)
            with anyio.move_on_after(timeout_s):
                try:
                    data = await _exchange(proc, msgspec.msgpack.encode(request))
                except ChildEnded as exc:
                    ended = exc
                else:
                    code = await proc.wait()
                    try:
                        reply = msgspec.msgpack.decode(data, type=TryOutcome) if data else None
                    except msgspec.DecodeError as exc:
                        ended = ChildEnded(f"its reply could not be read ({exc})")
                    if not data:
                        ended = ChildEnded(_describe_exit(code))
            # What it wrote last (a process it started may hold the pipe open: not waited for).
            if proc.returncode is not None:
                with anyio.move_on_after(READ_REST_S):
                    await read_all.wait()
            tg.cancel_scope.cancel()
        if ended is not None:
            raise ended
        return reply
    finally:
        with anyio.CancelScope(shield=True):
            await _stop(proc, kill_grace_s)


async def _read_lines(
    stream: anyio.abc.ByteReceiveStream,
    on_line: Callable[[str, int], None],
    done: anyio.Event,
    keep: int = MAX_OUTPUT_LINE,
) -> None:
    """Hand each line of ``stream`` to ``on_line`` (decoded, without its newline) with the
    bytes cut of it, until it ends: of a line, the first ``keep`` bytes are kept, whatever its
    length (the worker's memory does not grow with what a child prints)."""
    line = bytearray()
    cut = 0

    def hand_on() -> None:
        nonlocal line, cut
        on_line(line.decode("utf-8", "replace").rstrip("\r"), cut)
        line, cut = bytearray(), 0

    try:
        async for chunk in stream:
            start = 0
            while True:
                end = chunk.find(b"\n", start)
                stop = len(chunk) if end < 0 else end
                room = max(keep - len(line), 0)
                line += chunk[start : min(stop, start + room)]
                cut += max(stop - start - room, 0)
                if end < 0:
                    break
                hand_on()
                start = end + 1
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass
    if line or cut:
        hand_on()
    done.set()


async def _exchange(proc: anyio.abc.Process, request: bytes) -> bytes:
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        await proc.stdin.send(request)
        await proc.stdin.aclose()
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass  # it died before reading: its exit status says why
    chunks: list[bytes] = []
    size = 0
    async for chunk in proc.stdout:
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise ChildEnded(f"its reply is over {MAX_REPLY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the child process running the task was killed by {name} before it replied"
    return f"the child process running the task exited with status {code} before it replied"


async def _stop(proc: anyio.abc.Process, grace_s: float) -> None:
    """End the child and its process group: SIGTERM, then SIGKILL after ``grace_s``."""
    if proc.returncode is None:
        _signal_group(proc.pid, signal.SIGTERM)
        with anyio.move_on_after(grace_s):
            await proc.wait()
        if proc.returncode is None:
            log.warning(
                "the child process %s did not end within %.1fs of SIGTERM; sending SIGKILL",
                proc.pid,
                grace_s,
            )
            _signal_group(proc.pid, signal.SIGKILL)
            await proc.wait()
    await proc.aclose()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


# -- the child -------------------------------------------------------------------------------


def _locate(request: Request) -> Any:
    """The operator, from the DAG file imported here."""
    from engine.dags.dag import dags_of_module
    from engine.dags.dagbag import add_to_sys_path
    from engine.dags.dagparse import import_dag_file
    from triggers.base import decode_value

    folder = add_to_sys_path(request.folder)
    module = import_dag_file(folder, Path(request.file))
    for dag in dags_of_module(module):
        if dag.dag_id == request.dag_id:
            op = dag.get_task(request.task_id)
            if request.map_value is not None and hasattr(op, "unmap"):
                # a mapped instance's own operator
                return op.unmap(decode_value(request.map_value), request.map_resolved)
            return op
    raise LookupError(f"the DAG file {request.file} defines no DAG {request.dag_id!r}")


def _call(request: Request, seen: list[Any]) -> Any:
    from engine.worker import templating
    from triggers.base import decode_value

    op = _locate(request)
    fn = getattr(op, request.method) if request.method else op.execute
    context = templating.restore_context(decode_value(request.context), op)
    seen.append(context["outlet_events"])  # (what the task set of its outlets' events)
    # The worker rendered the same fields from the same values (and stored them): render
    # them again here, on this process's copy of the operator.
    templating.prepare(op).render(context)
    kwargs = decode_value(request.kwargs)
    if inspect.iscoroutinefunction(fn):
        return asyncio.run(fn(context, **kwargs))
    return fn(context, **kwargs)


def run_request(request: Request) -> TryOutcome:
    """Run the task in this process; how the try ended (finding the operator and rendering
    its fields included: what fails there fails the try as in the worker)."""
    task = f"{request.dag_id}.{request.task_id}"
    seen: list[Any] = []
    outcome = outcome_of_call(functools.partial(_call, request, seen), task=task)
    if isinstance(outcome, Returned) and seen and len(seen[0]):
        try:
            events = seen[0].events()
        except ValueError as exc:
            return Raised(f"task {task}: {exc}", no_retry=True)
        return msgspec.structs.replace(outcome, asset_events=events)
    return outcome


def _end_with_parent(parent_pid: int) -> None:
    """A worker killed with SIGKILL cannot stop its children: each one watches its parent
    and, once it is gone, kills its own process group (the task and what it started)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="isolation-parent-watch", daemon=True).start()


def main() -> None:
    # The reply goes to the stdout this process was given; the task's prints go to stderr.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    request = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=Request)
    if request.parent_pid:
        _end_with_parent(request.parent_pid)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    from engine.runtime import logs

    logs.configure_logging(request.log_level, request.log_format)
    with logs.binding(dag=request.dag_id, task=request.task_id, pid=os.getpid()):
        reply = run_request(request)
    with os.fdopen(reply_fd, "wb") as out:
        out.write(msgspec.msgpack.encode(reply))
    sys.stdout.flush()
    sys.stderr.flush()
    # Threads the task left running must not keep the process (and its slot) alive.
    os._exit(0)


if __name__ == "__main__":
    main()
