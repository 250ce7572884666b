"""Try DAG files in a child process before the engine imports them.

A DAG file is user code that runs at import. One that calls ``sys.exit()``, raises
``KeyboardInterrupt`` or loops forever would stop or hang the process that imports it (and, in
a worker, wedge its import lock). :func:`check_files` imports the files in a separate Python
process, one after the other, each within ``timeout_s``: a file that raises anything (any
``BaseException``), ends the process or overruns its time is reported with the cause, and the
child is killed (with its process group) when it overruns. Only the files that imported cleanly
there are imported in-process (see :class:`engine.dags.dagbag.DagBag`), like Airflow's DAG file
processor with its ``dag_file_processor_timeout``.

The child runs ``python -m engine.dags.dagparse <folder> <file>...`` with the parent's ``sys.path``
and writes one JSON line per file to the pipe whose descriptor it is given in
``DEFERRAL_DAGPARSE_FD``: ``{"i": <index>, "error": <text or null>}`` (after a first
``{"ready": true}`` line once its own imports are done).

A child killed because the process that started it stops (:class:`Interrupter`, or the exit of
that process) is no failure of the file it was importing: that file gets no result, and the
next check tries it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from engine.dags.dagfiles import module_name, path_module_name
from engine.dags.importerrors import describe

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_SETTING",
    "Failure",
    "Interrupter",
    "SlowImport",
    "check_files",
    "import_dag_file",
]

#: How long one DAG file may take to import (``dag_file_processor_timeout_s``).
DEFAULT_TIMEOUT_S = 30.0
#: The setting that bounds a file's import, named in the error of a file that overran it.
TIMEOUT_SETTING = "dag_file_processor_timeout_s"

_FD_ENV = "DEFERRAL_DAGPARSE_FD"
_PARENT_ENV = "DEFERRAL_DAGPARSE_PARENT"
#: How often the child checks that its parent still runs.
_PARENT_CHECK_S = 0.5
#: At most this much of a dead child's stderr goes into an import error.
_STDERR_TAIL = 2000


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why a DAG file could not be imported in the child process."""

    error: str
    #: Its import overran the time limit (it is not tried again until it changes).
    timed_out: bool = False


def import_dag_file(folder: Path | None, file: Path) -> str:
    """Import one DAG file (fresh: not already in ``sys.modules``); returns its module name."""
    name = module_name(folder, file) if folder is not None else None
    if name is not None:
        importlib.import_module(name)
        return name
    name = path_module_name(file)
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return name


