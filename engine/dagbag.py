"""Load DAG files from a folder.

The folder goes on ``sys.path`` and each file is imported under its dotted path
relative to it (``orders.py`` -> module ``orders``, ``team/etl.py`` ->
``team.etl``), so a trigger class defined next to the DAGs has a classpath the
triggerer can import. A file that fails to import is reported by name and does
not stop the others.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType

from engine.dag import DAG, dags_of_module, forget_module
from operators.base import BaseOperator

__all__ = ["DagBag", "add_to_sys_path"]

log = logging.getLogger(__name__)


def add_to_sys_path(folder: str | os.PathLike[str] | None) -> Path | None:
    """Put a DAGs folder first on ``sys.path`` (once), so classpaths under it import."""
    if folder is None:
        return None
    path = Path(folder).expanduser().resolve()
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    return path


def _module_name(folder: Path, file: Path) -> str | None:
    parts = list(file.relative_to(folder).with_suffix("").parts)
    if all(p.isidentifier() for p in parts):
        return ".".join(parts)
    return None


class DagBag:
    """The DAGs of one folder, reloaded when their file changes."""

    def __init__(self, folder: str | os.PathLike[str] | None) -> None:
        self.folder = add_to_sys_path(folder)
        self.dags: dict[str, DAG] = {}
        self.import_errors: dict[str, str] = {}
        self._modules: dict[Path, tuple[ModuleType, float, list[DAG]]] = {}
        #: Modification time of each loaded file, by path string: the check before every
        #: task run is one stat(), with no Path to build.
        self._mtimes: dict[str, float] = {}
        self._extra: dict[str, DAG] = {}
        if self.folder is not None and not self.folder.is_dir():
            raise FileNotFoundError(f"DAGs folder {self.folder} does not exist")

    def files(self) -> list[Path]:
        if self.folder is None:
            return []
        found = []
        for root, dirs, names in os.walk(self.folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
            for name in sorted(names):
                if name.endswith(".py") and not name.startswith(("_", ".")):
                    found.append(Path(root) / name)
        return found

    def collect(self) -> dict[str, DAG]:
        """(Re)load every file whose modification time changed; returns all DAGs."""
        seen: set[Path] = set()
        for file in self.files():
            seen.add(file)
            self._load(file)
        for gone in set(self._modules) - seen:
            del self._modules[gone]
        self._mtimes = {str(file): known[1] for file, known in self._modules.items()}
        self.dags = dict(self._extra)
        for file, (_, _, dags) in self._modules.items():
            for dag in dags:
                if dag.dag_id in self.dags and self.dags[dag.dag_id] is not dag:
                    other = self.dags[dag.dag_id].fileloc
                    self.import_errors[str(file)] = f"DAG {dag.dag_id!r} is also defined in {other}"
                    continue
                dag.fileloc = str(file)
                self.dags[dag.dag_id] = dag
        return self.dags

    def _load(self, file: Path) -> None:
        mtime = file.stat().st_mtime
        known = self._modules.get(file)
        if known is not None and known[1] == mtime:
            return
        name = _module_name(self.folder, file) if self.folder else None
        try:
            if known is not None:
                forget_module(known[0].__name__)
                module = importlib.reload(known[0])
            elif name is not None:
                cached = sys.modules.get(name)
                if cached is not None and getattr(cached, "__file__", None) != str(file):
                    # Another folder's module of the same name was imported before: this
                    # file must not be shadowed by it.
                    del sys.modules[name]
                if name not in sys.modules:
                    forget_module(name)
                module = importlib.import_module(name)
            else:
                module = self._import_by_path(file)
            dags = dags_of_module(module.__name__)
            for dag in dags:
                dag.validate()
        except Exception as exc:
            self.import_errors[str(file)] = "".join(traceback.format_exception(exc)).rstrip()
            log.error("DAG file %s failed to import:\n%s", file, self.import_errors[str(file)])
            if known is not None:
                # A failed reload leaves the half-run module in sys.modules; once the file is
                # fixed, import_module would return it without running the fixed code.
                sys.modules.pop(known[0].__name__, None)
            self._modules.pop(file, None)
            return
        self.import_errors.pop(str(file), None)
        self._modules[file] = (module, mtime, dags)

    @staticmethod
    def _import_by_path(file: Path) -> ModuleType:
        name = "deferral_dag_" + "".join(c if c.isalnum() else "_" for c in str(file))
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    def is_current(self, dag_id: str) -> bool:
        """True when the DAG is loaded and its file has not changed since (no import needed)."""
        if dag_id in self._extra:
            return True
        dag = self.dags.get(dag_id)
        return dag is not None and not (dag.fileloc and self._changed(dag.fileloc))

    def get_dag(self, dag_id: str) -> DAG:
        """The DAG, (re)loading the folder first if it is unknown or its file changed."""
        if not self.is_current(dag_id):
            self.collect()
        dag = self.dags.get(dag_id)
        if dag is None:
            where = f" in {self.folder}" if self.folder else " (no DAGs folder is configured)"
            error = next((f"; {f} failed to import" for f in self.import_errors if dag_id in f), "")
            raise LookupError(f"no DAG {dag_id!r}{where}{error}")
        return dag

    def get_task(self, dag_id: str, task_id: str) -> BaseOperator:
        return self.get_dag(dag_id).get_task(task_id)

    def _changed(self, file: str) -> bool:
        known = self._mtimes.get(file)
        try:
            return known is None or os.stat(file).st_mtime != known
        except OSError:
            return True

    def add_dag(self, dag: DAG) -> None:
        """Register a DAG built in code (tests, benchmarks, the demo) rather than from a file."""
        dag.validate()
        self._extra[dag.dag_id] = dag
        self.dags[dag.dag_id] = dag
