"""The operator contract: what a task does, and how it hands a wait to a triggerer.

``execute(context)`` runs on a worker (a plain ``def`` in a worker thread, an
``async def`` on the worker's loop). ``self.defer(trigger=..., method_name=...)``
frees the worker slot: the trigger goes to a triggerer and, when it fires, the
task resumes on a fresh operator instance at ``method_name(context, event=...)``.
This module never imports the runtime (``engine``).
"""

from __future__ import annotations

import datetime as dt
import difflib
import inspect
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypedDict

from operators.assets import Asset
from operators.callbacks import TASK_CALLBACK_KINDS, Callbacks, check_callbacks
from operators.copying import fresh_copy
from operators.dagcontext import (
    DagLike,
    accepted_args,
    current_dag,
    dag_context,
    with_default_args,
)
from operators.defaults import (
    DEFAULT_POOL,
    DEFAULT_QUEUE,
    DEFAULT_RETRY_DELAY_S,
    INT32_MAX,
    ISOLATION_MODES,
    MAX_WAIT_S,
    TRIGGER_RULES,
    WEIGHT_RULES,
)
from operators.mapping import MapInputError, check_literal
from operators.signals import FailTask, RescheduleRequested, SkipTask, TaskDeferred
from operators.xcom import XComArg, find_refs
from triggers.base import (
    BaseTrigger,
    TriggerSerializationError,
    encode_value,
    validate_trigger,
)

# The constants (operators.defaults), the signals (operators.signals) and the DAG context
# (operators.dagcontext) are re-exported: DAG files import them from here.
__all__ = [
    "DEFAULT_POOL",
    "DEFAULT_QUEUE",
    "DEFAULT_RETRY_DELAY_S",
    "INT32_MAX",
    "ISOLATION_MODES",
    "MAX_WAIT_S",
    "TRIGGER_RULES",
    "WEIGHT_RULES",
    "BaseOperator",
    "Context",
    "DagLike",
    "FailTask",
    "MapInputError",
    "MappedOperator",
    "OperatorPartial",
    "RescheduleRequested",
    "SkipTask",
    "TaskDeferred",
    "TriggerSerializationError",
    "call_with_context",
    "current_dag",
    "dag_context",
    "to_seconds",
]


def _check_int(task_id: str, name: str, value: object, *, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"task {task_id}: {name} must be an int, got {value!r}")
    low = -INT32_MAX - 1 if minimum is None else minimum
    if not low <= value <= INT32_MAX:
        raise ValueError(f"task {task_id}: {name} must be in [{low}, {INT32_MAX}], got {value!r}")


_TASK_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,249}$")


class Context(TypedDict, total=False):
    """What ``execute`` and a resumed method receive."""

    dag_id: str
    run_id: str
    task_id: str
    try_number: int
    logical_date: dt.datetime
    conf: dict[str, Any]
    ti_id: int
    #: When the task's first try started (database clock).
    first_try_at: dt.datetime | None
    #: When this worker claimed it for the current call (database clock).
    claimed_at: dt.datetime | None
    #: The engine's ``default_deferrable`` setting: whether operators that can defer and were
    #: not told (``deferrable=None``) do. The runtime hands it over here, at run time.
    default_deferrable: bool
    # The template variables (docs/reference/templates.md), which are context keys as well.
    ds: str
    ds_nodash: str
    ts: str
    ts_nodash: str
    data_interval_start: dt.datetime
    data_interval_end: dt.datetime
    #: Present when a template or the callable asks for it.
    prev_data_interval_start_success: dt.datetime | None
    dag_run: Any
    params: dict[str, Any]
    task: BaseOperator
    ti: Any
    macros: Any
    #: PythonOperator's ``templates_dict``, rendered.
    templates_dict: dict[str, Any] | None
    #: How the run came to be: ``scheduled``, ``manual``, ``backfill`` or ``asset_triggered``.
    run_type: str
    #: What the task's success records of each outlet asset: ``outlet_events[asset].extra``.
    outlet_events: Any
    #: The asset events that triggered the run, by asset (empty unless asset-triggered).
    triggering_asset_events: Any