class Interrupter:
    """Stops the imports of the :func:`check_files` calls it is given, from any thread: their
    children are killed, and the files they were importing get no result (neither imported
    nor failed). :meth:`interrupt` holds for the jobs started after it too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: weakref.WeakSet[_Job | SlowImport] = weakref.WeakSet()
        self.interrupted = False

    def add(self, job: _Job | SlowImport) -> None:
        with self._lock:
            self._jobs.add(job)
            if not self.interrupted:
                return
        job.interrupt()

    def interrupt(self) -> None:
        with self._lock:
            self.interrupted = True
            jobs = list(self._jobs)
        for job in jobs:
            job.interrupt()


def check_files(
    folder: Path | None,
    files: Sequence[Path],
    *,
    timeout_s: float,
    slow_s: float | None = None,
    interrupter: Interrupter | None = None,
) -> tuple[dict[Path, Failure | None], list[SlowImport]]:
    """Import each file in a child process; returns, per file, None if it imported cleanly or
    why it did not. A child that dies or overruns is replaced for the files after the one it
    was importing.

    With ``slow_s``: a file still importing after that long is left to its child (a
    :class:`SlowImport`, returned second, which the caller polls later) and the files after it
    go to a new child, so one slow file holds up no other; its result is not in the first
    map. ``interrupter``: stops these imports from another thread; the files not done by
    then have no result in the map (and its slow imports say they were ``stopped``)."""
    results: dict[Path, Failure | None] = {}
    slow: list[SlowImport] = []
    remaining = list(files)
    while remaining:
        job = _Job(folder, remaining, timeout_s)
        if interrupter is not None:
            interrupter.add(job)
        handed_off = False
        try:
            while not job.finished:
                wait = job.deadline - time.monotonic()
                if slow_s is not None and job.ready:
                    wait = min(wait, job.current_started + slow_s - time.monotonic())
                    if wait <= 0 and job.deadline > time.monotonic():
                        slow.append(SlowImport(job))
                        handed_off = True
                        break
                job.poll(max(wait, 0.0))
        finally:
            if not handed_off:
                job.close()
        results.update(job.results)
        if job.stopped:
            break
        remaining = remaining[len(job.results) + handed_off :]
    return results, slow


class SlowImport:
    """A file whose import outlasted ``slow_s``, still running in its child. :meth:`poll`
    returns its result once there is one (the child is then stopped); :meth:`close` stops it
    sooner (its file changed or went away)."""

    def __init__(self, job: _Job) -> None:
        self._job = job
        self._index = len(job.results)
        self.file = job.files[self._index]

    @property
    def stopped(self) -> bool:
        """Its child was interrupted (:class:`Interrupter`): the file has no result."""
        return self._job.stopped

    def interrupt(self) -> None:
        """From any thread: kill its child (see :meth:`stopped`)."""
        self._job.interrupt()

    def poll(self) -> tuple[bool, Failure | None]:
        """``(True, result)`` once the file's import ended (the child is then stopped),
        ``(False, None)`` while it goes on within its time."""
        job = self._job
        if self.file not in job.results and not job.finished:
            job.poll(0.0)
        if self.file not in job.results:
            return False, None
        self.close()
        return True, job.results[self.file]

    def wait(self) -> Failure | None:
        """The file's result, once there is one (within its time: an overrun is a failure)."""
        job = self._job
        while self.file not in job.results and not job.finished:
            job.poll(max(job.deadline - time.monotonic(), 0.0))
        self.close()
        return job.results.get(self.file, Failure(f"importing DAG file {self.file} was stopped"))

    def close(self) -> None:
        self._job.close()


