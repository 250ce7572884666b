"""The context of one call of a task: what ``execute`` receives and what templates read.

Every name of :data:`TEMPLATE_VARIABLES` is a template variable (``{{ ds }}``) and a key of the
context; docs/reference/templates.md describes each one (a test keeps the two equal). Dates
are pendulum DateTimes in UTC, as Airflow's are (``{{ logical_date.in_timezone('Europe/
Amsterdam') }}``, ``.add(days=1)``, ``.format('YYYY-MM')``). Rendering them into the fields is
engine/worker/templating.py's.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import pendulum

from engine.usercode.variables import CONNECTIONS, VARIABLES, bind_fallback
from engine.worker.macros import MACROS
from operators.assets import AssetEvent, OutletEventAccessors, TriggeringAssetEvents

if TYPE_CHECKING:
    from engine.store import ClaimedTask
    from engine.store.variables import PrevRun
    from operators.base import BaseOperator

__all__ = [
    "NO_ASSET_EVENTS",
    "PREV_SUCCESS",
    "PREV_SUCCESS_KEYS",
    "TEMPLATE_VARIABLES",
    "DagRunInfo",
    "RunValues",
    "TaskInstanceInfo",
    "build_context",
    "child_context",
    "prev_success_values",
    "restore_context",
    "run_values",
    "to_pendulum",
    "triggering_events",
]

#: The triggering events of a run not triggered by assets.
NO_ASSET_EVENTS = TriggeringAssetEvents([])


def triggering_events(rows: Sequence[Any]) -> TriggeringAssetEvents:
    """An asset-triggered run's events as its context shows them (``rows``: the store's)."""
    return TriggeringAssetEvents(
        [msgspec.convert(msgspec.structs.asdict(r), AssetEvent) for r in rows]
    )


#: The variable that costs a store query: looked up only when a template or callable asks.
PREV_SUCCESS = "prev_data_interval_start_success"
#: Every variable read from the previous successful run (one query gives them all).
PREV_SUCCESS_KEYS = (
    PREV_SUCCESS,
    "prev_data_interval_end_success",
    "prev_start_date_success",
    "prev_end_date_success",
)

#: Every template variable (and context key) the engine provides; docs/reference/templates.md
#: describes each one (a test keeps the two equal).
TEMPLATE_VARIABLES = (
    "ds",
    "ds_nodash",
    "ts",
    "ts_nodash",
    "ts_nodash_with_tz",
    "logical_date",
    "data_interval_start",
    "data_interval_end",
    *PREV_SUCCESS_KEYS,
    "run_id",
    "run_type",
    "dag_run",
    "dag",
    "params",
    "task",
    "ti",
    "task_instance",
    "task_instance_key_str",
    "inlets",
    "outlets",
    "var",
    "conn",
    "macros",
)

#: Context entries a child process (isolation="process") cannot be sent and puts back.
_LOCAL = (
    "task", "macros", "dag", "var", "conn", "task_instance", "inlets", "outlets", "outlet_events",
)  # fmt: skip


_UTC = pendulum.UTC


def to_pendulum(value: dt.datetime | None) -> Any:
    """An aware datetime as a pendulum DateTime in UTC (None stays None)."""
    if value is None:
        return None
    u = value.astimezone(dt.UTC)
    # (Built field by field: pendulum.instance() takes ~25 us, this ~3, on every try and resume.)
    return pendulum.DateTime(
        u.year, u.month, u.day, u.hour, u.minute, u.second, u.microsecond, tzinfo=_UTC
    )


class RunValues(NamedTuple):
    """What templates need of the run beyond its logical date."""

    data_interval_start: dt.datetime
    data_interval_end: dt.datetime
    params: dict[str, Any]


def run_values(ti: ClaimedTask, dag: Any) -> RunValues:
    """The data interval and params of the run ``ti`` belongs to.

    The interval is the run's (``claim_tasks`` returns it; a run without one, from before
    schedules, falls back to ``[logical_date, logical_date]``); ``params`` are the DAG's
    ``params``, a key of the run's ``conf`` overriding the param of the same name. (Airflow
    adds every key of ``conf`` to ``params``; here ``conf`` reaches only the params the DAG
    declares, and the whole of it stays in ``dag_run.conf``.)"""
    logical_date = ti.logical_date
    start = ti.data_interval_start or logical_date
    end = ti.data_interval_end or logical_date
    params = dict(getattr(dag, "params", None) or {})
    conf = ti.conf or {}
    for key in params.keys() & conf.keys():
        params[key] = conf[key]
    return RunValues(start, end, params)


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
    """``ti`` (and ``task_instance``) in templates and the context."""

    id: int
    dag_id: str
    run_id: str
    task_id: str
    try_number: int
    #: The instance of a mapped task (0..n-1); -1: not mapped.
    map_index: int = -1


def build_context(
    ti: ClaimedTask,
    op: BaseOperator,
    dag: Any,
    *,
    default_deferrable: bool,
    task_instance: Any = None,
) -> dict[str, Any]:
    """The context of one call of a task: the engine's own keys and every template variable
    but those of :data:`PREV_SUCCESS_KEYS`, which the caller adds when asked for
    (:func:`prev_success_values`). ``task_instance``: its ``ti`` and ``task_instance``
    (a :class:`TaskInstanceInfo` of ``ti`` when None)."""
    values = run_values(ti, dag)
    logical_date, ds, ds_nodash, ts, ts_nodash, ts_nodash_with_tz, start, end = _dates(
        ti.logical_date, values.data_interval_start, values.data_interval_end
    )
    if task_instance is None:
        task_instance = TaskInstanceInfo(
            id=ti.id, dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id,
            try_number=ti.try_number, map_index=ti.map_index,
        )  # fmt: skip
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
        "ts": ts,
        "ts_nodash": ts_nodash,
        "ts_nodash_with_tz": ts_nodash_with_tz,
        "data_interval_start": start,
        "data_interval_end": end,
        "run_type": ti.run_type,
        "dag_run": DagRunInfo(
            dag_id=ti.dag_id,
            run_id=ti.run_id,
            logical_date=logical_date,
            data_interval_start=start,
            data_interval_end=end,
            conf=ti.conf,
            run_type=ti.run_type,
        ),
        "dag": dag,
        "params": values.params,
        "task": op,
        "ti": task_instance,
        "task_instance": task_instance,
        "task_instance_key_str": f"{ti.dag_id}__{ti.task_id}__{ds_nodash}",
        "inlets": list(getattr(op, "inlets", None) or []),
        "outlets": list(getattr(op, "outlets", None) or []),
        "outlet_events": OutletEventAccessors(ti.task_id, list(getattr(op, "outlets", None) or [])),
        # (an asset-triggered run's: read by render_task, engine/worker/templating.py)
        "triggering_asset_events": NO_ASSET_EVENTS,
        "var": VARIABLES,
        "conn": CONNECTIONS,
        "macros": MACROS,
    }


@functools.lru_cache(maxsize=256)
def _dates(
    logical_date: dt.datetime, start: dt.datetime, end: dt.datetime
) -> tuple[Any, str, str, str, str, str, Any, Any]:
    """The run's dates as the context shows them: pendulum DateTimes (immutable, so shared)
    and the ``ds``/``ts`` strings. Cached: the tries of one run share them, and building them
    took most of a context's cost (~20 us of ~26, on every try and every resume)."""
    date = to_pendulum(logical_date)
    ds = date.strftime("%Y-%m-%d")
    ts = date.isoformat()
    return (
        date,
        ds,
        ds.replace("-", ""),
        ts,
        date.strftime("%Y%m%dT%H%M%S"),
        ts.replace("-", "").replace(":", ""),
        to_pendulum(start),
        to_pendulum(end),
    )


