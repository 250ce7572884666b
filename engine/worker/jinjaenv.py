"""The Jinja environments of task templates: one per DAG folder and search path (and one per
DAG with Jinja settings of its own), sandboxed as Airflow's, with the date filters, the
``do`` extension, an ``Undefined`` that names the closest names on a typo, and a native
variant for ``render_template_as_native_obj``. Compiled templates are kept, so a task's
templates are compiled once per process. engine/worker/templating.py renders with them.
"""

from __future__ import annotations

import ast
import difflib
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jinja2
import jinja2.meta
import jinja2.nativetypes
import jinja2.sandbox

from engine.worker.macros import FILTERS

if TYPE_CHECKING:
    from operators.base import BaseOperator

__all__ = ["CompiledTemplate", "Env", "TemplateRenderError", "close_names", "env_for"]

#: The start of a template: a string holding none of these renders to itself (and is not
#: compiled), unless it ends with a newline or holds a carriage return (Jinja rewrites those).
_MARKERS = ("{{", "{%", "{#")
#: Compiled string templates kept per environment; past this many, the cache starts over.
_MAX_CACHED = 2048


class TemplateRenderError(Exception):
    """A templated field could not be rendered (undefined variable, syntax error, missing
    template file, a refused attribute): fails the try like any other error of the task."""


class _Sandboxed(jinja2.sandbox.SandboxedEnvironment):
    """Airflow's sandbox: attributes starting with ``_`` are readable, ``__`` ones are not."""

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        return not jinja2.sandbox.is_internal_attribute(obj, attr)


def _native_concat(values: Iterable[Any]) -> Any:
    """A native render's value: one node's value as it is; text that reads as a Python
    literal as that literal; any other text as text. (Jinja's own gives up on a literal
    that parses but cannot be built, such as a run's conf value ``{{ 1 }}``: a set of a set.)"""
    parts = list(values)
    if not parts:
        return None
    if len(parts) == 1 and not isinstance(parts[0], str):
        return parts[0]
    raw = "".join(str(p) for p in parts)
    try:
        # (parsed here, not by literal_eval, so that leading blanks are kept as Jinja does)
        return ast.literal_eval(ast.parse(raw, mode="eval"))
    except Exception:
        return raw


class _SandboxedNative(_Sandboxed):
    """The sandbox, rendering a field that is one expression to its Python value
    (``render_template_as_native_obj``). Airflow's native environment is not sandboxed; this
    one is."""

    code_generator_class = jinja2.nativetypes.NativeCodeGenerator
    concat = staticmethod(_native_concat)


class _NativeTemplate(jinja2.nativetypes.NativeTemplate):
    # (NativeTemplate.render concatenates with its environment_class's concat)
    environment_class = _SandboxedNative  # type: ignore[assignment]


_SandboxedNative.template_class = _NativeTemplate


def close_names(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, sorted(set(known)), n=3, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {' or '.join(f'`{c}`' for c in close)}?)"


