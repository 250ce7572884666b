"""The DAG: a named set of tasks and the edges between them."""

from __future__ import annotations

import datetime as dt
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import Token
from typing import Any

import msgspec

from engine.dags.deadline import DeadlineAlert
from engine.dags.defaults import authoring
from engine.dags.timetables import (
    ContinuousTimetable,
    ScheduleError,
    Timetable,
    asset_schedule,
    dag_timezone,
    dump_with_timezone,
    make_timetable,
    to_aware,
)
from operators.assets import Asset
from operators.base import INT32_MAX, BaseOperator, DagLike, dag_context
from operators.callbacks import (
    DAG_CALLBACK_KINDS,
    TASK_CALLBACK_KINDS,
    Callbacks,
    check_callbacks,
    declared_kinds,
)

__all__ = ["DAG", "DagCycleError", "dags_of_module", "forget_module"]

_DAG_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,249}$")

# The DAGs each module created, so `with DAG(...):` needs no variable to be found.
_by_module: dict[str, list[DAG]] = {}


def dags_of_module(module_name: str) -> list[DAG]:
    """The DAGs created by code of that module (its import, usually)."""
    return list(_by_module.get(module_name, ()))


def _weight_summer(weights: list[int]) -> Callable[[int], int]:
    """A function that sums ``weights[i]`` over the bits ``i`` set in a bit set: the weights
    less their minimum, one bit plane at a time (a popcount each), plus the minimum per task.
    With every weight equal (the default) that is one popcount."""
    if not weights:
        return lambda _found: 0
    low = min(weights)
    planes: list[tuple[int, int]] = []
    for bit in range((max(weights) - low).bit_length()):
        plane = 0
        for i, weight in enumerate(weights):
            if (weight - low) >> bit & 1:
                plane |= 1 << i
        planes.append((1 << bit, plane))

    def total(found: int) -> int:
        return low * found.bit_count() + sum(
            value * (found & plane).bit_count() for value, plane in planes
        )

    return total


def forget_module(module_name: str) -> None:
    """Drop what a module created (before it is reloaded)."""
    _by_module.pop(module_name, None)


#: A folder, or several.
_Paths = str | os.PathLike[str] | Iterable[str | os.PathLike[str]]


class DagCycleError(ValueError):
    """The task graph has a cycle."""


#: Runs of one DAG (scheduled and manual) that may run at once; more wait as ``queued``.
DEFAULT_MAX_ACTIVE_RUNS = 16