def to_seconds(value: dt.timedelta | float | int | None, name: str) -> float | None:
    """Accept a timedelta or a number of seconds; reject negatives with a clear message."""
    if value is None:
        return None
    if isinstance(value, dt.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{name} must be a timedelta or a number of seconds, got {value!r}")
    if seconds < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")
    return seconds


def call_with_context(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], context: Context
) -> Any:
    """``fn(*args, **kwargs)``, plus the context entries ``fn`` asks for by parameter name
    (all of them for ``**kwargs``; an explicit kwarg wins over a context entry of its name).
    What ``PythonOperator`` and ``PythonSensor`` run."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins have no signature: pass no context
        params = None
    if params is None:
        extra: dict[str, Any] = {}
    elif any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        extra = dict(context)
    else:
        extra = {name: value for name, value in context.items() if name in params}
    extra = {k: v for k, v in extra.items() if k not in kwargs}
    return fn(*args, **kwargs, **extra)


def _deferral_timeout_s(task_id: str, timeout: dt.timedelta | float | None) -> float | None:
    """``defer(timeout=)`` in seconds: none, or finite, not negative and at most MAX_WAIT_S."""
    try:
        seconds = to_seconds(timeout, "timeout")
    except (TypeError, ValueError, OverflowError) as exc:
        raise TriggerSerializationError(f"task {task_id}: defer(timeout=...): {exc}") from None
    if seconds is not None and not (math.isfinite(seconds) and seconds <= MAX_WAIT_S):
        raise TriggerSerializationError(
            f"task {task_id}: defer(timeout={timeout!r}) must be a finite number of seconds "
            f"from 0 to {MAX_WAIT_S:.0f} (ten years)"
        )
    return seconds


class BaseOperator:
    """Base class of every task.

    Subclasses implement ``execute(self, context)``; its return value is the
    task's result. Settings are keyword-only, as in the rest of the engine. Arguments a
    task does not pass come from its DAG's ``default_args`` when they name them.
    """

    #: Attributes the worker renders with Jinja2 just before the task runs
    #: (engine.worker.templating): strings, and the values of lists, tuples, sets and dicts, nested
    #: too.
    template_fields: Sequence[str] = ()
    #: A templated string ending in one of these names a template file, read from the DAG's
    #: folder or its ``template_searchpath`` and rendered.
    template_ext: Sequence[str] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and not hasattr(init, "__wrapped__"):
            cls.__init__ = with_default_args(init)  # type: ignore[method-assign]

    def __init__(
        self,
        *,
        task_id: str,
        retries: int = 0,
        retry_delay: dt.timedelta | float = DEFAULT_RETRY_DELAY_S,
        retry_exponential_backoff: bool = False,
        max_retry_delay: dt.timedelta | float | None = None,
        execution_timeout: dt.timedelta | float | None = None,
        trigger_rule: str = "all_success",
        priority_weight: int = 1,
        weight_rule: str = "downstream",
        pool: str = DEFAULT_POOL,
        pool_slots: int = 1,
        queue: str = DEFAULT_QUEUE,
        trigger_queue: str = DEFAULT_QUEUE,
        max_active_tis_per_dag: int | None = None,
        isolation: str = "none",
        on_execute_callback: Callbacks = None,
        on_success_callback: Callbacks = None,
        on_failure_callback: Callbacks = None,
        on_retry_callback: Callbacks = None,
        on_skipped_callback: Callbacks = None,
        outlets: Asset | Sequence[Asset] | None = None,
        inlets: Asset | Sequence[Asset] | None = None,
        dag: DagLike | None = None,
    ) -> None:
        if not isinstance(task_id, str) or not _TASK_ID.match(task_id):
            raise ValueError(
                f"task_id {task_id!r} must be 1-250 characters of letters, digits, '_', '-', '.'"
            )
        if trigger_rule not in TRIGGER_RULES:
            raise ValueError(
                f"task {task_id}: unknown trigger_rule {trigger_rule!r}; "
                f"choose one of {', '.join(sorted(TRIGGER_RULES))}"
            )
        if isolation not in ISOLATION_MODES:
            raise ValueError(
                f"task {task_id}: isolation must be one of {', '.join(ISOLATION_MODES)}, "
                f"got {isolation!r}"
            )
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ValueError(f"task {task_id}: retries must be an int >= 0, got {retries!r}")
        if weight_rule not in WEIGHT_RULES:
            raise ValueError(
                f"task {task_id}: unknown weight_rule {weight_rule!r}; "
                f"choose one of {', '.join(WEIGHT_RULES)}"
            )
        _check_int(task_id, "priority_weight", priority_weight, minimum=None)
        _check_int(task_id, "pool_slots", pool_slots, minimum=1)
        if max_active_tis_per_dag is not None:
            _check_int(task_id, "max_active_tis_per_dag", max_active_tis_per_dag, minimum=1)
        for name, value in (("pool", pool), ("queue", queue), ("trigger_queue", trigger_queue)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"task {task_id}: {name} must be a non-empty str, got {value!r}")
        self.task_id = task_id
        self.retries = retries
        self.retry_delay_s = to_seconds(retry_delay, "retry_delay") or 0.0
        self.retry_exponential_backoff = bool(retry_exponential_backoff)
        self.max_retry_delay_s = to_seconds(max_retry_delay, "max_retry_delay")
        self.execution_timeout_s = to_seconds(execution_timeout, "execution_timeout")
        self.trigger_rule = trigger_rule
        #: Own weight; the task's priority among runnable tasks is computed from it by
        #: ``weight_rule``: ``downstream`` (own + every downstream task's), ``upstream`` (own +
        #: every upstream task's) or ``absolute`` (own only). Higher runs first.
        self.priority_weight = priority_weight
        self.weight_rule = weight_rule
        #: Slots of ``pool`` the task holds while running (and, if the pool includes them,
        #: while deferred).
        self.pool = pool
        self.pool_slots = pool_slots
        #: The workers serving ``queue`` run the task; the triggerers serving
        #: ``trigger_queue`` run its triggers.
        self.queue = queue
        self.trigger_queue = trigger_queue
        #: Running tries of this task across the DAG's runs at once (None: no limit).
        self.max_active_tis_per_dag = max_active_tis_per_dag
        #: "none": ``execute`` runs in the worker process (a ``def`` in a thread, which an
        #: execution_timeout cannot stop); "process": in a child process the timeout ends.
        self.isolation = isolation
        #: Callbacks (operators/callbacks.py): each a callable taking the context, or a list.
        self.on_execute_callback = on_execute_callback
        self.on_success_callback = on_success_callback
        self.on_failure_callback = on_failure_callback
        self.on_retry_callback = on_retry_callback
        self.on_skipped_callback = on_skipped_callback
        for kind in ("execute", *TASK_CALLBACK_KINDS):
            check_callbacks(
                f"task {task_id}", f"on_{kind}_callback", getattr(self, f"on_{kind}_callback")
            )
        #: The assets whose events the task's success records (``outlets``), and the ones it
        #: reads (``inlets``, for the reader's information only).
        self.outlets: list[Asset] = _assets(task_id, "outlets", outlets)
        self.inlets: list[Asset] = _assets(task_id, "inlets", inlets)
        self.upstream_task_ids: set[str] = set()
        self.downstream_task_ids: set[str] = set()
        self.dag: DagLike | None = None
        dag = dag if dag is not None else current_dag()
        if dag is not None:
            dag.add_task(self)
            self.dag = dag

    def __setattr__(self, name: str, value: Any) -> None:
        # A reference to another task's XCom in a templated field makes that task upstream.
        object.__setattr__(self, name, value)
        if name in type(self).template_fields and "upstream_task_ids" in self.__dict__:
            for ref in find_refs(value):
                self.set_upstream(ref.operator)

    @property
    def output(self) -> XComArg:
        """A reference to this task's return value (its ``return_value`` XCom), to pass to
        another task; ``output["key"]`` refers to the XCom ``key``."""
        return XComArg(self)

    # -- the work ------------------------------------------------------------------------

    def execute(self, context: Context) -> Any:
        """Do the task's work; ``def`` or ``async def``. The return value is the result."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement execute()")

    @property
    def log(self) -> logging.Logger:
        """A logger named after the operator's class; the engine binds the task instance ids."""
        cls = type(self)
        return logging.getLogger(f"{cls.__module__}.{cls.__qualname__}")

    def defer(
        self,
        *,
        trigger: BaseTrigger,
        method_name: str,
        kwargs: dict[str, Any] | None = None,
        timeout: dt.timedelta | float | None = None,
    ) -> NoReturn:
        """Hand the wait to a triggerer and free this worker slot.

        Validates everything before the worker writes anything: the trigger
        must rebuild from its ``(classpath, kwargs)``, ``method_name`` must name
        a method of this operator, and ``kwargs`` must be plain data. On resume,
        ``method_name(context, event=<payload>, **kwargs)`` runs on a fresh
        operator instance.
        """
        serialized = validate_trigger(trigger)
        method = getattr(self, method_name, None) if isinstance(method_name, str) else None
        if not callable(method):
            raise TriggerSerializationError(
                f"task {self.task_id}: defer(method_name={method_name!r}) does not name a method "
                f"of {type(self).__qualname__}{self._method_hint(method_name)}"
            )
        resume_kwargs = dict(kwargs or {})
        reserved = sorted({"context", "event"} & set(resume_kwargs))
        if reserved:
            raise TriggerSerializationError(
                f"task {self.task_id}: defer(kwargs=...) must not use the names {reserved}: the "
                f"resumed method is called as {method_name}(context, event=<payload>, **kwargs)"
            )
        try:
            encoded_kwargs = encode_value(resume_kwargs)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TriggerSerializationError(
                f"task {self.task_id}: defer(kwargs=...) must be plain data: {exc}"
            ) from None
        timeout_s = _deferral_timeout_s(self.task_id, timeout)
        raise TaskDeferred(
            trigger=serialized,
            method_name=method_name,
            kwargs=resume_kwargs,
            timeout_s=timeout_s,
            encoded_kwargs=encoded_kwargs,
        )

    def _method_hint(self, method_name: object) -> str:
        """``; did you mean ...?`` with the operator's method names closest to
        ``method_name``, or the methods its own classes define when none is close."""
        names = sorted(
            name
            for name in dir(type(self))
            if not name.startswith("_") and callable(getattr(type(self), name, None))
        )
        if isinstance(method_name, str):
            close = difflib.get_close_matches(method_name, names, n=3, cutoff=0.6)
            if close:
                return f"; did you mean {' or '.join(repr(n) for n in close)}?"
        own = [n for n in names if not hasattr(BaseOperator, n)]
        if own:
            return f" (its methods: {', '.join(own)})"
        return ""

    # -- the graph -----------------------------------------------------------------------

    def set_downstream(self, other: Any) -> None:
        many = not isinstance(other, BaseOperator | XComArg)
        for item in list(other) if many else [other]:
            task = item.operator if isinstance(item, XComArg) else item
            if not isinstance(task, BaseOperator):
                raise TypeError(f"cannot set {task!r} downstream of task {self.task_id}")
            self.downstream_task_ids.add(task.task_id)
            task.upstream_task_ids.add(self.task_id)

    def set_upstream(self, other: Any) -> None:
        many = not isinstance(other, BaseOperator | XComArg)
        for item in list(other) if many else [other]:
            task = item.operator if isinstance(item, XComArg) else item
            if not isinstance(task, BaseOperator):
                raise TypeError(f"cannot set {task!r} upstream of task {self.task_id}")
            task.set_downstream(self)

    def __rshift__(self, other: Any) -> Any:
        self.set_downstream(other)
        return other

    def __lshift__(self, other: Any) -> Any:
        self.set_upstream(other)
        return other

    def __rrshift__(self, other: Any) -> BaseOperator:
        # [a, b] >> c
        self.set_upstream(other)
        return self

    def __rlshift__(self, other: Any) -> BaseOperator:
        # [a, b] << c
        self.set_downstream(other)
        return self

    # -- dynamic mapping -------------------------------------------------------------------

    @classmethod
    def partial(cls, **kwargs: Any) -> OperatorPartial:
        """The arguments every instance of a mapped task shares (``task_id`` among them);
        ``.expand(name=values)`` or ``.expand_kwargs(list_of_dicts)`` then makes the mapped
        task, one instance per value, once the values are known."""
        return OperatorPartial(cls, kwargs)

    def fresh_copy(self) -> BaseOperator:
        """An independent instance for one execution; nothing set on it leaks back.

        What ``copy.deepcopy`` makes (the DAG shared, not copied), built faster for the usual
        operator, whose state is its ``__dict__``: immutable attribute values are shared, not
        sent through deepcopy one by one (a worker copies an operator for every try and
        every resume)."""
        return fresh_copy(self, self.dag)

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} {self.task_id}>"


