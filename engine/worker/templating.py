"""Templates: a task's ``template_fields`` rendered with Jinja2 on the worker, just before it runs.

Every name of :data:`TEMPLATE_VARIABLES` is a template variable (``{{ ds }}``) and a key of the
``context`` that ``execute`` receives. Rendering follows Airflow:

* each attribute named in the operator's ``template_fields`` is rendered: a ``str`` as a
  template, the values of a ``list``, ``tuple``, ``set`` or ``dict`` one by one (nested too);
  any other value is left as it is;
* a string ending in one of the operator's ``template_ext`` (``.sh``, ``.sql``, ...) names a
  template file, looked up in the DAG's folder, then in the DAG's ``template_searchpath``;
* undefined variables are errors (``StrictUndefined``), which fail the try like any other
  error of the task (retries apply), with a message naming the task, the field and the name.

The operators never import this module (they import contracts only): the worker calls
:func:`render_task` with the operator, which only provides ``template_fields`` and
``template_ext``. One Jinja environment serves each DAG folder and search path; compiled
templates are kept, so a task's templates are compiled once per process, not once per try.
"""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import os
import threading
import types
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jinja2
import jinja2.meta
import msgspec

if TYPE_CHECKING:
    from engine.store import ClaimedTask
    from operators.base import BaseOperator

__all__ = [
    "MACROS",
    "PREV_SUCCESS",
    "TEMPLATE_VARIABLES",
    "DagRunInfo",
    "Prepared",
    "RunValues",
    "TaskInstanceInfo",
    "TemplateRenderError",
    "build_context",
    "child_context",
    "ds_add",
    "ds_format",
    "jsonable",
    "prepare",
    "reads_files",
    "restore_context",
    "run_values",
    "wants",
]

#: The variable that costs a store query: looked up only when a template or callable asks.
PREV_SUCCESS = "prev_data_interval_start_success"

#: Every template variable (and context key) the engine provides; docs/reference/templates.md
#: describes each one (a test keeps the two equal).
TEMPLATE_VARIABLES = (
    "ds",
    "ds_nodash",
    "ts",
    "ts_nodash",
    "logical_date",
    "data_interval_start",
    "data_interval_end",
    PREV_SUCCESS,
    "run_id",
    "run_type",
    "dag_run",
    "params",
    "task",
    "ti",
    "macros",
)

#: The start of a template: a string holding none of these renders to itself (and is not
#: compiled).
_MARKERS = ("{{", "{%", "{#")
#: Compiled string templates kept per environment; past this many, the cache starts over.
_MAX_CACHED = 2048


class TemplateRenderError(Exception):
    """A templated field could not be rendered (undefined variable, syntax error, missing
    template file): fails the try like any other error of the task."""


# -- the values of a run ------------------------------------------------------------------


class RunValues(NamedTuple):
    """What templates need of the run beyond its logical date."""

    data_interval_start: dt.datetime
    data_interval_end: dt.datetime
    params: dict[str, Any]


def run_values(ti: ClaimedTask, dag: Any) -> RunValues:
    """The data interval and params of the run ``ti`` belongs to.

    The interval is the run's (``claim_tasks`` returns it; a run without one, from before
    schedules, falls back to ``[logical_date, logical_date]``); ``params`` are the DAG's
    ``params``, overridden by the run's ``conf`` keys of the same name (Airflow's default)."""
    logical_date = ti.logical_date
    start = ti.data_interval_start or logical_date
    end = ti.data_interval_end or logical_date
    params = dict(getattr(dag, "params", None) or {})
    conf = ti.conf or {}
    for key in params.keys() & conf.keys():
        params[key] = conf[key]
    return RunValues(start, end, params)


# -- the context ----------------------------------------------------------------------------


class DagRunInfo(msgspec.Struct, frozen=True, kw_only=True):
    """``dag_run`` in templates and the context."""

    dag_id: str
    run_id: str
    logical_date: dt.datetime
    data_interval_start: dt.datetime
    data_interval_end: dt.datetime
    conf: dict[str, Any]
    #: ``scheduled``, ``manual`` or ``backfill``.
    run_type: str = "manual"


class TaskInstanceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """``ti`` in templates and the context."""

    id: int
    dag_id: str
    run_id: str
    task_id: str
    try_number: int


def ds_add(ds: str, days: int) -> str:
    """``ds`` (``YYYY-MM-DD``) plus ``days`` (negative: minus): ``ds_add('2026-01-31', 1)`` is
    ``'2026-02-01'``."""
    return (dt.date.fromisoformat(ds) + dt.timedelta(days=days)).isoformat()


def ds_format(ds: str, input_format: str, output_format: str) -> str:
    """``ds`` read with ``input_format`` and written with ``output_format`` (strftime codes):
    ``ds_format('2026-01-31', '%Y-%m-%d', '%d/%m/%Y')`` is ``'31/01/2026'``."""
    return dt.datetime.strptime(ds, input_format).strftime(output_format)


#: ``macros`` in templates and the context.
MACROS = types.SimpleNamespace(
    ds_add=ds_add, ds_format=ds_format, datetime=dt.datetime, timedelta=dt.timedelta
)


def build_context(
    ti: ClaimedTask, op: BaseOperator, dag: Any, *, default_deferrable: bool
) -> dict[str, Any]:
    """The context of one call of a task: the engine's own keys and every template variable
    but :data:`PREV_SUCCESS`, which the caller adds when :func:`wants` says it is asked for."""
    logical_date = ti.logical_date
    utc = logical_date.astimezone(dt.UTC)
    ds = utc.date().isoformat()  # (strftime costs several times as much, on every call)
    ds_nodash = ds.replace("-", "")
    values = run_values(ti, dag)
    return {
        "dag_id": ti.dag_id,
        "run_id": ti.run_id,
        "task_id": ti.task_id,
        "try_number": ti.try_number,
        "logical_date": logical_date,
        "conf": ti.conf,
        "ti_id": ti.id,
        "first_try_at": ti.first_try_at,
        "claimed_at": ti.db_now,
        "default_deferrable": default_deferrable,
        "ds": ds,
        "ds_nodash": ds_nodash,
        "ts": utc.isoformat(),
        "ts_nodash": f"{ds_nodash}T{utc.hour:02d}{utc.minute:02d}{utc.second:02d}",
        "data_interval_start": values.data_interval_start,
        "data_interval_end": values.data_interval_end,
        "run_type": ti.run_type,
        "dag_run": DagRunInfo(
            dag_id=ti.dag_id,
            run_id=ti.run_id,
            logical_date=logical_date,
            data_interval_start=values.data_interval_start,
            data_interval_end=values.data_interval_end,
            conf=ti.conf,
            run_type=ti.run_type,
        ),
        "params": values.params,
        "task": op,
        "ti": TaskInstanceInfo(
            id=ti.id,
            dag_id=ti.dag_id,
            run_id=ti.run_id,
            task_id=ti.task_id,
            try_number=ti.try_number,
        ),
        "macros": MACROS,
    }


def child_context(context: Mapping[str, Any]) -> dict[str, Any]:
    """The context as plain data, for a child process (isolation="process"): without the
    operator and the macros, which the child puts back (:func:`restore_context`)."""
    return {k: v for k, v in context.items() if k not in ("task", "macros")}


def restore_context(plain: Mapping[str, Any], op: BaseOperator) -> dict[str, Any]:
    """The context a child process gives its task, from :func:`child_context`'s data."""
    context = dict(plain)
    if isinstance(context.get("dag_run"), Mapping):
        context["dag_run"] = msgspec.convert(context["dag_run"], DagRunInfo)
    if isinstance(context.get("ti"), Mapping):
        context["ti"] = msgspec.convert(context["ti"], TaskInstanceInfo)
    context["task"] = op
    context["macros"] = MACROS
    return context


# -- rendering --------------------------------------------------------------------------


