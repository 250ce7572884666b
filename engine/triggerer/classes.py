"""Trigger classes by classpath, imported again when their file in the DAGs folder changes.

The triggerer imports each classpath once and keeps the class. A module that is a file in the
DAGs folder is watched: before a claimed batch starts, the files of the modules its classpaths
name are looked at (one ``stat`` per distinct module per batch, never per trigger), and a
changed file is imported again as a **new module object**. Triggers started from then on are
built from the new classes; triggers already running keep their class objects and the module
their functions were defined in, so their code and their module's globals stay as they were
until they fire. The new module replaces the old one in ``sys.modules``.

A changed file that no longer imports fails the triggers of it claimed after the change, with
an error naming the file; the ones already running go on. Once the file changes again it is
imported again. Only the module that defines the class is watched: a helper module it imports
is not imported again (restart the triggerer for that).

The new code is read from the source, not from ``__pycache__``: a file rewritten within the
same second with the same size would otherwise get the old compiled code back.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from triggers.base import BaseTrigger, TriggerSerializationError, import_trigger_class

__all__ = ["TriggerClasses"]

log = logging.getLogger("engine.triggerer")

#: What tells that a file changed: modification time, size, inode and change time.
_Stamp = tuple[int, int, int, int]


def _stamp(file: Path) -> _Stamp | None:
    try:
        st = os.stat(file)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns)


@dataclass
class _Watched:
    """A module of the DAGs folder that classes were imported from."""

    file: Path
    stamp: _Stamp | None
    #: Why its file, as it is now, does not import (None: it imports).
    error: str | None = None
    #: Its file changed since the classes were imported: import it again before the next use.
    stale: bool = False


class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Compiles the source itself: neither reads nor writes ``__pycache__``."""

    def path_stats(self, path: str) -> Mapping[str, Any]:
        raise OSError(f"{path}: compiled from the source")


class TriggerClasses:
    """``classpath -> class`` for one triggerer, with the modules of ``dags_folder`` watched.

    Not thread-safe; the claim loop calls it one import at a time (some in a worker thread).
    """

    def __init__(self, dags_folder: str | os.PathLike[str] | None = None) -> None:
        self._root = Path(dags_folder).expanduser().resolve() if dags_folder else None
        self._classes: dict[str, type[BaseTrigger]] = {}
        self._modules: dict[str, _Watched] = {}

    def __contains__(self, classpath: str) -> bool:
        return classpath in self._classes

    def check(self, classpaths: set[str]) -> None:
        """Look at the files of the watched modules ``classpaths`` name (once each): a changed
        one is imported again when next used. Call once per claimed batch."""
        if not self._modules:
            return
        seen: set[str] = set()
        for classpath in classpaths:
            name = classpath.rpartition(".")[0]
            if name in seen:
                continue
            seen.add(name)
            watched = self._modules.get(name)
            if watched is None:
                continue
            stamp = _stamp(watched.file)
            if stamp != watched.stamp:
                watched.stamp = stamp
                watched.stale = True
                watched.error = None
                self._forget_classes(name)

    def get(self, classpath: str) -> type[BaseTrigger] | None:
        """The class, if imported and current."""
        return self._classes.get(classpath)

    def load(self, classpath: str) -> type[BaseTrigger]:
        """Import the class (again, if its module's file changed). Raises
        ``TriggerSerializationError``."""
        cls = self._classes.get(classpath)
        if cls is not None:
            return cls
        name = classpath.rpartition(".")[0]
        watched = self._modules.get(name)
        if watched is not None:
            if watched.error is not None:
                raise TriggerSerializationError(watched.error)
            if watched.stale:
                self._reimport(name, watched)
        cls = import_trigger_class(classpath)
        if watched is None:
            self._watch(name)
        self._classes[classpath] = cls
        return cls

    def _watch(self, name: str) -> None:
        if self._root is None:
            return
        module = sys.modules.get(name)
        where = getattr(module, "__file__", None)
        if not where:
            return
        file = Path(where).resolve()
        if file.is_relative_to(self._root):
            self._modules[name] = _Watched(file=file, stamp=_stamp(file))

    def _forget_classes(self, name: str) -> None:
        prefix = name + "."
        for classpath in [c for c in self._classes if c.startswith(prefix)]:
            if classpath.rpartition(".")[0] == name:
                del self._classes[classpath]

    def _reimport(self, name: str, watched: _Watched) -> None:
        """Import ``name`` from its changed file as a new module object (the old one stays
        with the triggers that run its code)."""
        watched.stale = False
        file = watched.file
        old = sys.modules.get(name)
        try:
            module = _fresh_module(name, file, old)
        except BaseException as exc:  # user code: even SystemExit is this file's import error
            if old is not None:
                sys.modules[name] = old  # the running triggers' module, as it was
            watched.error = (
                f"trigger module {name!r} ({file}) changed and no longer imports: "
                f"{type(exc).__name__}: {exc}; triggers of it claimed since fail until the file "
                "is fixed, the running ones go on with the code they started with"
            )
            log.error("%s", watched.error)
            raise TriggerSerializationError(watched.error) from exc
        log.info(
            "trigger module %s changed (%s): imported again; triggers claimed from now on "
            "use the new code, running ones keep theirs until they end",
            name,
            file,
        )
        del module


def _fresh_module(name: str, file: Path, old: ModuleType | None) -> ModuleType:
    """Run ``file`` as a new module named ``name`` and put it in ``sys.modules``."""
    loader = _SourceOnlyLoader(name, str(file))
    package_path = getattr(old, "__path__", None)
    spec = importlib.util.spec_from_file_location(
        name,
        file,
        loader=loader,
        submodule_search_locations=list(package_path) if package_path is not None else None,
    )
    if spec is None:
        raise ImportError(f"cannot import {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return module
