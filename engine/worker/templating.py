"""Templates: a task's ``template_fields`` rendered with Jinja2 on the worker, just before it runs.

The worker calls :func:`render_task` once per call of a task: it builds the context
(engine/worker/context.py), compiles the operator's templated fields, looks up what they ask
of the store, renders them onto the operator and returns the context and what the fields
rendered to. Rendering follows Airflow:

* each attribute named in the operator's ``template_fields`` is rendered: a ``str`` as a
  template, the values of a ``list``, ``tuple``, ``set`` or ``dict`` one by one (nested too),
  an object with ``template_fields`` of its own field by field; any other value is left as it
  is;
* a string ending in one of the operator's ``template_ext`` (``.sh``, ``.sql``, ...) names a
  template file, looked up in the DAG's folder, then in the DAG's ``template_searchpath``;
* the environment is sandboxed (``{{ ds.__class__ }}`` is refused), has ``jinja2.ext.do``,
  the filters ``ds``, ``ds_nodash``, ``ts``, ``ts_nodash``, ``ts_nodash_with_tz``, drops one
  trailing newline of a rendered string (Jinja's default, as Airflow's), and takes the DAG's
  ``user_defined_macros``, ``user_defined_filters``, ``render_template_as_native_obj``,
  ``template_undefined`` and ``jinja_environment_kwargs``;
* undefined variables are errors (``StrictUndefined``, unless the DAG says otherwise), which
  fail the try like any other error of the task (retries apply), with a message naming the
  task, the field and the name, and the closest names that exist;
* what a template inserts is never rendered again: a value from a run's ``conf`` (or a
  Variable) that holds ``{{ ... }}`` reaches the task as that text.

The operators never import this module (they import contracts only): the worker calls
:func:`render_task` with the operator, which only provides ``template_fields`` and
``template_ext``. One Jinja environment (engine/worker/jinjaenv.py) serves each DAG folder
and search path (each DAG with settings of its own has its own); compiled templates are
kept, so a task's templates are compiled once per process, not once per try.
"""

from __future__ import annotations

import datetime as dt
import functools
import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import jinja2
import jinja2.meta
import jinja2.nativetypes
import jinja2.sandbox

from engine.masking import redact
from engine.runtime.retry import with_db_retry
from engine.usercode.variables import bind_store_here
from engine.worker.context import (
    PREV_SUCCESS,
    PREV_SUCCESS_KEYS,
    TEMPLATE_VARIABLES,
    DagRunInfo,
    RunValues,
    TaskInstanceInfo,
    build_context,
    child_context,
    prev_success_values,
    restore_context,
    run_values,
    triggering_events,
)
from engine.worker.jinjaenv import CompiledTemplate, Env, TemplateRenderError, close_names, env_for
from engine.worker.macros import MACROS, ds_add, ds_format

if TYPE_CHECKING:
    from engine.store import ClaimedTask, Store
    from operators.base import BaseOperator

__all__ = [
    "MACROS",
    "PREV_SUCCESS",
    "TEMPLATE_VARIABLES",
    "DagRunInfo",
    "Prepared",
    "RenderedTask",
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
    "render_task",
    "restore_context",
    "run_values",
    "wants",
]

#: Template variables that read the store when a template uses them (rendered off the loop).
_READS_STORE = frozenset({"var", "conn", "ti", "task_instance"})


class RenderedTask(NamedTuple):
    """What :func:`render_task` gives the worker."""

    #: The call's context (``execute(context)``), its templated fields rendered onto the
    #: operator.
    context: dict[str, Any]
    #: What the templated fields rendered to, as JSON data with secrets masked (stored with
    #: the try); None when no field held a template.
    fields: dict[str, Any] | None