class _Env:
    """One Jinja environment (a DAG folder and search path) and its compiled templates."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.jinja = jinja2.Environment(
            loader=jinja2.FileSystemLoader(paths),
            undefined=jinja2.StrictUndefined,
            autoescape=False,
            keep_trailing_newline=True,
            cache_size=_MAX_CACHED,
        )
        self._compiled: dict[str, _Template] = {}
        self._files: dict[str, _Template] = {}
        self._lock = threading.Lock()

    def from_string(self, source: str) -> _Template:
        found = self._compiled.get(source)
        if found is None:
            found = _compile(self.jinja, source, self.jinja.from_string)
            with self._lock:
                if len(self._compiled) >= _MAX_CACHED:
                    self._compiled.clear()
                self._compiled[source] = found
        return found

    def from_file(self, name: str) -> _Template:
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


class _Template(NamedTuple):
    template: jinja2.Template
    #: The variables it reads (of the template itself; not of templates it includes).
    names: frozenset[str]


def _compile(
    env: jinja2.Environment, source: str, make: Callable[[str], jinja2.Template]
) -> _Template:
    names = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    return _Template(make(source), names)


_envs: dict[tuple[str, ...], _Env] = {}
_envs_lock = threading.Lock()


def _env_for(op: BaseOperator) -> _Env:
    """The environment of the operator's DAG: its file's folder, then its search path."""
    dag = getattr(op, "dag", None)
    fileloc = getattr(dag, "fileloc", None) or ""
    key = (fileloc, *(str(p) for p in getattr(dag, "template_searchpath", None) or ()))
    env = _envs.get(key)
    if env is None:
        paths = [str(Path(fileloc).resolve().parent)] if fileloc else []
        paths.extend(key[1:])
        with _envs_lock:
            env = _envs.setdefault(key, _Env(paths))
    return env


class _Field(NamedTuple):
    """A template inside a field's value, where it sits."""

    template: _Template


class _Container(NamedTuple):
    """A list, tuple, set or dict (``items``: a dict for a dict) holding templates."""

    kind: type
    items: Any


class Prepared:
    """A task's templated fields, compiled: which variables they read, and how to render
    them onto the operator."""

    __slots__ = ("_fields", "names", "op")

    def __init__(self, op: BaseOperator, fields: dict[str, Any], names: frozenset[str]) -> None:
        self.op = op
        self._fields = fields
        #: Every variable the templates read.
        self.names = names

    def render(self, context: Mapping[str, Any]) -> dict[str, Any] | None:
        """Set each templated field to its rendered value; what they rendered to (every
        templated field of the task), or None when none held a template."""
        if not self._fields:
            return None
        rendered: dict[str, Any] = {}
        for name in self.op.template_fields:
            if name in self._fields:
                try:
                    value = _render(self._fields[name], context)
                except jinja2.TemplateError as exc:
                    raise _error(self.op, name, exc) from None
                setattr(self.op, name, value)
            rendered[name] = getattr(self.op, name, None)
        return rendered


def _error(op: BaseOperator, field: str, exc: Exception) -> TemplateRenderError:
    dag = getattr(op, "dag", None)
    task = f"{dag.dag_id}.{op.task_id}" if dag is not None else op.task_id
    if isinstance(exc, jinja2.TemplateNotFound):
        searched = ", ".join(_env_for(op).paths) or "(no DAG folder, no template_searchpath)"
        detail = f"template file {exc.name!r} not found in {searched}"
    elif isinstance(exc, jinja2.TemplateSyntaxError):
        detail = f"template syntax error: {exc.message} (line {exc.lineno})"
    else:
        detail = str(exc)
    return TemplateRenderError(f"task {task}: template field {field!r}: {detail}")


