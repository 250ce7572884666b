"""Every Prometheus metric of the engine, defined once, on a registry per process.

Names start with ``deferral_``, values are in base units (seconds, counts), counters end in
``_total``, and no label holds a task or trigger id (a label per id would be a time series
per id): the labels are the trigger's class, a state, a kind of error, which claim or write.

A process makes one :class:`Metrics` (``engine.launch.app.run_component`` does, and makes it the
process's :func:`current`); its HTTP server (engine/runtime/health.py) serves its registry. Code
that is not handed one (the retry helpers, a component built without ``metrics=``) uses
:func:`current`, created on first use. Tests that want counts of their own pass a fresh
``Metrics()`` to the component.

A trigger's class comes from a row of the database, which whoever can write the tables
chooses: 5,000 rows of distinct classpaths would be 5,000 series of every family labelled by
class. So a class is a label value only when the trigger allow-list admits it (the
triggerer hands its list over: :meth:`Metrics.admit_classes`), and each family holds at most
``max_series`` values of its own (setting ``metrics_max_series``); every other class is
counted under :data:`OTHER`. Label through :meth:`Metrics.count_by_class` /
:meth:`Metrics.inc_by_class`, never ``family.labels(classpath)``.

Instrumentation stays off the hot path's per-row work: gauges of what a process holds are
read at scrape time (``set_function``), claims and writes are observed once per batch, and
counters by trigger class are counted per batch where a batch exists.
"""

from __future__ import annotations

import platform
from collections import Counter as _Tally
from collections.abc import Callable, Iterable
from typing import Any

import asyncpg
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.config import DEFAULT_METRICS_MAX_SERIES
from engine.version import __version__

__all__ = ["DEFAULT_MAX_SERIES", "OTHER", "Metrics", "current", "db_error_kind", "use"]

# The `_created` series double every counter and histogram for little use here.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

#: Seconds: from a few milliseconds (a loop's normal lag, a resume on a quiet engine) to a
#: minute (a backlog).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_SIZE_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
#: Seconds of runs and tasks: from a tenth of a second to a day.
_RUN_BUCKETS = (0.1, 0.5, 1, 5, 10, 30, 60, 300, 600, 1800, 3600, 7200, 21600, 86400)

#: The label value that sums the classes not labelled by their own: refused by the allow-list,
#: or past a family's cap.
OTHER = "other"
#: Label values of the engine's own, always kept: ``unknown`` (no one trigger) and OTHER.
_OWN_VALUES = frozenset({OTHER, "unknown"})
#: The most trigger classes one family labels by their own value (setting metrics_max_series).
DEFAULT_MAX_SERIES = DEFAULT_METRICS_MAX_SERIES


def db_error_kind(exc: BaseException) -> str:
    """A database error's kind, for the ``kind`` label: a handful of values, never a message."""
    if isinstance(exc, asyncpg.SerializationError | asyncpg.DeadlockDetectedError):
        return "conflict"
    if isinstance(exc, TimeoutError | asyncpg.QueryCanceledError):
        return "timeout"
    if isinstance(exc, asyncpg.InsufficientResourcesError | asyncpg.TooManyConnectionsError):
        return "resources"
    if isinstance(exc, asyncpg.ReadOnlySQLTransactionError):
        return "read_only"
    if isinstance(
        exc,
        OSError
        | asyncpg.PostgresConnectionError
        | asyncpg.InterfaceError
        | asyncpg.InternalClientError
        | asyncpg.OperatorInterventionError,
    ):
        return "connection"
    if isinstance(exc, asyncpg.PostgresError):
        return "query"
    return "other"


