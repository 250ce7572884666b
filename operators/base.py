"""The operator contract: what a task does, and how it hands a wait to a triggerer.

``execute(context)`` runs on a worker (a plain ``def`` in a worker thread, an
``async def`` on the worker's loop). ``self.defer(trigger=..., method_name=...)``
frees the worker slot: the trigger goes to a triggerer and, when it fires, the
task resumes on a fresh operator instance at ``method_name(context, event=...)``.
This module never imports the runtime (``engine``).
"""

from __future__ import annotations

import copy
import copyreg
import datetime as dt
import difflib
import functools
import inspect
import logging
import math
import re
import types
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, NoReturn, Protocol, TypedDict

from operators.xcom import XComArg, find_refs
from triggers.base import (
    BaseTrigger,
    SerializedTrigger,
    TriggerSerializationError,
    encode_value,
    validate_trigger,
)

__all__ = [
    "DEFAULT_POOL",
    "DEFAULT_QUEUE",
    "ISOLATION_MODES",
    "MAX_WAIT_S",
    "TRIGGER_RULES",
    "WEIGHT_RULES",
    "BaseOperator",
    "Context",
    "DagLike",
    "FailTask",
    "RescheduleRequested",
    "SkipTask",
    "TaskDeferred",
    "TriggerSerializationError",
    "call_with_context",
    "current_dag",
    "dag_context",
    "to_seconds",
]

TRIGGER_RULES = frozenset(
    {
        "all_success",
        "all_failed",
        "all_done",
        "all_skipped",
        "one_success",
        "one_failed",
        "one_done",
        "none_failed",
        "none_failed_min_one_success",
        "none_skipped",
        "always",
    }
)

DEFAULT_RETRY_DELAY_S = 300.0

#: The longest wait a task may ask for, in seconds (ten years): the largest ``defer(timeout=)``
#: and the furthest a reschedule may lie ahead. Deadlines are stored as database timestamps;
#: beyond a bound like this one (or for nan and infinity) the database refuses to make one.
MAX_WAIT_S = 10 * 365 * 24 * 3600.0
#: Where ``execute`` runs: "none", in the worker process (a ``def`` in a worker thread, an
#: ``async def`` on its loop); "process", in a child process (``engine.worker.isolation``) that the
#: execution_timeout can stop, at the cost of starting one per call.
ISOLATION_MODES = ("none", "process")
#: The pool of a task that names none; it exists from the start (128 slots).
DEFAULT_POOL = "default_pool"
#: The queue of tasks and triggers that name none, and of workers and triggerers by default.
DEFAULT_QUEUE = "default"
#: How a task's priority is computed from ``priority_weight``s.
WEIGHT_RULES = ("downstream", "upstream", "absolute")


#: The database stores these counts and weights as 32-bit integers.
INT32_MAX = 2**31 - 1


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
    #: How the run came to be: ``scheduled``, ``manual`` or ``backfill``.
    run_type: str


class DagLike(Protocol):
    """What an operator needs of the DAG it is declared in (``engine.DAG`` provides it)."""

    dag_id: str

    def add_task(self, task: BaseOperator) -> None: ...


_current_dag: ContextVar[DagLike | None] = ContextVar("deferral_current_dag", default=None)


def current_dag() -> DagLike | None:
    """The DAG whose ``with`` block is open, if any."""
    return _current_dag.get()


def dag_context() -> ContextVar[DagLike | None]:
    """The context variable ``with DAG(...)`` sets; used by the runtime's DAG class."""
    return _current_dag


class TaskDeferred(BaseException):
    """Raised by :meth:`BaseOperator.defer`; the worker stores the deferral and frees the slot.

    Derives from ``BaseException`` so that a user's ``except Exception`` cannot swallow it.
    ``encoded_kwargs`` is ``kwargs`` as stored (``encode_value``): ``defer()`` encodes them
    once, to check them, and the worker stores those bytes. (A TaskDeferred built by hand
    without them has its kwargs encoded by the worker.) ``timeout_s`` is the trigger's own
    timeout; the task's execution_timeout, if earlier, bounds the deferral too.
    """

    def __init__(
        self,
        *,
        trigger: SerializedTrigger,
        method_name: str,
        kwargs: dict[str, Any],
        timeout_s: float | None,
        encoded_kwargs: bytes | None = None,
    ) -> None:
        super().__init__(f"deferred to {trigger.classpath}, resume at {method_name}")
        self.trigger = trigger
        self.method_name = method_name
        self.kwargs = kwargs
        self.timeout_s = timeout_s
        self.encoded_kwargs = encoded_kwargs


