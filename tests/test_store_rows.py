"""No database record leaves engine/store/: every public store call returns builtins or frozen
structs (engine/store/models.py), checked by type (the annotations) and by value (a scenario
that calls every public method of the store)."""

from __future__ import annotations

import datetime as dt
import inspect
import time
import types
import typing
from collections.abc import Callable
from typing import Any

import asyncpg
import msgspec
import pytest

from engine import DAG
from engine.states import STATES
from engine.store import (
    CHANNEL_TASKS,
    Deferral,
    Listener,
    Store,
    TaskOutcome,
    TriggerOutcome,
    downstream,
)
from engine.store.models import (
    AssetRecord,
    NewAssetEvent,
    NewRun,
    NextRun,
    RunFilter,
    TaskLogRow,
    TriggerLogRow,
    WatcherFault,
    WatcherItem,
)
from engine.store.session import TriggererSession
from operators.python import PythonOperator
from tests.triggers_for_tests import NeverTrigger
from triggers.base import encode_value, validate_trigger
from triggers.connections import Connection

pytestmark = pytest.mark.anyio

#: Values a store call may hand out besides structs and containers of them.
_LEAVES = (int, float, str, bytes, bool, type(None), dt.datetime, Store, Listener, TriggererSession)
#: Not called in the scenario: they make or end the store itself.
_LIFECYCLE = {"connect", "close"}


def _public_coroutines(cls: type) -> dict[str, Callable[..., Any]]:
    return {
        name: fn
        for name, fn in inspect.getmembers(cls)
        if not name.startswith("_") and inspect.iscoroutinefunction(fn)
    }


def _type_problems(tp: Any, where: str, *, json_value: bool = False) -> list[str]:
    """What in a declared type could carry a database record: asyncpg.Record itself, or Any
    (except as a JSON value inside a struct's dict or list)."""
    if tp is Any:
        return [] if json_value else [f"{where}: Any"]
    if isinstance(tp, type) and issubclass(tp, asyncpg.Record):
        return [f"{where}: asyncpg.Record"]
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp)
        return [
            p
            for name in tp.__struct_fields__
            for p in _type_problems(hints[name], f"{where}.{name}", json_value=True)
        ]
    if isinstance(tp, type) and issubclass(tp, _LEAVES):
        return []
    origin = typing.get_origin(tp)
    if origin is typing.Literal:  # (an outcome's kind)
        return []
    if origin in (list, set, frozenset, tuple, dict, typing.Union, types.UnionType):
        return [
            p
            for i, arg in enumerate(typing.get_args(tp))
            if arg is not Ellipsis
            for p in _type_problems(arg, f"{where}[{i}]", json_value=json_value)
        ]
    return [f"{where}: {tp!r} is neither a struct nor a builtin"]


def test_no_public_store_call_is_declared_to_return_a_record() -> None:
    problems = []
    for cls in (Store, TriggererSession):
        for name, fn in _public_coroutines(cls).items():
            hints = typing.get_type_hints(fn)
            problems += _type_problems(hints["return"], f"{cls.__name__}.{name}")
    for fn in (downstream.settle, downstream.resolve_all_pending):
        names = {**vars(downstream), "Store": Store}  # (imported there for type checking only)
        problems += _type_problems(typing.get_type_hints(fn, names)["return"], fn.__name__)
    assert problems == []


def _records_in(value: object) -> list[object]:
    if isinstance(value, asyncpg.Record):
        return [value]
    if isinstance(value, dict):
        return [r for item in value.items() for r in _records_in(item)]
    if isinstance(value, list | tuple | set | frozenset):
        return [r for item in value for r in _records_in(item)]
    if isinstance(value, msgspec.Struct):
        return [r for f in value.__struct_fields__ for r in _records_in(getattr(value, f))]
    assert isinstance(value, _LEAVES), f"unexpected {type(value).__name__} from the store"
    return []