def prepare(op: BaseOperator) -> Prepared:
    """Compile the templates in ``op``'s ``template_fields`` (reading template files), without
    rendering them. :class:`TemplateRenderError` for a syntax error or a missing file."""
    fields: dict[str, Any] = {}
    names: set[str] = set()
    ext = tuple(getattr(op, "template_ext", ()) or ())
    templated = [
        (name, value)
        for name in getattr(op, "template_fields", ())
        if _holds_template(value := getattr(op, name, None), ext)
    ]
    if not templated:  # the common case: no Jinja environment, nothing compiled
        return Prepared(op, fields, frozenset())
    env = _env_for(op)
    for name, value in templated:
        try:
            compiled, found = _compile_value(env, value, ext)
        except jinja2.TemplateError as exc:
            raise _error(op, name, exc) from None
        if found:
            fields[name] = compiled
            names.update(found)
    return Prepared(op, fields, frozenset(names))


def _compile_value(env: _Env, value: Any, ext: tuple[str, ...]) -> tuple[Any, set[str] | None]:
    """``value`` with its templates compiled (as :class:`_Field`) and the names they read;
    None instead of the names when it holds no template."""
    if isinstance(value, str):
        if ext and value.endswith(ext):
            tpl = env.from_file(value)
        elif any(m in value for m in _MARKERS):
            tpl = env.from_string(value)
        else:
            return value, None
        return _Field(tpl), set(tpl.names)
    if isinstance(value, list | tuple | set | frozenset):
        items, names = _compile_items(env, value, ext)
        if names is None:
            return value, None
        return _Container(type(value), items), names
    if isinstance(value, dict):
        keys = list(value)
        items, names = _compile_items(env, value.values(), ext)
        if names is None:
            return value, None
        return _Container(dict, dict(zip(keys, items, strict=True))), names
    return value, None


def _compile_items(
    env: _Env, values: Iterable[Any], ext: tuple[str, ...]
) -> tuple[list[Any], set[str] | None]:
    items: list[Any] = []
    names: set[str] | None = None
    for item in values:
        compiled, found = _compile_value(env, item, ext)
        items.append(compiled)
        if found is not None:
            names = (names or set()) | found
    return items, names


def _render(compiled: Any, context: Mapping[str, Any]) -> Any:
    if isinstance(compiled, _Field):
        return compiled.template.template.render(context)
    if isinstance(compiled, _Container):
        kind, items = compiled
        if kind is dict:
            return {k: _render(v, context) for k, v in items.items()}
        rendered = [_render(v, context) for v in items]
        if kind is list:
            return rendered
        if hasattr(kind, "_make"):  # a named tuple
            return kind._make(rendered)
        try:
            return kind(rendered)
        except TypeError:
            return tuple(rendered)
    return compiled


def reads_files(op: BaseOperator) -> bool:
    """Whether preparing ``op`` may read template files (then better done off the loop)."""
    ext = tuple(getattr(op, "template_ext", ()) or ())
    if not ext:
        return False
    return any(_holds_template(getattr(op, f, None), ext, ()) for f in op.template_fields)


def _holds_template(value: Any, ext: tuple[str, ...], markers: tuple[str, ...] = _MARKERS) -> bool:
    """Whether ``value`` holds a string that is a template (``markers``) or names a template
    file (``ext``), nested in containers too."""
    if isinstance(value, str):
        return bool(ext and value.endswith(ext)) or any(m in value for m in markers)
    if isinstance(value, list | tuple | set | frozenset):
        return any(_holds_template(v, ext, markers) for v in value)
    if isinstance(value, dict):
        return any(_holds_template(v, ext, markers) for v in value.values())
    return False


def wants(op: BaseOperator, prepared: Prepared, name: str) -> bool:
    """Whether the task asks for context entry ``name``: a template reads it, or the
    operator's ``python_callable`` takes it (by that parameter name, or ``**kwargs``)."""
    if name in prepared.names:
        return True
    fn = getattr(op, "python_callable", None)
    if fn is None:
        return False
    try:
        return _asks_for(fn, name)
    except TypeError:  # an unhashable callable: not cached
        return _asks_for.__wrapped__(fn, name)


@functools.lru_cache(maxsize=1024)
def _asks_for(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def jsonable(value: Any) -> Any:
    """A rendered value as JSON data for the store: containers as lists and objects, dates
    as ISO strings, anything else JSON cannot hold as its ``repr``."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    return repr(value)