class RescheduleRequested(BaseException):
    """Raised by a sensor in reschedule mode: free the slot, run again at ``reschedule_at``."""

    def __init__(self, reschedule_at: dt.datetime) -> None:
        super().__init__(f"reschedule at {reschedule_at.isoformat()}")
        self.reschedule_at = reschedule_at


class SkipTask(Exception):
    """Raise from a task to end it as ``skipped``."""


class FailTask(Exception):
    """Raise from a task to end it as ``failed`` without using its remaining retries."""


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


#: Types whose values deepcopy returns as they are.
_IMMUTABLE: frozenset[type] = frozenset(
    {
        type(None), bool, int, float, complex, str, bytes, range, type,
        dt.datetime, dt.date, dt.time, dt.timedelta, dt.timezone,
        types.FunctionType, types.BuiltinFunctionType,
    }
)  # fmt: skip


_BY_DICT: dict[type, bool] = {}


def _copies_by_dict(cls: type) -> bool:
    """Whether deepcopy would copy an instance of ``cls`` as a new object with a deep copy
    of its ``__dict__`` (no custom copy or pickle hooks, no ``__slots__``)."""
    known = _BY_DICT.get(cls)
    if known is None:
        known = _BY_DICT[cls] = _plain_copy_hooks(cls)
    return known


def _plain_copy_hooks(cls: type) -> bool:
    return (
        getattr(cls, "__deepcopy__", None) is None
        and cls not in copyreg.dispatch_table
        and getattr(cls, "__reduce_ex__", None) is object.__reduce_ex__
        and getattr(cls, "__reduce__", None) is object.__reduce__
        and getattr(cls, "__getstate__", None) is object.__getstate__
        and getattr(cls, "__setstate__", None) is None
        and getattr(cls, "__getnewargs__", None) is None
        and getattr(cls, "__getnewargs_ex__", None) is None
        # Either could answer __deepcopy__ for an instance.
        and getattr(cls, "__getattr__", None) is None
        and getattr(cls, "__getattribute__", None) is object.__getattribute__
        and not any("__slots__" in vars(k) for k in cls.__mro__ if k is not object)
    )


#: Arguments a DAG's ``default_args`` never set.
_NOT_DEFAULTED = frozenset({"task_id", "dag"})


@functools.lru_cache(maxsize=1024)
def _accepted_args(cls: type) -> frozenset[str]:
    """The keyword arguments an operator class's ``__init__`` chain accepts by name: each
    ``__init__`` up the class tree, for as long as they pass ``**kwargs`` on."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        params = inspect.signature(getattr(init, "__wrapped__", init)).parameters.values()
        names.update(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            break
    return frozenset(names - {"self"} - _NOT_DEFAULTED)


def _with_default_args(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap an operator's ``__init__`` so the DAG's ``default_args`` fill in the arguments the
    caller did not pass (the outermost call only: a subclass calling ``super().__init__``
    passes them on). The DAG is the ``dag=`` argument or the open ``with DAG(...)``; it is
    read by attribute, so this contract imports no runtime."""

    @functools.wraps(init)
    def wrapper(self: BaseOperator, *args: Any, **kwargs: Any) -> None:
        if "_passed_args" in self.__dict__:
            init(self, *args, **kwargs)
            return
        # The arguments the task was given itself (``default_args`` do not override them).
        self.__dict__["_passed_args"] = frozenset(kwargs)
        dag = kwargs.get("dag") or current_dag()
        defaults = getattr(dag, "default_args", None)
        if defaults:
            accepted = _accepted_args(type(self))  # type: ignore[arg-type]
            for name, value in defaults.items():
                if name not in kwargs and name in accepted:
                    kwargs[name] = value
        init(self, *args, **kwargs)

    return wrapper


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
            cls.__init__ = _with_default_args(init)  # type: ignore[method-assign]

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

    def fresh_copy(self) -> BaseOperator:
        """An independent instance for one execution; nothing set on it leaks back.

        What ``copy.deepcopy`` makes (the DAG shared, not copied), built faster for the usual
        operator, whose state is its ``__dict__``: immutable attribute values are shared, not
        sent through deepcopy one by one (a worker copies an operator for every try and
        every resume)."""
        memo: dict[int, Any] = {}
        if self.dag is not None:
            memo[id(self.dag)] = self.dag
        cls = type(self)
        if not _copies_by_dict(cls) or "__deepcopy__" in self.__dict__:
            return copy.deepcopy(self, memo)
        new = cls.__new__(cls)
        memo[id(self)] = new
        state = new.__dict__
        for key, value in self.__dict__.items():
            state[key] = value if type(value) in _IMMUTABLE else copy.deepcopy(value, memo)
        return new

    def __repr__(self) -> str:
        return f"<{type(self).__qualname__} {self.task_id}>"


BaseOperator.__init__ = _with_default_args(BaseOperator.__init__)  # type: ignore[method-assign]