def prev_success_values(row: PrevRun | None) -> dict[str, Any]:
    """The :data:`PREV_SUCCESS_KEYS` entries from the previous successful run (all None
    when there is none)."""
    if row is None:
        return dict.fromkeys(PREV_SUCCESS_KEYS)
    return {
        "prev_data_interval_start_success": to_pendulum(row.data_interval_start),
        "prev_data_interval_end_success": to_pendulum(row.data_interval_end),
        "prev_start_date_success": to_pendulum(row.start_date),
        "prev_end_date_success": to_pendulum(row.end_date),
    }


def _plain(value: Any) -> Any:
    """A pendulum DateTime as a plain datetime (what MessagePack carries)."""
    if isinstance(value, dt.datetime) and type(value) is not dt.datetime:
        return dt.datetime.fromtimestamp(value.timestamp(), tz=dt.UTC)
    return value


def child_context(context: Mapping[str, Any]) -> dict[str, Any]:
    """The context as plain data, for a child process (isolation="process"): without the
    objects the child puts back (:func:`restore_context`)."""
    plain: dict[str, Any] = {}
    for key, value in context.items():
        if key in _LOCAL:
            continue
        if isinstance(value, TriggeringAssetEvents):
            value = [msgspec.structs.asdict(e) for events in value.values() for e in events]
        elif isinstance(value, DagRunInfo):
            value = {
                f: _plain(v) for f, v in msgspec.structs.asdict(value).items()
            }  # fmt: skip
        plain[key] = _plain(value)
    return plain


def restore_context(plain: Mapping[str, Any], op: BaseOperator) -> dict[str, Any]:
    """The context a child process gives its task, from :func:`child_context`'s data. The
    child reads Variables and stored Connections through a connection of its own."""
    context = {
        key: to_pendulum(value) if isinstance(value, dt.datetime) and key not in (
            "first_try_at", "claimed_at") else value
        for key, value in plain.items()
    }  # fmt: skip
    if isinstance(context.get("dag_run"), Mapping):
        run = dict(context["dag_run"])
        for name in ("logical_date", "data_interval_start", "data_interval_end"):
            run[name] = to_pendulum(run[name])
        context["dag_run"] = DagRunInfo(**run)
    if isinstance(context.get("ti"), Mapping):
        context["ti"] = msgspec.convert(context["ti"], TaskInstanceInfo)
    dag = getattr(op, "dag", None)
    context["task"] = op
    context["task_instance"] = context.get("ti")
    context["dag"] = dag
    context["inlets"] = list(getattr(op, "inlets", None) or [])
    context["outlets"] = list(getattr(op, "outlets", None) or [])
    context["outlet_events"] = OutletEventAccessors(op.task_id, list(op.outlets))
    context["triggering_asset_events"] = TriggeringAssetEvents(
        [msgspec.convert(e, AssetEvent) for e in plain.get("triggering_asset_events") or []]
    )
    context["var"] = VARIABLES
    context["conn"] = CONNECTIONS
    context["macros"] = MACROS
    bind_fallback()
    return context
