"""Load DAG files from a folder.

The folder goes on ``sys.path`` and each file is imported under its dotted path relative to it
(:mod:`engine.dags.dagfiles`: which files, their module names, the names a file may not take).
A file that fails to import is reported by name and does not stop the others.

A file is imported again only when it changed: its modification time, size or inode
(one ``stat``) differ from the import's, *and* its content does (a SHA-256 of the bytes, read
only when the ``stat`` differs). A file rewritten with the same bytes (a deploy that copies the
whole folder, a ``touch``) is not imported again; its new ``stat`` is remembered.

A file still importing in its child after ``SLOW_IMPORT_S`` is left to finish there (within
its ``dag_file_processor_timeout_s``) while the files after it go to another child: one slow
file holds up no other. ``collect()`` then waits for it by default; the scheduler's periodic
scan does not (``collect(wait_slow=False)``: the file's DAGs are loaded by a later scan, once
its import ended), nor does :meth:`DagBag.get_dag` for a DAG found without it.

A new or changed file is first imported in a child process (:mod:`engine.dags.dagparse`), within
``dag_file_processor_timeout_s``; only if that succeeded is it imported here, where the worker
and the scheduler need its DAG objects. So a file that calls ``sys.exit()``, raises
``KeyboardInterrupt`` or never finishes importing is an import error, not a stopped or hung
process. (A file that behaves differently on its second import can still fail here: any
``BaseException`` is caught around this import too.) A file that overran its time is not tried
again until it changes.

A module or package at the top of the folder named like one of the engine's packages
(``engine.py``, ``triggers/``, ...) or a standard library module (``json.py``) is an import error
saying what to rename. Each import error (:mod:`engine.dags.importerrors`) is logged once per
change of its file: a short first line with the traceback under it; the same error in the
unchanged file again only at DEBUG level.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

from engine.dags import dagparse
from engine.dags.dag import DAG, dags_of_module, forget_module
from engine.dags.dagfiles import (
    FileStat,
    dag_files,
    file_digest,
    file_stat,
    module_name,
    reserved_entries,
    stat_or_none,
)
from engine.dags.importerrors import ErrorReports, describe, error_summary
from engine.runtime.crashpoints import crash_point
from operators.base import BaseOperator

__all__ = ["NO_FOLDER_HINT", "SLOW_IMPORT_S", "DagBag", "add_to_sys_path"]


log = logging.getLogger(__name__)

#: A file still importing (in its child) after this many seconds is left to finish there while
#: the files after it are checked.
SLOW_IMPORT_S = 2.0

#: What to do when a process needs DAGs and has no folder (in errors that come of it).
NO_FOLDER_HINT = "pass --dags FOLDER or set DEFERRAL_DAGS_FOLDER"


def add_to_sys_path(folder: str | os.PathLike[str] | None) -> Path | None:
    """Put a DAGs folder first on ``sys.path`` (once), so classpaths under it import."""
    if folder is None:
        return None
    path = Path(folder).expanduser().resolve()
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    return path


class _Snapshot:
    """What readers see of a bag: its DAGs, the ``stat`` of the files they were loaded from,
    and the import errors, from one (re)load. A reload builds a new one and swaps it in with one
    assignment, so a reader (the worker's loop, while a reload runs in a thread) sees the old
    bag or the new one, never a half-built one."""

    __slots__ = ("checked", "dags", "import_errors", "reported", "stats")

    def __init__(
        self,
        dags: dict[str, DAG],
        stats: dict[str, FileStat],
        import_errors: dict[str, str],
        reported: tuple[str, ...] = (),
    ) -> None:
        self.dags = dags
        #: The ``stat`` of each loaded file, by path string: the check before every task run
        #: is one stat(), with no Path to build.
        self.stats = stats
        self.import_errors = import_errors
        #: The paths whose import error this (re)load logged: new or changed since last time.
        self.reported = reported
        #: When each file was last found unchanged by a ``stat`` (``time.monotonic()`` read
        #: just before it), by path string: :meth:`DagBag.is_current` with ``checked_since``.
        self.checked: dict[str, float] = {}


class _Loaded:
    """A file imported here: its module, its DAGs, and the ``stat`` and content digest it had."""

    __slots__ = ("dags", "digest", "module", "stat")

    def __init__(self, module: ModuleType, stat: FileStat, digest: str, dags: list[DAG]) -> None:
        self.module = module
        self.stat = stat
        self.digest = digest
        self.dags = dags


class DagBag:
    """The DAGs of one folder, reloaded when their file changes.

    Reads (:attr:`dags`, :meth:`is_current`, :meth:`get_dag` of a current DAG) may run on
    any thread while another reloads: every reload builds new maps and swaps them in at once.
    Reloads themselves take turns (a lock).
    """

    def __init__(
        self,
        folder: str | os.PathLike[str] | None,
        *,
        processor_timeout_s: float = dagparse.DEFAULT_TIMEOUT_S,
    ) -> None:
        if not processor_timeout_s > 0:
            raise ValueError(f"processor_timeout_s must be > 0, got {processor_timeout_s!r}")
        self.folder = add_to_sys_path(folder)
        self.processor_timeout_s = processor_timeout_s
        self._snapshot = _Snapshot({}, {}, {})
        #: Held by whoever (re)loads: the state below belongs to the reload in progress.
        self._reload_lock = threading.RLock()
        self._modules: dict[Path, _Loaded] = {}
        #: Import errors of the reload in progress (a copy of the snapshot's, then swapped in).
        self._errors: dict[str, str] = {}
        self._extra: dict[str, DAG] = {}
        #: Files whose import overran its time, with the ``stat`` they had then.
        self._overran: dict[Path, FileStat] = {}
        #: Files still importing in a child of their own (slow), with their ``stat`` and
        #: content digest.
        self._slow: dict[Path, tuple[FileStat, str, dagparse.SlowImport]] = {}
        #: Logs each import error once per change of its file.
        self._reports = ErrorReports(log)
        #: Stops the imports in flight of the (re)load in progress (:meth:`interrupt_imports`).
        self._interrupter = dagparse.Interrupter()
        #: Files imported in this process (each import of a new or changed file), and files
        #: whose ``stat`` changed but not their content (not imported again): for tests and
        #: introspection.
        self.imports = 0
        self.unchanged_rewrites = 0
        if self.folder is not None and not self.folder.is_dir():
            raise FileNotFoundError(f"DAGs folder {self.folder} does not exist")

    @property
    def dags(self) -> Mapping[str, DAG]:
        """Every DAG of the bag's last (re)load, by id (read-only: never changed in place)."""
        return self._snapshot.dags

    @property
    def import_errors(self) -> Mapping[str, str]:
        """The error of each file that failed to import, by path (read-only)."""
        return self._snapshot.import_errors

    @property
    def newly_reported(self) -> tuple[str, ...]:
        """The paths whose import error the last (re)load logged (new or changed errors)."""
        return self._snapshot.reported

    def files(self) -> list[Path]:
        """The folder's DAG files (:func:`engine.dags.dagfiles.dag_files`)."""
        return dag_files(self.folder)

    def collect(self, *, wait_slow: bool = True) -> Mapping[str, DAG]:
        """(Re)load every file whose content changed; returns all DAGs. ``wait_slow=False``:
        a file whose import is slow (:data:`SLOW_IMPORT_S`) is not waited for; its DAGs are
        loaded by a later call once its import ended."""
        with self._reload_lock:
            self._interrupter = dagparse.Interrupter()
            return self._collect(wait_slow)

    def interrupt_imports(self) -> None:
        """From any thread: stop the imports of the (re)load in progress, this process is
        stopping (a scheduler's scan). Their children are killed, and that is no import error:
        the files they were importing are neither loaded nor failed, and the next (re)load
        checks them again."""
        self._interrupter.interrupt()

    @property
    def slow_imports(self) -> list[Path]:
        """The files whose import goes on in a child of their own (not loaded yet)."""
        return list(self._slow)

    def _collect(self, wait_slow: bool) -> Mapping[str, DAG]:
        reserved = reserved_entries(self.folder)
        files = [f for f in self.files() if not any(f == r or r in f.parents for r in reserved)]
        self._drop_stale_slow(set(files))
        self._errors = dict(self._snapshot.import_errors)
        self._reports.begin()
        for entry, error in reserved.items():
            self._errors[str(entry)] = error
            self._reports.report(str(entry), stat_or_none(entry), error)
        changed = [c for c in map(self._needs_import, files) if c is not None]
        if changed:
            crash_point("dagbag.parse")
            checked, slow = dagparse.check_files(
                self.folder,
                [file for file, _, _ in changed],
                timeout_s=self.processor_timeout_s,
                slow_s=SLOW_IMPORT_S,
                interrupter=self._interrupter,
            )
            signatures = {file: (stat, digest) for file, stat, digest in changed}
            for job in slow:
                log.info(
                    "DAG file %s is still importing after %g s: the other files go on; its DAGs "
                    "are loaded once its import ends (within %g s, setting %s)",
                    job.file,
                    SLOW_IMPORT_S,
                    self.processor_timeout_s,
                    dagparse.TIMEOUT_SETTING,
                )
                self._slow[job.file] = (*signatures[job.file], job)
            for file, stat, digest in changed:
                if file in checked:
                    self._load(file, stat, digest, checked[file])
        for file, (stat, digest, job) in list(self._slow.items()):
            self._interrupter.add(job)  # (begun by an earlier load)
            ended, result = (True, job.wait()) if wait_slow else job.poll()
            if job.stopped:  # (interrupted: no result, checked again next time)
                del self._slow[file]
            elif ended:
                del self._slow[file]
                self._load(file, stat, digest, result)
        seen = set(files)
        for gone in set(self._modules) - seen:
            del self._modules[gone]
        for gone in set(self._overran) - seen:
            del self._overran[gone]
        present = {str(f) for f in seen} | {str(r) for r in reserved}
        for stale in set(self._errors) - present:
            del self._errors[stale]
        self._reports.keep(present)
        stats = {str(file): loaded.stat for file, loaded in self._modules.items()}
        built = dict(self._extra)
        for file, loaded in self._modules.items():
            for dag in loaded.dags:
                if dag.dag_id in built and built[dag.dag_id] is not dag:
                    other = built[dag.dag_id].fileloc
                    error = f"DAG {dag.dag_id!r} is also defined in {other}"
                    self._errors[str(file)] = error
                    self._reports.report(str(file), loaded.stat, error)
                    continue
                dag.fileloc = str(file)
                built[dag.dag_id] = dag
        self._snapshot = _Snapshot(built, stats, self._errors, tuple(self._reports.new))
        return built

    def _drop_stale_slow(self, files: set[Path]) -> None:
        """Stop the slow imports of files gone or changed since they began (a changed one
        is checked again)."""
        for file, (stat, _, job) in list(self._slow.items()):
            current = stat_or_none(file) if file in files else None
            if current != stat:
                job.close()
                del self._slow[file]

    def _needs_import(self, file: Path) -> tuple[Path, FileStat, str] | None:
        """``(file, stat, digest)`` if the file is new or its content changed since it was
        imported (or since it overran); None when it is unchanged, gone, or its import still
        runs. A file whose ``stat`` changed but not its bytes keeps its module: only the new
        ``stat`` is kept."""
        try:
            stat = file_stat(file)
        except OSError:
            return None  # removed since it was listed
        if file in self._slow:
            return None  # (a changed one was dropped from the slow imports first)
        known = self._modules.get(file)
        if (known is not None and known.stat == stat) or self._overran.get(file) == stat:
            return None
        try:
            digest = file_digest(file)
        except OSError:
            return None
        if known is not None and known.digest == digest:
            log.debug("DAG file %s was rewritten with the same content: not imported again", file)
            known.stat = stat
            self.unchanged_rewrites += 1
            return None
        # Cached bytecode is checked by modification time (in seconds) and size only: a change
        # that keeps both would run the old code.
        with contextlib.suppress(OSError, ValueError, NotImplementedError):
            os.unlink(importlib.util.cache_from_source(str(file)))
        return file, stat, digest

    def _load(
        self, file: Path, stat: FileStat, digest: str, failed: dagparse.Failure | None
    ) -> None:
        """Import a file here, unless importing it in a child process ``failed``: then that
        error stands for it."""
        known = self._modules.get(file)
        self._overran.pop(file, None)
        if failed is not None:
            if failed.timed_out:
                self._overran[file] = stat
            self._fail(file, stat, known, failed.error)
            return
        name = module_name(self.folder, file) if self.folder else None
        try:
            self.imports += 1
            if known is not None:
                forget_module(known.module.__name__)
                module = importlib.reload(known.module)
            else:
                if name is not None:
                    cached = sys.modules.get(name)
                    if cached is not None and getattr(cached, "__file__", None) != str(file):
                        # Another folder's module of the same name was imported before: this
                        # file must not be shadowed by it.
                        del sys.modules[name]
                    if name not in sys.modules:
                        forget_module(name)
                module = sys.modules[dagparse.import_dag_file(self.folder, file)]
            dags = dags_of_module(module.__name__)
            for dag in dags:
                dag.validate()
        except BaseException as exc:  # user code: even SystemExit is this file's import error
            self._fail(file, stat, known, describe(file, exc))
            return
        self._errors.pop(str(file), None)
        self._reports.forget(str(file))
        self._modules[file] = _Loaded(module, stat, digest, dags)

    def _fail(self, file: Path, stat: FileStat, known: _Loaded | None, error: str) -> None:
        self._errors[str(file)] = error
        self._reports.report(str(file), stat, error)
        if known is not None:
            # A failed reload leaves the half-run module in sys.modules; once the file is
            # fixed, import_module would return it without running the fixed code.
            sys.modules.pop(known.module.__name__, None)
        self._modules.pop(file, None)

    def is_current(self, dag_id: str, *, checked_since: float | None = None) -> bool:
        """True when the DAG is loaded and its file has not changed since (no import needed).

        ``checked_since`` (a ``time.monotonic()``): a ``stat`` of the file begun after it that
        found the file unchanged answers for this one too, with no ``stat`` of its own. The
        worker passes the time a claim's reply arrived, so the tries of one claim share one
        ``stat``, and a file saved before that reply is seen all the same (the shared
        ``stat`` came after it)."""
        snapshot = self._snapshot
        dag = snapshot.dags.get(dag_id)
        if dag is None:
            return False
        file = dag.fileloc
        if not file or dag_id in self._extra:
            return True
        if checked_since is not None:
            seen = snapshot.checked.get(file)
            if seen is not None and seen > checked_since:
                return True
        began = time.monotonic()  # (read before the stat: edits saved before it are seen)
        if self._changed(snapshot, file):
            return False
        snapshot.checked[file] = began
        return True

    def get_dag(self, dag_id: str) -> DAG:
        """The DAG, (re)loading the folder first if it is unknown or its file changed. A slow
        file is waited for only if it is the DAG's or the DAG is not found without it."""
        if not self.is_current(dag_id):
            self.collect(wait_slow=False)
            found = self._snapshot.dags.get(dag_id)
            if self._slow and (found is None or Path(found.fileloc) in self._slow):
                self.collect()  # (its file is slow to import: its new code is waited for)
        snapshot = self._snapshot
        dag = snapshot.dags.get(dag_id)
        if dag is None:
            raise LookupError(self.missing_dag_message(dag_id))
        return dag

    def missing_dag_message(self, dag_id: str) -> str:
        """Why ``dag_id`` is not in the bag: no folder, or the files that failed to import."""
        if self.folder is None:
            return f"no DAG {dag_id!r}: no DAGs folder is configured ({NO_FOLDER_HINT})"
        errors = self._snapshot.import_errors
        if not errors:
            return f"no DAG {dag_id!r} in {self.folder}"
        # A file named like the DAG first: it is the likely one.
        paths = sorted(errors, key=lambda path: (dag_id not in Path(path).name, path))
        shown = "; ".join(f"{path}: {error_summary(errors[path])}" for path in paths[:3])
        more = f" (and {len(paths) - 3} more)" if len(paths) > 3 else ""
        return (
            f"no DAG {dag_id!r} in {self.folder}; {len(paths)} file(s) there failed to "
            f"import: {shown}{more}"
        )

    def get_task(self, dag_id: str, task_id: str) -> BaseOperator:
        return self.get_dag(dag_id).get_task(task_id)

    @staticmethod
    def _changed(snapshot: _Snapshot, file: str) -> bool:
        """The file's ``stat`` is not the one it was loaded with (a reload then compares its
        content)."""
        known = snapshot.stats.get(file)
        try:
            return known is None or file_stat(file) != known
        except OSError:
            return True

    def add_dag(self, dag: DAG) -> None:
        """Register a DAG built in code (tests, benchmarks, the demo) rather than from a file."""
        dag.validate()
        with self._reload_lock:
            self._extra[dag.dag_id] = dag
            old = self._snapshot
            self._snapshot = _Snapshot({**old.dags, dag.dag_id: dag}, old.stats, old.import_errors)