class _Checked:
    """The store, with every public call's return value checked for records."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.called: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name.startswith("_") or not inspect.iscoroutinefunction(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            value = await attr(*args, **kwargs)
            self.called.add(name)
            assert _records_in(value) == [], f"Store.{name} returned a database record"
            return value

        return call


def _deferral(timeout_s: float | None) -> Deferral:
    trigger = validate_trigger(NeverTrigger("rows"))
    return Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name="resume",
        method_kwargs=encode_value({}),
        timeout_s=timeout_s,
    )


def _noop() -> None:
    pass


async def test_every_public_store_call_returns_structs_not_records(store: Store) -> None:
    s: Any = _Checked(store)
    await s.migrate()
    # (on every connection of the pool: it opens them all)
    assert await s.prime_worker_connections() == store._pool.get_max_size()
    assert await s.prime_triggerer_connections() == store._pool.get_max_size()
    now = await s.now()
    await s.notify(CHANNEL_TASKS, "")
    with DAG(dag_id="rows") as dag:
        a = PythonOperator(task_id="a", python_callable=_noop)
        a >> PythonOperator(task_id="b", python_callable=_noop)
        PythonOperator(task_id="c", python_callable=_noop)
        PythonOperator(task_id="d", python_callable=_noop)
    await s.upsert_dag(dag.dag_id, "rows.py", dag.serialize_tasks(), None)
    assert [d.dag_id for d in await s.list_dags()] == ["rows"]
    assert (await s.get_dag("rows")).tasks
    run_pk = await s.create_dag_run("rows", "r1", logical_date=now)
    assert (await s.get_dag_run("rows", "r1")).id == run_pk

    worker = await s.register_worker("test", 1, 10)
    assert (await s.heartbeat_worker(worker, [])).alive
    claimed = (await s.claim_tasks(worker, 10)).claimed
    by_name = {ti.task_id: ti for ti in claimed}
    assert set(by_name) == {"a", "c", "d"}
    assert len((await s.unacknowledged_claims(worker, [by_name["a"].id])).claimed) == 2
    assert (await s.handed_tasks(worker, 10)).claimed == []  # (nothing fired: nothing handed)
    await s.stop_taking_resumes(worker)
    assert await s.set_rendered_fields(by_name["a"].id, worker, 1, {"cmd": "echo 2026"})
    assert await s.prev_success_interval_start("rows", now) is None
    later = now + dt.timedelta(hours=1)
    assert await s.reschedule_task(by_name["d"].id, worker, later, try_number=1)
    assert await s.defer_task(by_name["c"].id, worker, _deferral(None))
    assert await s.push_xcom(by_name["a"].id, worker, 1, [("k", encode_value(7))])
    done = TaskOutcome(
        ti_id=by_name["a"].id,
        worker_id=worker,
        try_number=1,
        kind="success",
        skip=("not_a_task",),
    )
    finished = await s.finish_tasks([done])
    assert [f.state for f in finished] == ["success"]
    # (a try no longer held expands nothing; an unmapped task has map index -1)
    assert await s.expand_task(by_name["a"].id, worker, 1, 2) == 0
    assert await s.task_map_indexes("rows", "r1", "a") == [-1]
    await downstream.settle(s, finished)  # resolve_pending, wake_workers
    await s.notify_finished_runs([run_pk])
    assert await s.runs_with_pending() == []
    assert (await s.count_task_states(run_pk))["scheduled"] == 1
    assert (await s.work_left()).runnable == 1
    listed = await s.list_task_instances(dag_id="rows")
    assert len(listed) == 4
    assert [x.task_id for x in await s.pull_xcom("rows", "r1", ["a"], "k")] == ["a"]
    assert set((await s.xcom_of_tasks([by_name["a"].id]))[by_name["a"].id]) == {"k"}
    assert set(await s.xcom_of_task("rows", "r1", "a") or {}) == {"k"}
    counts = {"rewritten": 0, "current": 0, "changed": 0, "unreadable": 0}
    await s.rotate_xcom_keys(counts)
    assert counts["current"] == 1
    # (no task of this DAG declares a callback: no request was written)
    assert await s.list_callback_requests() == []
    assert await s.claim_callbacks(worker, ["default"], 5, lease_s=30.0) == []
    assert not await s.finish_callback(0, worker)
    waits = await s.why_tasks([ti.id for ti in listed], worker_stale_s=60.0)
    assert {w.task_id: w.state for w in waits} == {ti.task_id: ti.state for ti in listed}
    found = await s.why_task("rows", "r1", "c", worker_stale_s=60.0)
    assert (found.run.state, found.task.state) == ("running", "deferred")
    assert await s.why_task("rows", "nope", "c", worker_stale_s=60.0) is None
    assert [r.run_id for r in await s.list_dag_runs(dag_id="rows")] == ["r1"]
    assert await s.dags_of_run_id("r1") == ["rows"]
    assert await s.set_pool("rows_pool", 2, include_deferred=True)
    await s.ensure_pool("rows_pool", 9)
    assert [(p.name, p.slots) for p in await s.list_pools("rows_pool")] == [("rows_pool", 2)]
    await s.delete_pool("rows_pool")
    assert await s.list_pools("rows_pool") == []
    await s.insert_task_logs(
        [TaskLogRow("rows", "r1", "a", 1, time.time(), "INFO", "log", "x", "hello")]
    )
    assert [line.message for line in (await s.task_logs("rows", "r1", "a", 1)).lines] == ["hello"]
    assert (await s.task_log_bytes([("rows", "r1", "a", 1)]))[0] > 0

    triggerer = await s.register_triggerer("test", 1, 10, 60.0)
    assert await s.renew_triggerer_lease(triggerer, 60.0) == 0
    (trigger,) = (await s.claim_triggers(triggerer, 10)).claimed
    assert await s.owned_triggers(triggerer) == {trigger.id: trigger.fence}
    assert await s.count_owned_triggers(triggerer) == 1
    assert await s.count_unowned_triggers() == 0
    assert [w.waiting for w in await s.trigger_waiters([trigger.id])] == [1]
    assert [t.waiting for t in await s.list_triggers()] == [1]
    assert (await s.get_trigger(trigger.id)).tasks[0].task_id == "c"
    assert [t.held for t in await s.list_triggerers()] == [1]
    await s.insert_trigger_logs([TriggerLogRow(trigger.id, time.time(), "INFO", "t", "hi")])
    assert [line.message for line in (await s.trigger_logs(trigger.id)).lines] == ["hi"]
    assert (await s.trigger_log_bytes([trigger.id]))[0] > 0
    assert await s.delete_old_logs(3600.0) == 0
    event = TriggerOutcome(trigger_id=trigger.id, fence=trigger.fence, kind="event")
    fired = await s.fire_triggers(triggerer, [event])
    assert (fired.accepted, [m.state for m in fired.moved]) == ({trigger.id}, ["scheduled"])

    (b,) = [ti for ti in (await s.claim_tasks(worker, 10)).claimed if ti.task_id == "b"]
    assert await s.defer_tasks(worker, [(b.id, _deferral(0.0))]) == {b.id}
    (late,) = (await s.claim_triggers(triggerer, 10)).claimed
    (timed_out,) = await s.timeout_deferrals([late.id])
    assert (timed_out.id, timed_out.trigger_id) == (b.id, late.id)
    assert await s.delete_owned_triggers(triggerer, [late.id]) == {late.id}
    assert await s.release_triggers(triggerer, []) == set()
    assert await s.release_triggerer(triggerer) == 0
    assert await s.reap_triggerers() == 0
    assert await s.release_ownerless_triggers() == 0
    assert await s.delete_orphan_triggers(0.0) == 0

    zombies = await s.reap_zombie_tasks(0.0)
    assert zombies
    assert {z.state for z in zombies} <= {"up_for_retry", "failed"}
    assert await s.finish_dag_runs([run_pk]) == []
    assert (await s.rotate_keys())["unreadable"] == 0

    # The status page (engine/store/status.py).
    scheduler = await s.register_scheduler()
    assert await s.heartbeat_scheduler(scheduler) == scheduler
    fleet = await s.fleet()
    assert fleet.workers == []  # reaped above
    assert [x.id for x in fleet.schedulers] == [scheduler]
    await s.unregister_scheduler(scheduler)
    assert [d.dag_id for d in await s.dags_overview()] == ["rows"]
    (summary,) = await s.runs_page("rows", RunFilter(), limit=25)
    assert len(await s.run_task_grid(summary.id)) == 4
    assert sum((await s.run_task_counts(summary.id)).values()) == 4
    a_try = await s.task_try("rows", "r1", "a")
    assert a_try is not None
    assert a_try.state == "success"
    assert isinstance(await s.triggers_page(classpath="Never"), list)
    assert isinstance(await s.trigger_groups(), list)
    assert isinstance(await s.triggerer_health(), list)
    # The views' reads (engine/store/browse.py).
    assert await s.count_runs("rows", RunFilter()) == 1
    assert await s.count_runs(None, RunFilter()) == 1
    assert len(await s.grid_cells([summary.id])) == 4
    assert [t.try_number for t in await s.task_tries("rows", "r1", "a")] == [1]
    assert len(await s.run_tries(summary.id, "rows", "r1", limit=10)) == 4
    states = sorted(STATES)
    assert await s.count_pool_tasks("default_pool", states, due_only=False) == 4
    assert len(await s.pool_tasks("default_pool", states, due_only=False, limit=10)) == 4
    assert isinstance(await s.oldest_waits(), list)
    assert (await s.clear_task(a_try.id, who="t")).state == "scheduled"
    assert (await s.mark_task(a_try.id, "failed", who="t")).state == "failed"
    assert [o.state for o in await s.clear_tasks([a_try.id], who="t")] == ["scheduled"]
    assert [o.state for o in await s.mark_tasks([a_try.id], "skipped", who="t")] == ["skipped"]
    assert await s.cancel_trigger(-1, who="t") == []
    targets = await s.override_targets("rows", "r1", ["a"], downstream=True)
    assert targets[0].task_id == "a"
    assert (await s.mark_run("rows", "r1", "success", who="t")).state == "success"
    await s.record_audit("t", "look", "rows")
    assert (await s.list_audit(1))[0].action == "look"
    await s.unregister_worker(worker)
    await _schedule_calls(s)
    await _reader_calls(s, summary.id)
    await _asset_calls(s)
    await _watcher_calls(s)

    assert set(_public_coroutines(Store)) - _LIFECYCLE - s.called == set()


async def _asset_calls(s: Any) -> None:
    """Assets, their watchers and events, and the runs they trigger (engine/store/assets.py)."""
    watcher = validate_trigger(NeverTrigger("rows"))
    asset = AssetRecord(
        name="rows_asset",
        uri="s3://rows",
        group="asset",
        extra={},
        roles=["outlet"],
        watchers=[("w", watcher.classpath, watcher.kwargs)],
    )
    await s.record_dag_assets("rows", [asset])
    assert [w.kwargs for w in await s.asset_watchers()] == [watcher.kwargs]
    assert await s.asset_exists("rows_asset")
    (event,) = await s.record_asset_events([NewAssetEvent(asset="rows_asset", source_kind="cli")])
    assert [e.id for e in await s.asset_events("rows_asset")] == [event.id]
    assert [a.last_event_id for a in await s.list_assets()] == [event.id]
    assert await s.queued_asset_events() == []  # (no DAG is scheduled on it)
    assert await s.create_asset_runs() == []
    assert await s.run_asset_events([0]) == []
    assert await s.triggering_asset_events("rows", "r1") == []
    assert await s.runs_asset_events([("rows", "r1")]) == {}
    await s.forget_dag_fingerprint("rows")


async def _watcher_calls(s: Any) -> None:
    """Asset watchers on the triggerer (engine/store/watchers.py), on _asset_calls' asset."""
    # (Its watcher runs once a DAG is scheduled on it, not while tasks only write it.)
    assert (await s.sync_watchers()).started == 0
    watcher = validate_trigger(NeverTrigger("rows"))
    asset = AssetRecord(
        name="rows_asset",
        uri="s3://rows",
        group="asset",
        extra={},
        roles=["schedule"],
        watchers=[("w", watcher.classpath, watcher.kwargs)],
    )
    await s.record_dag_assets("rows", [asset])
    assert (await s.sync_watchers()).started == 1
    triggerer = await s.register_triggerer("rows-host", 2, 10, 30.0)
    claimed = (await s.claim_triggers(triggerer, 100)).claimed
    (watcher,) = await s.claimed_watchers(triggerer, [t.id for t in claimed])
    item = WatcherItem(trigger_id=watcher.trigger_id, fence=1, extra={"a": 1}, seq=1)
    assert await s.record_watcher_events(triggerer, [item]) == {watcher.trigger_id}
    fault = WatcherFault(trigger_id=watcher.trigger_id, fence=1, error="e", retry_in_s=1.0)
    assert await s.watcher_failed(triggerer, fault)
    assert [(w.name, w.restarts) for w in await s.watcher_states()] == [("w", 1)]
    await s.release_triggerer(triggerer)