class _HintingUndefined(jinja2.StrictUndefined):
    """StrictUndefined whose error about a missing attribute or key names the closest ones."""

    __slots__ = ()

    def _fail_with_undefined_error(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._fail_with_undefined_error(*args, **kwargs)
        except jinja2.UndefinedError as exc:
            owner = self._undefined_obj
            if owner is jinja2.utils.missing or not isinstance(self._undefined_name, str):
                raise
            if isinstance(owner, Mapping):
                known: Iterable[str] = (k for k in owner if isinstance(k, str))
            else:
                known = (a for a in dir(owner) if not a.startswith("_"))
            hint = close_names(self._undefined_name, known)
            if not hint:
                raise
            raise jinja2.UndefinedError(f"{exc.message}{hint}") from None


# (StrictUndefined binds its operators to the base class's method: bind them to the override.)
for _name in dir(jinja2.StrictUndefined):
    if getattr(jinja2.StrictUndefined, _name, None) is jinja2.Undefined._fail_with_undefined_error:
        setattr(_HintingUndefined, _name, _HintingUndefined._fail_with_undefined_error)


class Env:
    """One Jinja environment (a DAG folder and search path, and a DAG's settings) and its
    compiled templates."""

    def __init__(self, paths: list[str], dag: Any = None) -> None:
        self.paths = paths
        options: dict[str, Any] = {
            "loader": jinja2.FileSystemLoader(paths),
            "undefined": getattr(dag, "template_undefined", None) or _HintingUndefined,
            "extensions": ["jinja2.ext.do"],
            "autoescape": False,
            "cache_size": _MAX_CACHED,
        }
        custom = dict(getattr(dag, "jinja_environment_kwargs", None) or {})
        options.update(custom)
        self.native = bool(getattr(dag, "render_template_as_native_obj", False))
        env_class = _SandboxedNative if self.native else _Sandboxed
        try:
            self.jinja = env_class(**options)
        except Exception as exc:
            raise TemplateRenderError(
                f"DAG {getattr(dag, 'dag_id', '?')}: jinja_environment_kwargs: {exc}"
            ) from None
        self.jinja.filters.update(FILTERS)
        self.jinja.globals.update(getattr(dag, "user_defined_macros", None) or {})
        self.jinja.filters.update(getattr(dag, "user_defined_filters", None) or {})
        #: Whether a string without the template markers renders to itself (not when the
        #: DAG changes Jinja's syntax or renders native values).
        self.literal_plain = not custom and not self.native
        self._compiled: dict[str, CompiledTemplate] = {}
        self._files: dict[str, CompiledTemplate] = {}
        self._lock = threading.Lock()

    def from_string(self, source: str) -> CompiledTemplate:
        found = self._compiled.get(source)
        if found is None:
            found = _compile(self.jinja, source, self.jinja.from_string)
            with self._lock:
                if len(self._compiled) >= _MAX_CACHED:
                    self._compiled.clear()
                self._compiled[source] = found
        return found

    def from_file(self, name: str) -> CompiledTemplate:
        """The template file ``name``: an absolute path, or relative to the DAG folder or a
        search path entry (the first that has it)."""
        if os.path.isabs(name):
            try:
                source = Path(name).read_text()
            except OSError as exc:
                raise jinja2.TemplateNotFound(name) from exc
            return self.from_string(source)
        found = self._files.get(name)
        if found is None or not found.template.is_up_to_date:
            template = self.jinja.get_template(name)  # (jinja keeps it while the file is)
            source, _, _ = self.jinja.loader.get_source(self.jinja, name)  # type: ignore[union-attr]
            found = _compile(self.jinja, source, lambda _s: template)
            with self._lock:
                self._files[name] = found
        return found

    def is_template(self, value: str) -> bool:
        """Whether a string must go through Jinja (else it renders to itself)."""
        if not self.literal_plain:
            return True
        return any(m in value for m in _MARKERS) or value.endswith("\n") or "\r" in value


class CompiledTemplate(NamedTuple):
    template: jinja2.Template
    #: The variables it reads (of the template itself; not of templates it includes).
    names: frozenset[str]


def _compile(
    env: jinja2.Environment, source: str, make: Callable[[str], jinja2.Template]
) -> CompiledTemplate:
    names = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    return CompiledTemplate(make(source), names)


_envs: dict[tuple[str, ...], Env] = {}
_dag_envs: weakref.WeakKeyDictionary[Any, Env] = weakref.WeakKeyDictionary()
_envs_lock = threading.Lock()

_DAG_SETTINGS = (
    "user_defined_macros",
    "user_defined_filters",
    "render_template_as_native_obj",
    "template_undefined",
    "jinja_environment_kwargs",
)


def env_for(op: BaseOperator) -> Env:
    """The environment of the operator's DAG: its file's folder, then its search path; a DAG
    with template settings of its own has an environment of its own."""
    dag = getattr(op, "dag", None)
    own = dag is not None and any(getattr(dag, name, None) for name in _DAG_SETTINGS)
    if own:
        env = _dag_envs.get(dag)
        if env is not None:
            return env
    fileloc = getattr(dag, "fileloc", None) or ""
    key = (fileloc, *(str(p) for p in getattr(dag, "template_searchpath", None) or ()))
    if not own:
        env = _envs.get(key)
        if env is not None:
            return env
    paths = [str(Path(fileloc).resolve().parent)] if fileloc else []
    paths.extend(key[1:])
    with _envs_lock:
        if own:
            return _dag_envs.setdefault(dag, Env(paths, dag))
        return _envs.setdefault(key, Env(paths))