async def render_task(
    ti: ClaimedTask,
    op: BaseOperator,
    *,
    store: Store,
    default_deferrable: bool,
    task_instance: Any = None,
) -> RenderedTask:
    """Build the context of one call of ``op`` (``ti``'s try) and render its templated fields
    in place: the one entry point the worker calls, before ``execute`` and again before a
    resumed method (from the same values).

    Template files are read, and templates that read Variables or Connections (or call the
    DAG's own macros) rendered, in a worker thread: off the event loop. Variables and stored
    Connections are read through ``store`` for the rest of the call (task code too).
    ``task_instance``: the ``ti`` (and ``task_instance``) of the context when given (the
    worker's, with XCom: engine/worker/xcom.py); templates that read it are rendered in a
    worker thread too (``ti.xcom_pull`` waits for the loop)."""
    bind_store_here(store)
    context = build_context(
        ti, op, op.dag, default_deferrable=default_deferrable, task_instance=task_instance
    )
    if ti.run_type == "asset_triggered":
        rows = await with_db_retry(
            "read the run's triggering asset events",
            lambda: store.triggering_asset_events(ti.dag_id, ti.run_id),
        )
        context["triggering_asset_events"] = triggering_events(rows)
    if reads_files(op):
        prepared = await anyio.to_thread.run_sync(prepare, op)
    else:
        prepared = prepare(op)
    if _wants_prev_success(op, prepared):
        row = await with_db_retry(
            "look up the previous successful run",
            lambda: store.prev_success_run(ti.dag_id, ti.logical_date),
        )
        context.update(prev_success_values(row))
    if prepared.names & _READS_STORE or getattr(op.dag, "user_defined_macros", None):
        rendered = await anyio.to_thread.run_sync(prepared.render, context)
    else:
        rendered = prepared.render(context)
    return RenderedTask(context, None if rendered is None else redact(jsonable(rendered)))


# -- compiling a task's fields -------------------------------------------------------------


class _Field(NamedTuple):
    """A template inside a field's value, where it sits."""

    template: CompiledTemplate


class _Container(NamedTuple):
    """A list, tuple, set or dict (``items``: a dict for a dict) holding templates."""

    kind: type
    items: Any


class _Nested(NamedTuple):
    """An object with ``template_fields`` of its own, and its fields' compiled values."""

    obj: Any
    fields: dict[str, Any]


class Prepared:
    """A task's templated fields, compiled: which variables they read, and how to render
    them onto the operator."""

    __slots__ = ("_env", "_fields", "names", "op")

    def __init__(
        self,
        op: BaseOperator,
        fields: dict[str, Any],
        names: frozenset[str],
        env: Env | None = None,
    ) -> None:
        self.op = op
        self._fields = fields
        self._env = env
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
                except (jinja2.TemplateError, TypeError, ValueError) as exc:
                    raise _error(self.op, name, exc, context, self._env) from None
                setattr(self.op, name, value)
            rendered[name] = getattr(self.op, name, None)
        return rendered


_UNDEFINED_NAME = re.compile(r"^'([^']+)' is undefined$")


def _error(
    op: BaseOperator,
    field: str,
    exc: Exception,
    context: Mapping[str, Any] | None = None,
    env: Env | None = None,
) -> TemplateRenderError:
    dag = getattr(op, "dag", None)
    task = f"{dag.dag_id}.{op.task_id}" if dag is not None else op.task_id
    if isinstance(exc, jinja2.TemplateNotFound):
        searched = ", ".join(env_for(op).paths) or "(no DAG folder, no template_searchpath)"
        detail = f"template file {exc.name!r} not found in {searched}"
    elif isinstance(exc, jinja2.TemplateSyntaxError):
        detail = f"template syntax error: {exc.message} (line {exc.lineno})"
    elif isinstance(exc, jinja2.exceptions.SecurityError):
        detail = f"refused by the template sandbox: {exc}"
    else:
        detail = (
            str(exc) if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: {exc}"
        )
        found = _UNDEFINED_NAME.match(detail)
        if found is not None and context is not None:
            known = set(context)
            if env is not None:
                known |= set(env.jinja.globals)
            detail += close_names(found.group(1), known)
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
        if _may_hold_template(value := getattr(op, name, None), ext)
    ]
    if not templated:  # the common case: no Jinja environment, nothing compiled
        return Prepared(op, fields, frozenset())
    env = env_for(op)
    # (A mapped instance's arguments read from upstream XComs are values, not templates.)
    resolved = frozenset(getattr(op, "resolved_value_ids", ()) or ())
    for name, value in templated:
        try:
            compiled, found = _compile_value(env, value, ext, set(resolved))
        except jinja2.TemplateError as exc:
            raise _error(op, name, exc, None, env) from None
        if found is not None:
            fields[name] = compiled
            names.update(found)
    return Prepared(op, fields, frozenset(names), env)