async def _reader_calls(s: Any, run_pk: int) -> None:
    """Variables and connections, run selectors, endpoints, import errors, fleet numbers."""
    assert await s.set_variable("rows_key", "v1")
    assert (await s.get_variable("rows_key")).value == "v1"
    assert [v.key for v in await s.list_variables()] == ["rows_key"]
    assert await s.add_connection(Connection(conn_id="rows_conn", host="h", password="p"))
    assert (await s.get_connection("rows_conn")).password == "p"
    assert [c.conn_id for c in await s.list_connections()] == ["rows_conn"]
    assert isinstance(await s.rotate_secret_values(), dict)
    assert await s.delete_variable("rows_key")
    assert await s.delete_connection("rows_conn")
    day = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    prev = await s.prev_success_run("rows", day)
    assert prev is None or prev.data_interval_end <= day
    (named,) = await s.runs_named("rows", "r1")
    assert named.run_id == "r1"
    assert (await s.latest_run("rows")).run_id == "r1"
    assert isinstance(await s.runs_dated("rows", day - dt.timedelta(days=36500), day, 5), list)
    assert [r.run_id for r in await s.runs_prefixed("rows", "r", 5)] == ["r1"]
    assert [r.run_id for r in await s.recent_runs("rows", 5)] == ["r1"]
    endpoint = await s.register_endpoint("metrics", "worker", "http://127.0.0.1:1/")
    assert await s.heartbeat_endpoint(endpoint)
    assert [e.url for e in await s.endpoints()] == ["http://127.0.0.1:1/"]
    await s.unregister_endpoint(endpoint)
    assert isinstance(await s.record_import_errors("/rows", {"/rows/bad.py": "boom"}), tuple)
    assert [e.error for e in await s.import_errors()] == ["boom"]
    assert isinstance((await s.backlog_split()).waiting_for_worker, int)
    assert isinstance(await s.active_runs_by_dag(), dict)
    assert isinstance(await s.ended_run_facts([run_pk]), list)