class _Job:
    """One child importing ``files`` in order, and what it reported so far."""

    def __init__(self, folder: Path | None, files: list[Path], timeout_s: float) -> None:
        self.files = files
        self.timeout_s = timeout_s
        self.results: dict[Path, Failure | None] = {}
        self.ready = False
        #: The child ended (EOF) or was stopped: no more results will come.
        self.ended = False
        #: Its child was killed from outside (:meth:`interrupt`, or this process exiting): no
        #: failure of the file it was importing.
        self.stopped = False
        self._interrupted = threading.Event()
        self.current_started = time.monotonic()
        self.deadline = self.current_started + timeout_s
        self._buffer = b""
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        read_fd, write_fd = os.pipe()
        self._fd = read_fd
        try:
            self.child = subprocess.Popen(
                [sys.executable, "-m", "engine.dags.dagparse", str(folder or ""), *map(str, files)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                pass_fds=(write_fd,),
                env=_child_env(write_fd, folder),
                start_new_session=True,  # its process group is killed with it
            )
        except BaseException:
            os.close(read_fd)
            self._stderr.close()
            raise
        finally:
            os.close(write_fd)
        # A job dropped while its child still runs (a slow import nobody polls any more: its
        # bag was dropped, or the process exits) stops it all the same.
        self._finalizer = weakref.finalize(
            self, _end_job, self.child, read_fd, self._stderr, self._interrupted
        )

    @property
    def finished(self) -> bool:
        return self.ended or len(self.results) == len(self.files)

    def poll(self, wait_s: float) -> None:
        """Read what the child wrote within ``wait_s`` (0: what is there now); record the
        file it overran its time on, or died on."""
        if self.finished:
            return
        ready = select.select([self._fd], [], [], max(0.0, wait_s))[0]
        if not ready:
            if time.monotonic() >= self.deadline:
                self._overran()
            return
        chunk = os.read(self._fd, 65536)
        if not chunk:
            self._died()
            return
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if message.get("ready"):
                self.ready = True
            else:
                error = message["error"]
                self.results[self.files[message["i"]]] = None if error is None else Failure(error)
            self.current_started = time.monotonic()
            self.deadline = self.current_started + self.timeout_s

    def _overran(self) -> None:
        file = self.files[len(self.results)]
        what = f"importing DAG file {file}" if self.ready else "starting to import DAG files"
        self.results[file] = Failure(
            f"{what} took longer than {self.timeout_s:g} s (setting {TIMEOUT_SETTING}); "
            "the import was stopped",
            # A child too slow to start blames no file for good: tried again next time.
            timed_out=self.ready,
        )
        self.ended = True
        self.close()

    def interrupt(self) -> None:
        """From any thread: kill the child (the thread that polls the job sees it end, and
        records no result for its file)."""
        self._interrupted.set()
        if not self.ended:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child.pid, signal.SIGKILL)

    def _died(self) -> None:
        self._stop()
        if self._interrupted.is_set():
            self.stopped = True  # killed because this process stops: not the file's doing
        elif len(self.results) < len(self.files):
            self._stderr.seek(0)
            tail = self._stderr.read().decode("utf-8", "replace")[-_STDERR_TAIL:].rstrip()
            file = self.files[len(self.results)]
            self.results[file] = Failure(
                f"importing DAG file {file} ended the process that imported it "
                f"(exit code {self.child.returncode})" + (f":\n{tail}" if tail else "")
            )
        self.close()

    def _stop(self) -> None:
        """Kill the child with its process group (no more results come)."""
        self.ended = True
        _kill(self.child)

    def close(self) -> None:
        """Stop the child and free what it held; harmless twice."""
        self.ended = True
        self._finalizer()


def _kill(child: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # (what it started goes with it)
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _end_job(
    child: subprocess.Popen[bytes], fd: int, stderr: IO[bytes], interrupted: threading.Event
) -> None:
    # (At this process's exit a scan thread may still poll the job: the child's end is not
    # its file's failure.)
    interrupted.set()
    _kill(child)
    os.close(fd)
    stderr.close()


def _child_env(write_fd: int, folder: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DEFERRAL_CRASH_AT", None)  # the kill matrix aims at the engine, not at this child
    # Not the DAGs folder: the child puts it first on its path once the engine is imported, so
    # a DAG file named like an engine package (``triggers.py``) cannot replace that package
    # and fail every file of the folder.
    skip = {str(folder)} if folder is not None else set()
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and p not in skip)
    env[_FD_ENV] = str(write_fd)
    env[_PARENT_ENV] = str(os.getpid())
    return env


def _exit_with_parent(parent: int) -> None:
    """End this child once its parent is gone (it runs in a session of its own, so nothing
    else stops it: a scheduler that stopped or died while a file hung at import would leave
    it running for good)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _child_main(argv: list[str]) -> None:
    _exit_with_parent(int(os.environ[_PARENT_ENV]))
    out = os.fdopen(int(os.environ[_FD_ENV]), "w", buffering=1)
    folder = Path(argv[0]) if argv[0] else None
    if folder is not None:
        sys.path.insert(0, str(folder))
    out.write(json.dumps({"ready": True}) + "\n")
    for i, raw in enumerate(argv[1:]):
        file = Path(raw)
        error: str | None = None
        try:
            import_dag_file(folder, file)
        except BaseException as exc:  # any way out of user code is that file's import error
            error = describe(file, exc)
        out.write(json.dumps({"i": i, "error": error}) + "\n")
    out.flush()
    os._exit(0)  # not interpreter exit: threads a DAG file started must not hold it up


if __name__ == "__main__":
    _child_main(sys.argv[1:])