def _compile_value(
    env: Env, value: Any, ext: tuple[str, ...], seen: set[int]
) -> tuple[Any, set[str] | None]:
    """``value`` with its templates compiled and the names they read; None instead of the
    names when it holds no template (an empty set: templates that read no variable). A value
    in ``seen`` is left as it is."""
    if id(value) in seen:
        return value, None
    if isinstance(value, str):
        if ext and value.endswith(ext):
            tpl = env.from_file(value)
        elif env.is_template(value):
            tpl = env.from_string(value)
        else:
            return value, None
        return _Field(tpl), set(tpl.names)
    if isinstance(value, list | tuple | set | frozenset):
        items, names = _compile_items(env, value, ext, seen)
        if names is None:
            return value, None
        return _Container(type(value), items), names
    if isinstance(value, dict):
        keys = list(value)
        items, names = _compile_items(env, value.values(), ext, seen)
        if names is None:
            return value, None
        return _Container(dict, dict(zip(keys, items, strict=True))), names
    inner = _template_fields_of(value)
    if inner and id(value) not in seen:
        seen.add(id(value))
        nested: dict[str, Any] = {}
        found: set[str] | None = None
        for attr in inner:
            compiled, names_ = _compile_value(env, getattr(value, attr, None), ext, seen)
            if names_ is not None:
                nested[attr] = compiled
                found = (found or set()) | names_
        if found is not None:
            return _Nested(value, nested), found
    return value, None


def _template_fields_of(value: Any) -> tuple[str, ...]:
    """The ``template_fields`` of an object that is not a plain value (a nested object of
    the user's, as in Airflow)."""
    if value is None or isinstance(value, int | float | bytes | dt.date | dt.time | type):
        return ()
    fields = getattr(value, "template_fields", None)
    if isinstance(fields, str) or not isinstance(fields, list | tuple):
        return ()
    return tuple(f for f in fields if isinstance(f, str))


def _compile_items(
    env: Env, values: Iterable[Any], ext: tuple[str, ...], seen: set[int]
) -> tuple[list[Any], set[str] | None]:
    items: list[Any] = []
    names: set[str] | None = None
    for item in values:
        compiled, found = _compile_value(env, item, ext, seen)
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
    if isinstance(compiled, _Nested):
        for attr, value in compiled.fields.items():
            setattr(compiled.obj, attr, _render(value, context))
        return compiled.obj
    return compiled


def reads_files(op: BaseOperator) -> bool:
    """Whether preparing ``op`` may read template files (then better done off the loop)."""
    ext = tuple(getattr(op, "template_ext", ()) or ())
    if not ext:
        return False
    return any(_names_file(getattr(op, f, None), ext, set()) for f in op.template_fields)


def _names_file(value: Any, ext: tuple[str, ...], seen: set[int]) -> bool:
    if isinstance(value, str):
        return value.endswith(ext)
    if isinstance(value, list | tuple | set | frozenset):
        return any(_names_file(v, ext, seen) for v in value)
    if isinstance(value, dict):
        return any(_names_file(v, ext, seen) for v in value.values())
    inner = _template_fields_of(value)
    if inner and id(value) not in seen:
        seen.add(id(value))
        return any(_names_file(getattr(value, a, None), ext, seen) for a in inner)
    return False


def _may_hold_template(value: Any, ext: tuple[str, ...]) -> bool:
    """Whether a field's value holds a string or a nested object with templated fields: a
    value of numbers, None or other plain data needs no environment."""
    if isinstance(value, str):
        return True
    if isinstance(value, list | tuple | set | frozenset):
        return any(_may_hold_template(v, ext) for v in value)
    if isinstance(value, dict):
        return any(_may_hold_template(v, ext) for v in value.values())
    return bool(_template_fields_of(value))


def _wants_prev_success(op: BaseOperator, prepared: Prepared) -> bool:
    """Whether the task asks for any of :data:`PREV_SUCCESS_KEYS` (one store query gives them
    all). (Most tasks have no template reading them and no ``python_callable``: two looks.)"""
    if not prepared.names and getattr(op, "python_callable", None) is None:
        return False
    return any(wants(op, prepared, key) for key in PREV_SUCCESS_KEYS)


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
    fields = _template_fields_of(value)
    if fields:
        return {f: jsonable(getattr(value, f, None)) for f in fields}
    return repr(value)