class Metrics:
    """The metrics of one process (or one component in a test), on their own registry."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        max_series: int = DEFAULT_MAX_SERIES,
        admit_class: Callable[[str], bool] | None = None,
        kind: str | None = None,
    ) -> None:
        if max_series < 1:
            raise ValueError(f"max_series must be >= 1, got {max_series!r}")
        #: Trigger classes one family labels by their own value; the others go to OTHER.
        self.max_series = max_series
        self._admit_class = admit_class
        #: Per family (its name), the classes it labels by their own value.
        self._classes: dict[str, set[str]] = {}
        #: The labelled children inc_by_class counts in, by family and class.
        self._by_class: dict[tuple[str, str], Any] = {}
        self.registry = registry = registry if registry is not None else CollectorRegistry()
        #: The process these metrics are of (scheduler, worker, triggerer): its registry holds
        #: only the families that are its own (a triggerer exports no worker slots). None: all
        #: (a test, an engine in one process). The others exist, unexported.
        self.kind = kind

        def own(*kinds: str) -> CollectorRegistry | None:
            return registry if kind is None or kind in kinds else None

        r = registry
        self.build_info = Gauge(
            "deferral_build_info",
            "Always 1; the labels say which deferral and Python run.",
            ["version", "python"],
            registry=r,
        )
        self.build_info.labels(__version__, platform.python_version()).set(1)

        # -- triggerer -----------------------------------------------------------------------
        self.triggers_running = Gauge(
            "deferral_triggers_running",
            "Triggers this triggerer runs now.",
            registry=own("triggerer"),
        )
        self.triggers_capacity = Gauge(
            "deferral_triggers_capacity",
            "Triggers this triggerer may run at once.",
            registry=own("triggerer"),
        )
        self.trigger_starts = Counter(
            "deferral_trigger_starts",
            "Triggers started, by class.",
            ["trigger_class"],
            registry=own("triggerer"),
        )
        self.trigger_events = Counter(
            "deferral_trigger_events",
            "Trigger events produced (resume or end the waiting tasks), by class.",
            ["trigger_class"],
            registry=own("triggerer"),
        )
        self.trigger_failures = Counter(
            "deferral_trigger_failures",
            "Triggers that failed (raised, yielded nothing usable, blocked too long), by class.",
            ["trigger_class"],
            registry=own("triggerer"),
        )
        self.trigger_timeouts = Counter(
            "deferral_trigger_timeouts",
            "Deferrals that reached their deadline on a triggerer, by trigger class.",
            ["trigger_class"],
            registry=own("triggerer"),
        )
        self.loop_blocked = Counter(
            "deferral_loop_blocked_seconds",
            "Seconds the triggerer's event loop was blocked, by the class of the trigger that "
            "blocked it ('unknown': not one trigger).",
            ["trigger_class"],
            registry=own("triggerer"),
        )

        # -- every process -------------------------------------------------------------------
        self.loop_lag = Histogram(
            "deferral_loop_lag_seconds",
            "How late the process's event loop ran a timer (sampled twice a second).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.db_errors = Counter(
            "deferral_db_errors",
            "Database errors met (and retried or waited out), by kind.",
            ["kind"],
            registry=r,
        )

        # -- worker --------------------------------------------------------------------------
        self.resume_latency = Histogram(
            "deferral_resume_latency_seconds",
            "From a trigger event's write to a worker claiming the task to resume it.",
            buckets=_LATENCY_BUCKETS,
            registry=own("worker"),
        )
        self.worker_slots_used = Gauge(
            "deferral_worker_slots_used",
            "Slots of this worker taken by running tries.",
            registry=own("worker"),
        )
        self.worker_slots = Gauge(
            "deferral_worker_slots", "Slots of this worker in all.", registry=own("worker")
        )
        self.task_outcomes = Counter(
            "deferral_task_outcomes",
            "Tries ended by this worker, by the state they ended in.",
            ["state"],
            registry=own("worker"),
        )

        # -- claims and writes ---------------------------------------------------------------
        self.claim_batch = Histogram(
            "deferral_claim_batch_size",
            "Rows one claim took (claim: tasks or triggers).",
            ["claim"],
            buckets=_SIZE_BUCKETS,
            registry=own("worker", "triggerer"),
        )
        self.claim_duration = Histogram(
            "deferral_claim_duration_seconds",
            "How long one claim statement took (claim: tasks or triggers).",
            ["claim"],
            buckets=_DURATION_BUCKETS,
            registry=own("worker", "triggerer"),
        )
        self.write_batch = Histogram(
            "deferral_write_batch_size",
            "Items one batched write stored (write: task_outcomes, task_deferrals or "
            "trigger_events).",
            ["write"],
            buckets=_SIZE_BUCKETS,
            registry=own("worker", "triggerer"),
        )
        self.write_duration = Histogram(
            "deferral_write_duration_seconds",
            "How long one batched write took, retries included.",
            ["write"],
            buckets=_DURATION_BUCKETS,
            registry=own("worker", "triggerer"),
        )

        # -- fleet (the scheduler exports them) ----------------------------------------------
        self.tasks = Gauge(
            "deferral_tasks",
            "Task instances by state, across the fleet (the scheduler exports it).",
            ["state"],
            registry=own("scheduler"),
        )
        self.triggers_unassigned = Gauge(
            "deferral_triggers_unassigned",
            "Triggers no triggerer runs, across the fleet (the scheduler exports it).",
            registry=own("scheduler"),
        )
        self.pool_open_slots = Gauge(
            "deferral_pool_open_slots",
            "Slots a pool has left (negative: shrunk below what runs in it).",
            ["pool"],
            registry=own("scheduler"),
        )
        self.pool_queued_slots = Gauge(
            "deferral_pool_queued_slots",
            "Slots asked for by the pool's due tasks that wait to be admitted.",
            ["pool"],
            registry=own("scheduler"),
        )
        self.pool_running_slots = Gauge(
            "deferral_pool_running_slots", "Slots of a pool held by running tries.", ["pool"],
            registry=own("scheduler"),
        )  # fmt: skip
        self.pool_deferred_slots = Gauge(
            "deferral_pool_deferred_slots",
            "Slots of a pool's deferred tasks (held only where the pool includes deferred).",
            ["pool"],
            registry=own("scheduler"),
        )
        self.dag_runs = Gauge(
            "deferral_dag_runs",
            "Runs queued or running, by DAG and state.",
            ["dag_id", "state"],
            registry=own("scheduler"),
        )
        self.dag_run_duration = Histogram(
            "deferral_dag_run_duration_seconds",
            "How long the runs the scheduler ended took, from their start, by DAG and the state "
            "they ended in (its _count: the runs ended).",
            ["dag_id", "state"],
            buckets=_RUN_BUCKETS,
            registry=own("scheduler"),
        )
        self.scheduling_delay = Histogram(
            "deferral_scheduling_delay_seconds",
            "How long after its data interval ended a scheduled run started, by DAG (observed "
            "when the run ends).",
            ["dag_id"],
            buckets=_RUN_BUCKETS,
            registry=own("scheduler"),
        )
        self.task_duration = Histogram(
            "deferral_task_duration_seconds",
            "How long the task instances of ended runs took, from their first try's start to "
            "their end (deferrals and retries included), by the state they ended in.",
            ["state"],
            buckets=_RUN_BUCKETS,
            registry=own("scheduler"),
        )

    # -- helpers the engine calls ----------------------------------------------------------

    def admit_classes(self, allow: Callable[[str], bool] | None) -> None:
        """Label by a trigger class only when ``allow`` admits it (the trigger allow-list;
        None: any class, up to the cap)."""
        self._admit_class = allow
        self._by_class.clear()  # a class refused before may be admitted now

    def class_label(self, family: Counter, trigger_class: str) -> str:
        """The label value ``trigger_class`` is counted under in ``family``: itself when the
        allow-list admits it and the family has room (or has it already), else OTHER."""
        return self.bounded_label(family, trigger_class, admit=self._admit_class)

    def bounded_label(
        self,
        family: Counter | Gauge | Histogram,
        value: str,
        *,
        admit: Callable[[str], bool] | None = None,
    ) -> str:
        """The label value ``value`` (a trigger class, a DAG id, a pool: names a user writes
        to the database) is counted under in ``family``: itself while the family labels fewer
        than ``max_series`` values (or has it already) and ``admit`` admits it, else OTHER."""
        if value in _OWN_VALUES:
            return value
        seen = self._classes.setdefault(family._name, set())
        if value in seen:
            return value
        if len(seen) >= self.max_series or not isinstance(value, str):
            return OTHER
        if admit is not None and not admit(value):
            return OTHER
        seen.add(value)
        return value

    def count_by_class(self, counter: Counter, classes: Iterable[str]) -> None:
        """Add one per item to ``counter``, by trigger class: one increment per label value."""
        tally = _Tally(self.class_label(counter, c) for c in classes)
        for label, n in tally.items():
            counter.labels(label).inc(n)

    def inc_by_class(self, counter: Counter, trigger_class: str, amount: float = 1.0) -> None:
        """Add ``amount`` to ``counter`` under ``trigger_class`` (or OTHER)."""
        key = (counter._name, trigger_class)
        child = self._by_class.get(key)
        if child is None:
            # (A class's label never changes once given: seen classes only grow, and one
            # refused stays refused. The labelled child is kept: a triggerer counts each
            # event, and labels() takes a lock and builds its key every time.)
            label = self.class_label(counter, trigger_class)
            child = counter.labels(label)
            if label != OTHER:
                # (Bounded as the family's series are: a class counted under OTHER is looked
                # up each time, so class names users write cannot grow this without end.)
                self._by_class[key] = child
        child.inc(amount)

    def watch_triggerer(self, running: Callable[[], float], capacity: int) -> None:
        self.triggers_running.set_function(running)
        self.triggers_capacity.set(capacity)

    def watch_worker(self, used: Callable[[], float], slots: int) -> None:
        self.worker_slots_used.set_function(used)
        self.worker_slots.set(slots)

    def count_db_error(self, exc: BaseException) -> None:
        self.db_errors.labels(db_error_kind(exc)).inc()

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return prometheus_client.generate_latest(self.registry)


_current: Metrics | None = None


def current() -> Metrics:
    """This process's metrics (made on first use)."""
    global _current
    if _current is None:
        _current = Metrics()
    return _current


def use(metrics: Metrics) -> Metrics:
    """Make ``metrics`` this process's (what ``current()`` returns from now on)."""
    global _current
    _current = metrics
    return metrics
