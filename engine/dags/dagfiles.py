"""The files of a DAGs folder, what each imports as, and how a change to one is seen.

Each file is imported under its dotted path relative to the folder (``orders.py`` -> module
``orders``, ``team/etl.py`` -> ``team.etl``), so a trigger class defined next to the DAGs has a
classpath the triggerer can import. A module or package at the top of the folder named like one
of the engine's packages (:data:`RESERVED_NAMES`) or a standard library module is not imported:
the import would find that module instead (or replace it for the whole process).

A file's :data:`FileStat` (one ``stat``) tells whether it may have changed; its digest (a
SHA-256 of its bytes) whether it did.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

__all__ = [
    "RESERVED_NAMES",
    "FileStat",
    "dag_files",
    "file_digest",
    "file_stat",
    "module_name",
    "path_module_name",
    "reserved_entries",
    "reserved_name_error",
    "stat_or_none",
]

#: The engine's own top-level packages. A module or package of one of these names (or of a
#: standard library module's) at the top of a DAGs folder cannot be imported: the engine's
#: package of that name is already loaded (and a classpath under it names the engine's code),
#: so such a file is an import error that says what to rename.
RESERVED_NAMES = frozenset({"engine", "triggers", "operators", "benchmarks"})


def dag_files(folder: Path | None) -> list[Path]:
    """The DAG files of a folder, in order: every ``*.py`` below it, but for names (of files
    and folders) that start with ``_`` or ``.``."""
    if folder is None:
        return []
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        for name in sorted(names):
            if name.endswith(".py") and not name.startswith(("_", ".")):
                found.append(Path(root) / name)
    return found


def reserved_entries(folder: Path | None) -> dict[Path, str]:
    """The modules and packages at the top of the folder named like one of the engine's
    packages or a standard library module, with the error that says what to rename."""
    if folder is None:
        return {}
    found: dict[Path, str] = {}
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return {}
    for entry in entries:
        if entry.name.startswith(("_", ".")):
            continue
        if entry.suffix == ".py" and entry.is_file():
            pass
        elif not (entry.is_dir() and any(entry.rglob("*.py"))):
            continue
        error = reserved_name_error(folder, entry)
        if error is not None:
            found[entry] = error
    return found


def module_name(folder: Path, file: Path) -> str | None:
    """``team/etl.py`` under the folder imports as ``team.etl``; None when a part of the path
    is not an identifier (the file is then imported by path)."""
    parts = list(file.relative_to(folder).with_suffix("").parts)
    if all(p.isidentifier() for p in parts):
        return ".".join(parts)
    return None


def reserved_name_error(folder: Path, entry: Path) -> str | None:
    """Why ``entry`` (a module or package at the top of the DAGs folder) cannot be imported:
    its name is one of the engine's packages or a module of the standard library, which the
    import finds instead (or which it would replace for the whole process); None when it is
    free."""
    name = entry.name.removesuffix(".py") if entry.suffix == ".py" else entry.name
    if name in RESERVED_NAMES:
        owner = "the engine's own package"
    elif name in sys.stdlib_module_names:
        owner = "the standard library's module"
    else:
        return None
    kind = "DAG file" if entry.suffix == ".py" else "package"
    return (
        f"{kind} {entry} has the name of {owner} {name!r}, which is imported instead of it; "
        f"rename it, for instance to my_{entry.name}"
    )


def path_module_name(file: Path) -> str:
    """The module name of a file imported by its path (its path has a part that is not an
    identifier)."""
    return "deferral_dag_" + "".join(c if c.isalnum() else "_" for c in str(file))


#: What a file's ``stat`` says of it: modification time (ns), size, inode. Any change means
#: its content is read and compared.
FileStat = tuple[int, int, int]


def file_stat(path: str | os.PathLike[str]) -> FileStat:
    """The file's :data:`FileStat` (raises OSError when it is gone)."""
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def file_digest(path: Path) -> str:
    """SHA-256 of the file's bytes (raises OSError when it cannot be read)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stat_or_none(path: Path) -> FileStat | None:
    """The file's :data:`FileStat`, None when it is gone."""
    try:
        return file_stat(path)
    except OSError:
        return None