class DAG:
    """``with DAG(dag_id="orders", schedule="0 3 * * *", start_date=...): a >> b`` declares
    tasks, their order and when runs are created.

    ``schedule``: None (manual runs only: ``deferral dags trigger``), a cron expression, a
    preset (``@once``, ``@continuous``, ``@hourly``, ``@daily``, ``@weekly``, ``@monthly``,
    ``@quarterly``, ``@yearly``), a ``datetime.timedelta``, a
    ``dateutil.relativedelta.relativedelta`` or a timetable (``CronTriggerTimetable``,
    ``EventsTimetable``, one of your own); see :mod:`engine.dags.timetables`. The DAG's time
    zone is ``start_date``'s; naive dates (``start_date``, ``end_date``) are read in the
    ``default_timezone`` setting's zone (UTC unless set), as Airflow reads them.
    ``default_args`` apply to every task of the DAG unless the task passes the argument
    itself; ``params`` are defaults that a run's ``conf`` overrides, handed to tasks as
    ``context["params"]``.

    Templates: ``user_defined_macros`` (names every template of the DAG can use),
    ``user_defined_filters``, ``render_template_as_native_obj`` (a field that is one
    expression renders to its Python value, not text), ``template_undefined`` (the Jinja
    ``Undefined`` class; strict by default) and ``jinja_environment_kwargs`` (more arguments
    of the Jinja environment) are Airflow's; see docs/reference/templates.md.

    Template files (a templated field ending in an operator's ``template_ext``) are looked up
    in the DAG file's folder, then in the folders of ``template_searchpath``.
    """

    def __init__(
        self,
        dag_id: str,
        *,
        schedule: object = None,
        start_date: dt.datetime | None = None,
        end_date: dt.datetime | None = None,
        catchup: bool = False,
        max_active_runs: int | None = None,
        max_active_tasks: int | None = None,
        is_paused_upon_creation: bool = False,
        default_args: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        tags: Iterable[str] = (),
        description: str | None = None,
        fileloc: str | None = None,
        template_searchpath: _Paths | None = None,
        user_defined_macros: Mapping[str, Any] | None = None,
        user_defined_filters: Mapping[str, Callable[..., Any]] | None = None,
        render_template_as_native_obj: bool = False,
        template_undefined: type | None = None,
        jinja_environment_kwargs: Mapping[str, Any] | None = None,
        on_success_callback: Callbacks = None,
        on_failure_callback: Callbacks = None,
        deadline: DeadlineAlert | Sequence[DeadlineAlert] | None = None,
    ) -> None:
        if not isinstance(dag_id, str) or not _DAG_ID.match(dag_id):
            raise ValueError(
                f"dag_id {dag_id!r} must be 1-250 characters of letters, digits, '_', '-', '.'"
            )
        self.dag_id = dag_id
        self.description = description
        for name, value in (("start_date", start_date), ("end_date", end_date)):
            if value is not None and not isinstance(value, dt.datetime):
                raise TypeError(f"DAG {dag_id}: {name} must be a datetime, got {value!r}")
        settings = authoring()
        #: The DAG's time zone: start_date's; naive dates are in the default_timezone setting's
        #: (UTC unless set). Cron is evaluated in it.
        self.timezone = dag_timezone(start_date, settings.default_timezone)
        naive_tz = settings.default_timezone
        self.start_date = None if start_date is None else to_aware(start_date, naive_tz)
        self.end_date = None if end_date is None else to_aware(end_date, naive_tz)
        try:
            self.timetable: Timetable = make_timetable(
                schedule, self.timezone, cron_data_intervals=settings.create_cron_data_intervals
            )
        except ScheduleError as exc:
            raise ScheduleError(f"DAG {dag_id}: schedule: {exc}") from None
        if self.timetable.periodic and self.start_date is None:
            raise ValueError(f"DAG {dag_id}: schedule {schedule!r} needs a start_date")
        self.schedule = schedule
        #: The assets whose events trigger the DAG's runs (None: not scheduled on assets).
        self.asset_condition = asset_schedule(schedule)
        # (A continuous DAG's next run is always the one after the last: nothing to catch up.)
        continuous = isinstance(self.timetable, ContinuousTimetable)
        self.catchup = bool(catchup) and not continuous
        limit = self.timetable.active_runs_limit
        if limit is not None and max_active_runs not in (None, limit):
            raise ValueError(
                f"DAG {dag_id}: schedule {self.timetable.summary} runs at most {limit} run(s) "
                f"at once; max_active_runs={max_active_runs!r} cannot be used with it"
            )
        if max_active_runs is None:
            max_active_runs = limit if limit is not None else DEFAULT_MAX_ACTIVE_RUNS
        if (
            not isinstance(max_active_runs, int)
            or isinstance(max_active_runs, bool)
            or not 1 <= max_active_runs <= INT32_MAX
        ):
            raise ValueError(
                f"DAG {dag_id}: max_active_runs must be an int in [1, {INT32_MAX}], got "
                f"{max_active_runs!r}"
            )
        self.max_active_runs = max_active_runs
        if max_active_tasks is not None and (
            not isinstance(max_active_tasks, int)
            or isinstance(max_active_tasks, bool)
            or not 1 <= max_active_tasks <= INT32_MAX
        ):
            raise ValueError(
                f"DAG {dag_id}: max_active_tasks must be an int in [1, {INT32_MAX}] or None, got "
                f"{max_active_tasks!r}"
            )
        #: Running tasks of this DAG (all its runs) at once; None: no limit of its own.
        self.max_active_tasks = max_active_tasks
        self.is_paused_upon_creation = bool(is_paused_upon_creation)
        self.default_args: dict[str, Any] = dict(default_args or {})
        self.params: dict[str, Any] = dict(params or {})
        try:
            msgspec.json.encode(self.params)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"DAG {dag_id}: params must be JSON data: {exc}") from None
        self.tags = sorted({str(tag) for tag in tags})
        if isinstance(template_searchpath, str | os.PathLike):
            template_searchpath = [template_searchpath]
        #: Folders searched for template files after the DAG file's own folder.
        self.template_searchpath: list[str] = [os.fspath(p) for p in template_searchpath or ()]
        self.user_defined_macros: dict[str, Any] = dict(user_defined_macros or {})
        self.user_defined_filters: dict[str, Callable[..., Any]] = dict(user_defined_filters or {})
        self.render_template_as_native_obj = bool(render_template_as_native_obj)
        #: The Jinja ``Undefined`` class (None: strict, an undefined name is an error).
        self.template_undefined = template_undefined
        self.jinja_environment_kwargs: dict[str, Any] = dict(jinja_environment_kwargs or {})
        #: Called when a run ends (operators/callbacks.py): a callable taking the context (its
        #: ``reason``: ``success`` or ``task_failure``), or a list of them.
        self.on_success_callback = on_success_callback
        self.on_failure_callback = on_failure_callback
        for kind in DAG_CALLBACK_KINDS:
            check_callbacks(
                f"DAG {dag_id}", f"on_{kind}_callback", getattr(self, f"on_{kind}_callback")
            )
        alerts = (
            []
            if deadline is None
            else [deadline]
            if isinstance(deadline, DeadlineAlert)
            else list(deadline)
        )
        for alert in alerts:
            if not isinstance(alert, DeadlineAlert):
                raise TypeError(
                    f"DAG {dag_id}: deadline must be a DeadlineAlert or a list of them, "
                    f"got {alert!r}"
                )
        #: The deadline alerts (engine/dags/deadline.py), each timed for every run.
        self.deadlines: list[DeadlineAlert] = alerts
        self.tasks: dict[str, BaseOperator] = {}
        self._tokens: list[Token[DagLike | None]] = []
        caller = sys._getframe(1).f_globals
        self.module = str(caller.get("__name__", ""))
        self.fileloc = fileloc or str(caller.get("__file__") or "")
        _by_module.setdefault(self.module, []).append(self)

    def __enter__(self) -> DAG:
        self._tokens.append(dag_context().set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        dag_context().reset(self._tokens.pop())

    def add_task(self, task: BaseOperator) -> None:
        if task.task_id in self.tasks and self.tasks[task.task_id] is not task:
            raise ValueError(f"DAG {self.dag_id} already has a task {task.task_id!r}")
        self.tasks[task.task_id] = task

    def get_task(self, task_id: str) -> BaseOperator:
        try:
            return self.tasks[task_id]
        except KeyError:
            raise KeyError(f"DAG {self.dag_id} has no task {task_id!r}") from None

    def validate(self) -> None:
        """Check every edge names a task of this DAG and that there is no cycle."""
        for task in self.tasks.values():
            for other in task.upstream_task_ids | task.downstream_task_ids:
                if other not in self.tasks:
                    raise ValueError(
                        f"DAG {self.dag_id}: task {task.task_id} is linked to {other!r}, which "
                        "is not in this DAG"
                    )
        self._topological_order()
        self.assets()

    def assets(self) -> dict[str, tuple[Asset, list[str]]]:
        """The assets the DAG uses, by name: each with how (``schedule``, ``outlet``). Two
        different declarations of one asset name (or of one uri under two names) in the DAG
        are a ValueError."""
        found: dict[str, tuple[Asset, list[str]]] = {}
        uris: dict[str, str] = {}
        uses: list[tuple[Asset, str]] = []
        if self.asset_condition is not None:
            uses += [(a, "schedule") for a in self.asset_condition.iter_assets()]
        for task in self.tasks.values():
            uses += [(a, "outlet") for a in getattr(task, "outlets", None) or []]
        for asset, role in uses:
            known = found.get(asset.name)
            if known is not None and not known[0].same_definition(asset):
                raise ValueError(
                    f"DAG {self.dag_id}: asset {asset.name!r} is declared twice, differently "
                    f"({known[0]!r} and {asset!r}): declare it once and use that value"
                )
            if uris.setdefault(asset.uri, asset.name) != asset.name:
                raise ValueError(
                    f"DAG {self.dag_id}: uri {asset.uri!r} names two assets, "
                    f"{uris[asset.uri]!r} and {asset.name!r}"
                )
            if known is None:
                found[asset.name] = (asset, [role])
            elif role not in known[1]:
                known[1].append(role)
        return found

    def serialize_assets(self) -> list[dict[str, Any]]:
        """What the store keeps of the assets the DAG uses (engine/store/assets.py)."""
        return [
            {
                "name": asset.name,
                "uri": asset.uri,
                "group": asset.group,
                "extra": asset.extra,
                "roles": sorted(roles),
                "watchers": [
                    (w.name, w.serialized.classpath, w.serialized.kwargs) for w in asset.watchers
                ],
            }
            for asset, roles in self.assets().values()
        ]

    def serialize_tasks(self) -> list[dict[str, Any]]:
        """What the store keeps of each task to create runs and resolve dependencies."""
        weights = self.priority_weights()
        return [
            {
                "task_id": t.task_id,
                "upstream": sorted(t.upstream_task_ids),
                "trigger_rule": t.trigger_rule,
                "retries": t.retries,
                "retry_delay_s": t.retry_delay_s,
                "retry_exponential_backoff": t.retry_exponential_backoff,
                "max_retry_delay_s": t.max_retry_delay_s,
                "execution_timeout_s": t.execution_timeout_s,
                "soft_fail": bool(getattr(t, "soft_fail", False)),
                "no_retry_on_timeout": bool(getattr(t, "no_retry_on_timeout", False)),
                "is_leaf": not t.downstream_task_ids,
                "priority": weights[t.task_id],
                "pool": t.pool,
                "pool_slots": t.pool_slots,
                "queue": t.queue,
                "trigger_queue": t.trigger_queue,
                "max_active_tis_per_dag": t.max_active_tis_per_dag,
                "callbacks": declared_kinds(t, TASK_CALLBACK_KINDS),
            }
            for t in self.tasks.values()
        ]

    def priority_weights(self) -> dict[str, int]:
        """Each task's priority from the ``priority_weight``s by its ``weight_rule``:
        ``downstream`` adds the weights of every task downstream of it (transitively),
        ``upstream`` of every task upstream, ``absolute`` none.

        The tasks up- or downstream of each task are a bit set (a Python int, one bit per
        task), built once in topological order from those of its neighbours; a sum is a few
        ``popcount``s. (Walking each task's relatives took 17 s for a chain of 5,000 tasks.)"""
        ids = list(self.tasks)
        index = {task_id: i for i, task_id in enumerate(ids)}
        order = self._topological_order()
        rules = {task.weight_rule for task in self.tasks.values()}
        reach: dict[str, dict[str, int]] = {}
        for edges, ordered in (
            ("downstream_task_ids", order[::-1]),
            ("upstream_task_ids", order),
        ):
            if edges.removesuffix("_task_ids") not in rules:
                continue
            sets: dict[str, int] = {}
            for task_id in ordered:
                found = 0
                for other in getattr(self.tasks[task_id], edges):
                    found |= sets[other] | (1 << index[other])
                sets[task_id] = found
            reach[edges.removesuffix("_task_ids")] = sets
        add = _weight_summer([self.tasks[task_id].priority_weight for task_id in ids])
        weights: dict[str, int] = {}
        for task_id, task in self.tasks.items():
            weight = task.priority_weight
            if task.weight_rule != "absolute":
                weight += add(reach[task.weight_rule][task_id])
            # (Summed weights may leave the database's 32-bit integer: clamped, as Airflow does.)
            weights[task_id] = max(-INT32_MAX - 1, min(weight, INT32_MAX))
        return weights

    def _topological_order(self) -> list[str]:
        """Task ids, each after all its upstreams (Kahn); raises DagCycleError on a cycle."""
        indegree = {task_id: len(t.upstream_task_ids) for task_id, t in self.tasks.items()}
        ready = [task_id for task_id, n in indegree.items() if n == 0]
        order: list[str] = []
        while ready:
            task_id = ready.pop()
            order.append(task_id)
            for down in self.tasks[task_id].downstream_task_ids:
                indegree[down] -= 1
                if indegree[down] == 0:
                    ready.append(down)
        if len(order) != len(self.tasks):
            stuck = sorted(task_id for task_id, n in indegree.items() if n > 0)
            raise DagCycleError(f"DAG {self.dag_id} has a cycle through {', '.join(stuck)}")
        return order

    def serialize_schedule(self) -> dict[str, Any]:
        """What the store keeps of the DAG's schedule, to create its runs without it."""
        return {
            "timetable": dump_with_timezone(self.timetable, self.timezone),
            "schedule": None if self.schedule is None else self.timetable.summary,
            "start_date": self.start_date,
            "end_date": self.end_date,
            "catchup": self.catchup,
            "max_active_runs": self.max_active_runs,
            "max_active_tasks": self.max_active_tasks,
            "is_paused_upon_creation": self.is_paused_upon_creation,
            "params": self.params,
            "tags": self.tags,
            "alerts": self.serialize_alerts(),
        }

    def serialize_alerts(self) -> dict[str, Any] | None:
        """What the store keeps of the DAG's callbacks and deadline alerts (None: none)."""
        callbacks = declared_kinds(self, DAG_CALLBACK_KINDS)
        if not callbacks and not self.deadlines:
            return None
        return {"callbacks": callbacks, "deadlines": [a.serialize() for a in self.deadlines]}

    def __repr__(self) -> str:
        return f"<DAG {self.dag_id}: {len(self.tasks)} tasks>"