BaseOperator.__init__ = with_default_args(BaseOperator.__init__)  # type: ignore[method-assign]


#: The arguments of BaseOperator itself: a mapped task's own (its retries, pool, ...), never
#: mapped.
_BASE_ARGS = frozenset(inspect.signature(BaseOperator.__init__).parameters) - {"self"}


def _ids(value: Any) -> set[int]:
    """The ids of ``value`` and of every item nested in its lists, tuples, sets and dicts."""
    found = {id(value)}
    if isinstance(value, list | tuple | set | frozenset):
        for item in value:
            found |= _ids(item)
    elif isinstance(value, dict):
        for item in value.values():
            found |= _ids(item)
    return found


class OperatorPartial:
    """``SomeOperator.partial(task_id=..., **fixed)``: what the instances of a mapped task
    share, waiting for ``.expand(...)`` or ``.expand_kwargs(...)``. ``mapped_into``: the
    argument (a dict) the mapped values go into instead of the operator's own arguments (a
    TaskFlow function's ``op_kwargs``)."""

    def __init__(
        self,
        operator_class: type[BaseOperator],
        kwargs: Mapping[str, Any],
        *,
        mapped_into: str | None = None,
    ) -> None:
        task_id = kwargs.get("task_id")
        if not isinstance(task_id, str):
            raise TypeError(
                f"{operator_class.__qualname__}.partial() needs task_id=..., got {task_id!r}"
            )
        fixed = dict(kwargs)
        # The DAG's default_args, as the operator's own __init__ would take them: a mapped
        # task's instances are made on the worker, outside the DAG's `with` block.
        dag = fixed.get("dag") or current_dag()
        defaults = getattr(dag, "default_args", None) or {}
        accepted = accepted_args(operator_class)
        for name, value in defaults.items():
            if name not in fixed and name in accepted:
                fixed[name] = value
        self.operator_class = operator_class
        self.kwargs = fixed
        self.mapped_into = mapped_into

    @property
    def task_id(self) -> str:
        return str(self.kwargs["task_id"])

    def expand(self, **mapped: Any) -> MappedOperator:
        """One task instance per value (per combination, for several arguments): each
        argument a list, a tuple, a dict (its ``(key, value)`` pairs) or a reference to an
        upstream task's value."""
        if not mapped:
            raise TypeError(f"task {self.task_id}: expand() needs at least one argument to map")
        for name, value in mapped.items():
            self._check_name(name)
            if not isinstance(value, XComArg):
                check_literal(self.task_id, name, value)
        return MappedOperator(self, expand_input=dict(mapped))

    def expand_kwargs(self, value: Any) -> MappedOperator:
        """One task instance per dict of arguments: a list of dicts, or a reference to an
        upstream task's value that is one."""
        if not isinstance(value, XComArg):
            if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
                raise MapInputError(
                    f"task {self.task_id}: expand_kwargs() needs a list of dicts or a reference "
                    f"to an upstream task's value (XComArg), got {type(value).__name__}"
                )
            for i, item in enumerate(value):
                if isinstance(item, XComArg):
                    continue
                if not isinstance(item, dict) or not all(isinstance(k, str) for k in item):
                    raise MapInputError(
                        f"task {self.task_id}: expand_kwargs() item {i} must be a dict with str "
                        f"keys, got {type(item).__name__}"
                    )
                for name in item:
                    self._check_name(name)
        return MappedOperator(self, expand_kwargs_input=value)

    def _check_name(self, name: str) -> None:
        if self.mapped_into is not None:
            return  # a TaskFlow function's arguments: checked against its signature
        if name in self.kwargs:
            raise TypeError(
                f"task {self.task_id}: {name!r} is given to both partial() and expand()"
            )
        if name in _BASE_ARGS:
            raise TypeError(
                f"task {self.task_id}: {name!r} is an argument of every task and cannot be "
                "mapped; give it to partial()"
            )
        if name not in accepted_args(self.operator_class):
            raise TypeError(
                f"task {self.task_id}: {self.operator_class.__qualname__} has no argument "
                f"{name!r} to expand"
            )

    def __repr__(self) -> str:
        return f"<{self.operator_class.__qualname__}.partial {self.task_id}>"