async def _schedule_calls(s: Any) -> None:
    """The statements of schedules and run admission (engine/store/schedules.py)."""
    day = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    with DAG(dag_id="rows_sched", schedule="@daily", start_date=day, max_active_runs=1) as dag:
        PythonOperator(task_id="a", python_callable=_noop)
    tasks, schedule = dag.serialize_tasks(), dag.serialize_schedule()
    assert await s.upsert_dag(dag.dag_id, "rows.py", tasks, None, schedule)
    assert not await s.upsert_dag(dag.dag_id, "rows.py", tasks, None, schedule)
    assert await s.dags_to_record({dag.dag_id: "h1"}) == {dag.dag_id}  # none recorded
    await s.upsert_dag(dag.dag_id, "rows.py", tasks, None, schedule, fingerprint="h1")
    assert await s.dags_to_record({dag.dag_id: "h1", "unknown": "h2"}) == {"unknown"}
    assert await s.deactivate_missing_dags("/elsewhere", [], []) == []
    assert await s.last_scheduled_interval(dag.dag_id) is None
    following = day + dt.timedelta(days=1)
    await s.set_next_dagruns(
        [NextRun(dag_id=dag.dag_id, logical_date=day, interval_end=following,
                 create_after=following)]
    )  # fmt: skip
    assert await s.next_due_in() < 0
    runs = [
        NewRun(dag_id=dag.dag_id, run_id=f"scheduled__{d}", logical_date=d,
               data_interval_start=d, data_interval_end=d + dt.timedelta(days=1),
               run_type="scheduled")
        for d in (day, following)
    ]  # fmt: skip
    assert len(await s.insert_runs(runs)) == 2
    assert await s.insert_runs(runs) == []  # one run per interval
    started = await s.start_queued_runs([dag.dag_id])
    assert [r.run_id for r in started] == [runs[0].run_id]
    assert await s.start_queued_runs() == []  # max_active_runs=1
    manual = msgspec.structs.replace(runs[0], run_id="m1", run_type="manual")
    assert (await s.create_queued_run(manual))[1] == "queued"
    assert [r.state for r in await s.runs_at(dag.dag_id, [day])] == ["running", "queued"]
    assert await s.last_scheduled_interval(dag.dag_id) == (
        following,
        following + dt.timedelta(days=1),
    )
    assert await s.reset_dag_runs([r.id for r in await s.runs_at(dag.dag_id, [day])]) == []
    assert await s.set_dag_paused(dag.dag_id, True)
    assert len(await s.list_runs(dag_id=dag.dag_id, state="queued")) == 2
    assert await s.count_dags() == 2
    assert await s.schedule_delays(day, day + dt.timedelta(days=3)) != []
