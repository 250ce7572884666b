"""The trigger allow-list: which classpaths and callables a stored trigger row may name.

A trigger row is ``(classpath, kwargs)``; building it imports the classpath, and some
triggers import more (``PythonTrigger``'s ``check``). Whoever can write a row could otherwise
make the triggerer import any module and call any function. The setting ``trigger_allow``
lists patterns; a name is allowed when one pattern matches it **in full**
(:func:`fnmatch.fnmatchcase`: ``*`` matches any characters, dots included, ``?`` one
character, ``[...]`` a set). ``triggers.*`` allows every built-in trigger;
``triggers.python`` alone matches nothing but that exact name, never a longer one.

Unset, the list is the built-in ``triggers.*`` plus ``<module>.*`` for every module and
package at the top of the DAGs folder (looked at again when a name does not match, so a DAG
file added later counts). Names are checked before anything is imported: the classpath at
defer time in the worker and at start in the triggerer, then the kwargs the trigger class
declares in ``import_path_kwargs``, before its ``__init__`` runs.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triggers.base import BaseTrigger, import_path_kwargs, import_trigger_class

if TYPE_CHECKING:
    from engine.config import Settings

__all__ = [
    "BUILTIN_PATTERNS",
    "SETTING",
    "TriggerAllowList",
    "TriggerNotAllowed",
    "check_classpath",
    "check_import_paths",
    "check_trigger",
    "dags_folder_modules",
]

#: The setting (and, upper-cased with ``DEFERRAL_``, the environment variable) every refusal names.
SETTING = "trigger_allow"
#: What the default allows besides the DAGs folder: the built-in triggers.
BUILTIN_PATTERNS = ("triggers.*",)
#: How many names' pattern judgements a list keeps (names come from trigger rows, which
#: anyone writing the table can vary: the memo is emptied when full rather than grown).
_MEMO_SIZE = 4096


class TriggerNotAllowed(PermissionError):
    """A trigger row names a classpath or an import path that ``trigger_allow`` does not allow."""


def dags_folder_modules(folder: str | os.PathLike[str] | None) -> frozenset[str]:
    """The top-level module names a DAGs folder provides: ``orders`` for ``orders.py`` and
    for a folder ``orders/`` holding Python files (a package or a namespace package).

    A name the standard library or an already imported module outside the folder owns
    (``os.py``, ``asyncio/``) is left out: the import would find that module, not the file,
    and allowing ``os.*`` would allow ``os.system``."""
    if folder is None:
        return frozenset()
    root = Path(folder).expanduser().resolve()
    names: set[str] = set()
    try:
        with os.scandir(root) as it:
            entries = list(it)
    except OSError:
        return frozenset()
    for entry in entries:
        name = entry.name
        try:
            if name.endswith(".py") and entry.is_file():
                stem = name[:-3]
                if stem.isidentifier():
                    names.add(stem)
            elif name.isidentifier() and entry.is_dir() and _holds_python(entry.path):
                names.add(name)
        except OSError:
            continue
    return frozenset(n for n in names if not _owned_elsewhere(n, root))


def _owned_elsewhere(name: str, root: Path) -> bool:
    if name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return True
    module = sys.modules.get(name)
    if module is None:
        return False
    where = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), None)
    return where is None or not Path(where).resolve().is_relative_to(root)


def _holds_python(path: str) -> bool:
    try:
        with os.scandir(path) as entries:
            return any(e.name.endswith(".py") for e in entries)
    except OSError:
        return False


class TriggerAllowList:
    """Full-match patterns, plus (for the default) the modules of a DAGs folder.

    Call it with a dotted name: ``allow("triggers.python.PythonTrigger") -> bool``.
    """

    def __init__(
        self,
        patterns: Iterable[str],
        *,
        dags_folder: str | os.PathLike[str] | None = None,
    ) -> None:
        self.patterns = tuple(patterns)
        for pattern in self.patterns:
            if not isinstance(pattern, str) or not pattern.strip() or pattern != pattern.strip():
                raise ValueError(
                    f"setting {SETTING}: every pattern must be a non-empty string without "
                    f"surrounding spaces, got {pattern!r}"
                )
        self.dags_folder = dags_folder
        # Whether the patterns match a name: they never change, and a worker checks the same
        # few classpaths at every deferral, the triggerer at every trigger it starts.
        self._by_pattern: dict[str, bool] = {}
        self._scanned_at = self._folder_mtime()
        self._dag_modules = dags_folder_modules(dags_folder)

    @classmethod
    def from_setting(
        cls, patterns: Iterable[str] | None, dags_folder: str | os.PathLike[str] | None
    ) -> TriggerAllowList:
        """The list ``trigger_allow`` gives: the patterns as set, or the default when unset."""
        if patterns is None:
            return cls(BUILTIN_PATTERNS, dags_folder=dags_folder)
        return cls(patterns)

    @classmethod
    def from_settings(cls, settings: Settings) -> TriggerAllowList:
        """The list the settings ``trigger_allow`` and ``dags_folder`` give."""
        return cls.from_setting(settings.trigger_allow, settings.dags_folder)

    def __call__(self, name: str) -> bool:
        if not isinstance(name, str):
            return False
        matched = self._by_pattern.get(name)
        if matched is None:
            matched = any(fnmatch.fnmatchcase(name, p) for p in self.patterns)
            if len(self._by_pattern) >= _MEMO_SIZE:
                self._by_pattern.clear()
            self._by_pattern[name] = matched
        if matched:
            return True
        if self.dags_folder is None or "." not in name:
            return False
        top = name.split(".", 1)[0]
        if top not in self._dag_modules:
            # A DAG file added since the last look counts too. (One stat() tells whether the
            # folder's entries changed: a stream of refused names does not rescan it each time.)
            mtime = self._folder_mtime()
            if mtime != self._scanned_at:
                self._scanned_at = mtime
                self._dag_modules = dags_folder_modules(self.dags_folder)
        return top in self._dag_modules

    def _folder_mtime(self) -> int | None:
        if self.dags_folder is None:
            return None
        try:
            return os.stat(self.dags_folder).st_mtime_ns
        except OSError:
            return None

    def describe(self) -> str:
        """The allowed names, for messages (patterns are configuration, not secrets)."""
        parts = list(self.patterns)
        parts += [f"{m}.*" for m in sorted(self._dag_modules)]
        return ", ".join(parts) if parts else "nothing"


def _describe(allow: Callable[[str], bool]) -> str:
    if isinstance(allow, TriggerAllowList):
        return f" (allowed: {allow.describe()})"
    return ""


def check_classpath(allow: Callable[[str], bool], classpath: str) -> None:
    """Refuse a classpath the allow-list does not match; imports nothing."""
    if not allow(classpath):
        shown = classpath if isinstance(classpath, str) else type(classpath).__name__
        raise TriggerNotAllowed(
            f"trigger classpath {shown!r} is not allowed by the setting {SETTING} "
            f"(DEFERRAL_{SETTING.upper()}){_describe(allow)}; add a pattern that matches it "
            "in full to run it"
        )


def check_import_paths(
    allow: Callable[[str], bool], classpath: str, cls: type[BaseTrigger], kwargs: dict[str, Any]
) -> None:
    """Refuse the kwargs ``cls`` declares as import paths that the allow-list does not match,
    before ``cls(**kwargs)`` imports them. The refused value is not shown: it is a kwarg."""
    for name, value in import_path_kwargs(cls, kwargs).items():
        if not isinstance(value, str) or not allow(value):
            raise TriggerNotAllowed(
                f"trigger {classpath}: the import path given as kwarg {name!r} is not allowed "
                f"by the setting {SETTING} (DEFERRAL_{SETTING.upper()}){_describe(allow)}; "
                "add a pattern that matches it in full to call it"
            )


def check_trigger(
    allow: Callable[[str], bool],
    classpath: str,
    kwargs: dict[str, Any],
    load: Callable[[str], type[BaseTrigger]] = import_trigger_class,
) -> type[BaseTrigger]:
    """Both checks in order: the classpath before it is imported (by ``load``), then the
    import paths among the kwargs. Returns the class."""
    check_classpath(allow, classpath)
    cls = load(classpath)
    check_import_paths(allow, classpath, cls, kwargs)
    return cls