class MappedOperator(BaseOperator):
    """A mapped task: one task instance per value it is expanded over (``map_index`` 0..n-1),
    made when those values are known (an upstream task's value once that task has ended).
    An empty list skips the task; more instances than the setting ``max_map_length`` fail
    it. Each instance runs an operator of ``operator_class`` built from the shared arguments
    and its own (:meth:`unmap`): deferrable ones defer as any task does. Downstream tasks
    see its value as the list of its instances' values, in map index order."""

    def __init__(
        self,
        partial: OperatorPartial,
        *,
        expand_input: dict[str, Any] | None = None,
        expand_kwargs_input: Any = None,
    ) -> None:
        fixed = partial.kwargs
        super().__init__(**{k: v for k, v in fixed.items() if k in _BASE_ARGS})
        self.operator_class = partial.operator_class
        self.partial_kwargs = {k: v for k, v in fixed.items() if k != "dag"}
        self.mapped_into = partial.mapped_into
        #: ``expand(**expand_input)``, or ``expand_kwargs(expand_kwargs_input)``.
        self.expand_input = expand_input
        self.expand_kwargs_input = expand_kwargs_input
        # What the store keeps of the task (DAG.serialize_tasks) is the operator class's.
        self.soft_fail = bool(fixed.get("soft_fail", False))
        self.no_retry_on_timeout = bool(getattr(self.operator_class, "no_retry_on_timeout", False))
        self.multiple_outputs = bool(fixed.get("multiple_outputs", False))
        for ref in find_refs([fixed, expand_input, expand_kwargs_input]):
            self.set_upstream(ref.operator)

    def resolved_names(self, values: Mapping[str, Any], map_index: int) -> list[str]:
        """Which of instance ``map_index``'s arguments ``values`` come from upstream XComs:
        the ones expanded over a reference (for ``expand_kwargs``, all of them when its list,
        or the instance's item, is a reference)."""
        if self.expand_input is not None:
            return [n for n, v in self.expand_input.items() if isinstance(v, XComArg)]
        spec = self.expand_kwargs_input
        if isinstance(spec, XComArg) or (
            isinstance(spec, list | tuple)
            and 0 <= map_index < len(spec)
            and isinstance(spec[map_index], XComArg)
        ):
            return list(values)
        return []

    def references(self) -> list[XComArg]:
        """The upstream values the instances are made from (resolved on the worker)."""
        return find_refs(
            self.expand_input if self.expand_input is not None else self.expand_kwargs_input
        )

    def unmap(self, values: Mapping[str, Any], resolved: Iterable[str] = ()) -> BaseOperator:
        """The operator one instance runs: the shared arguments with ``values``, its own.
        ``resolved``: the names among them whose values came from upstream XComs, which are
        not rendered as templates (literal values of the DAG are, as any argument)."""
        kwargs = dict(self.partial_kwargs)
        if self.mapped_into is not None:
            kwargs[self.mapped_into] = {**(kwargs.get(self.mapped_into) or {}), **values}
        else:
            kwargs.update(values)
        op = self.operator_class(**kwargs)
        #: The arguments this instance was mapped with, and those of them read from upstream
        #: XComs (the worker's templating leaves those objects as they are).
        names = sorted(set(resolved) & set(values))
        op.mapped_values = dict(values)
        op.mapped_resolved = names
        # (by identity, nested items too: an operator may copy a list it is given)
        op.resolved_value_ids = _ids([values[name] for name in names])
        op.dag = self.dag
        op.upstream_task_ids = set(self.upstream_task_ids)
        op.downstream_task_ids = set(self.downstream_task_ids)
        return op

    def execute(self, context: Context) -> Any:
        raise RuntimeError(
            f"task {self.task_id} is mapped: each of its instances runs an operator of its own"
        )

    def __repr__(self) -> str:
        return f"<mapped {self.operator_class.__qualname__} {self.task_id}>"


def _assets(task_id: str, what: str, value: object) -> list[Asset]:
    """A task's ``outlets`` or ``inlets``: an Asset or a list of them, each once."""
    if value is None:
        return []
    items = [value] if isinstance(value, Asset) else value
    if isinstance(items, str | bytes) or not isinstance(items, Sequence | set | frozenset):
        raise TypeError(
            f"task {task_id}: {what} must be an Asset or a list of Assets, got "
            f"{type(value).__name__}"
        )
    found: list[Asset] = []
    for item in items:
        if not isinstance(item, Asset):
            raise TypeError(
                f"task {task_id}: {what} must hold Asset values, got {type(item).__name__} {item!r}"
            )
        if item not in found:
            found.append(item)
    return found
