"""Assets (issue 22): outlets record events with a task's success (and only then), DAGs
scheduled on assets get asset-triggered runs once their condition holds, queued events
collapse into one run, the run sees its triggering events; bad declarations are clear
errors."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from pathlib import Path
from typing import Any

import pytest

from engine import DAG, Asset, AssetAll, AssetAny, AssetWatcher
from engine.dags.dagbag import DagBag
from engine.dags.timetables import ScheduleError
from engine.scheduler.dagrecord import record_dags, serialize_dag
from engine.store import Store
from engine.store.models import NewAssetEvent
from engine.testing import run_engine
from operators.python import PythonOperator
from tests.helpers import wait_until, waiting_on_locks
from triggers.events import DirectoryTrigger
from triggers.temporal import TimeDeltaTrigger

pytestmark = pytest.mark.anyio

ORDERS = Asset("orders", uri="postgres://warehouse/orders")
CUSTOMERS = Asset("customers")
DAILY = Asset("daily_marker", group="markers")

#: What the consumers' tasks saw of context["triggering_asset_events"].
SEEN: list[dict[str, Any]] = []


def _consumer(dag_id: str, schedule: object) -> DAG:
    def look(**context: Any) -> None:
        events = context["triggering_asset_events"]
        SEEN.append({a.name: [e.extra for e in evs] for a, evs in events.items()})

    with DAG(dag_id, schedule=schedule) as dag:
        PythonOperator(task_id="look", python_callable=look)
    return dag


def _emit(*names: str, extra: dict[str, Any] | None = None) -> list[NewAssetEvent]:
    return [NewAssetEvent(asset=n, extra=extra or {}, source_kind="cli") for n in names]


async def _runs(store: Store, dag_id: str) -> list[Any]:
    return [r for r in await store.list_runs(dag_id=dag_id) if r.run_type == "asset_triggered"]


async def test_all_any_conditions_and_collapse_at_the_store(store: Store) -> None:
    both = _consumer("both", [ORDERS, CUSTOMERS])
    either = _consumer("either", ORDERS | CUSTOMERS)
    nested = _consumer("nested", (ORDERS & CUSTOMERS) | DAILY)
    await record_dags(store, [both, either, nested])

    await store.record_asset_events(_emit("orders", "orders"))
    made = {r.dag_id: r.events for r in await store.create_asset_runs()}
    # either: one run for both queued events; both and nested wait for customers / daily
    assert made == {"either": 2}
    assert await store.create_asset_runs() == []

    await store.record_asset_events(_emit("customers"))
    made = {r.dag_id: r.events for r in await store.create_asset_runs()}
    # both and nested consume both orders events and the customers event in ONE run each
    assert made == {"both": 3, "nested": 3, "either": 1}

    await store.record_asset_events(_emit("daily_marker"))
    made = {r.dag_id: r.events for r in await store.create_asset_runs()}
    assert made == {"nested": 1}
    assert len(await _runs(store, "both")) == 1
    assert len(await _runs(store, "nested")) == 2
    assert await store.queued_asset_events() == []


async def test_a_run_waiting_for_a_free_slot_collapses_every_event_meanwhile(
    store: Store,
) -> None:
    with DAG("one_at_a_time", schedule=[ORDERS], max_active_runs=1) as dag:
        PythonOperator(task_id="t", python_callable=lambda: None)
    await record_dags(store, [dag])
    await store.record_asset_events(_emit("orders"))
    assert len(await store.create_asset_runs()) == 1
    for i in range(5):
        await store.record_asset_events(_emit("orders", extra={"i": i}))
    # the first run is not over: the five events wait, and no second run is made
    assert await store.create_asset_runs() == []
    [run] = await _runs(store, "one_at_a_time")
    await store._pool.execute(
        "UPDATE deferral_dag_runs SET state = 'success' WHERE id = $1", run.id
    )
    [made] = await store.create_asset_runs()
    assert made.events == 5
    events = await store.triggering_asset_events(dag.dag_id, made.run_id)
    assert [e.extra for e in events] == [{"i": i} for i in range(5)]
    assert all(e.source_kind == "cli" for e in events)


async def test_paused_dags_and_unknown_assets_queue_nothing(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    dag = _consumer("paused_consumer", [ORDERS])
    await record_dags(store, [dag])
    await store.set_dag_paused(dag.dag_id, True)
    with caplog.at_level(logging.WARNING, logger="engine.store.assets"):
        written = await store.record_asset_events(_emit("orders", "no_such_asset"))
    assert [e.asset for e in written] == ["orders"]
    assert await store.queued_asset_events() == []
    # the event dropped is not dropped silently
    [dropped] = [r.getMessage() for r in caplog.records if "no_such_asset" in r.getMessage()]
    assert "unknown asset" in dropped
    assert "cli" in dropped


async def test_outlets_trigger_an_asset_scheduled_dag_with_the_tasks_extra(store: Store) -> None:
    SEEN.clear()

    def produce(**context: Any) -> int:
        context["outlet_events"][ORDERS].extra = {"rows": 42}
        context["outlet_events"]["customers"].extra["batch"] = "b1"
        return 1

    with DAG("producer") as producer:
        PythonOperator(task_id="load", python_callable=produce, outlets=[ORDERS, CUSTOMERS])
    consumer = _consumer("consumer", ORDERS & CUSTOMERS)
    async with run_engine(store, dags=[producer, consumer]) as engine:
        await engine.add_dag(consumer)
        tis = await engine.run_dag(producer)
        assert tis["load"]["state"] == "success"

        async def consumed() -> bool:
            runs = await _runs(store, "consumer")
            return len(runs) == 1 and runs[0].state == "success"

        await wait_until(consumed, what="the asset-triggered run to succeed")
    assert SEEN == [{"orders": [{"rows": 42}], "customers": [{"batch": "b1"}]}]
    [run] = await _runs(store, "consumer")
    events = await store.triggering_asset_events("consumer", run.run_id)
    assert {(e.asset, e.source_kind, e.source_dag_id, e.source_task_id) for e in events} == {
        ("orders", "task", "producer", "load"),
        ("customers", "task", "producer", "load"),
    }
    assert run.logical_date == max(e.timestamp for e in events)


async def test_a_failed_task_records_no_event(store: Store) -> None:
    def fail(**context: Any) -> None:
        context["outlet_events"][ORDERS].extra = {"half": True}
        raise ValueError("broken")

    with DAG("fails") as dag:
        PythonOperator(task_id="load", python_callable=fail, outlets=[ORDERS])
    async with run_engine(store, dags=[dag]) as engine:
        tis = await engine.run_dag(dag)
    assert tis["load"]["state"] == "failed"
    assert await store.asset_events("orders") == []


async def test_an_extra_that_is_not_json_fails_the_task_and_records_nothing(
    store: Store,
) -> None:
    def bad(**context: Any) -> None:
        context["outlet_events"][ORDERS].extra = {"when": object()}

    def not_outlet(**context: Any) -> None:
        context["outlet_events"][CUSTOMERS].extra = {}

    with DAG("bad_extra") as dag:
        PythonOperator(task_id="bad", python_callable=bad, outlets=[ORDERS])
        PythonOperator(task_id="other", python_callable=not_outlet, outlets=[ORDERS])
    async with run_engine(store, dags=[dag]) as engine:
        await engine.run_dag(dag)
    tis = {ti.task_id: ti for ti in await store.list_task_instances(dag_id="bad_extra")}
    assert tis["bad"].state == "failed"
    assert "must be JSON data" in (tis["bad"].error or "")
    assert tis["other"].state == "failed"
    assert "is not an outlet of task other" in (tis["other"].error or "")
    assert await store.asset_events("orders") == []


def test_asset_values_and_their_errors() -> None:
    assert Asset("a").uri == "a"
    assert Asset(uri="s3://b/k").name == "s3://b/k"
    assert Asset("a", uri="x") == Asset("a", uri="x") != Asset("a", uri="y")
    cond = ORDERS & CUSTOMERS | DAILY
    assert isinstance(cond, AssetAny)
    assert isinstance(cond.objects[0], AssetAll)
    assert cond.evaluate({"daily_marker"})
    assert not cond.evaluate({"orders"})
    for bad in ("", " x", "x" * 1501, "naïve"):
        with pytest.raises(ValueError, match="Asset name"):
            Asset(bad)
    with pytest.raises(TypeError, match="needs a name or a uri"):
        Asset()
    with pytest.raises(ValueError, match="extra must be JSON data"):
        Asset("a", extra={"x": object()})
    with pytest.raises(TypeError, match=r"must be an event trigger.*not a trigger"):
        AssetWatcher("w", trigger="not a trigger")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must be an event trigger.*ends at its first event"):
        AssetWatcher("w", trigger=TimeDeltaTrigger(dt.timedelta(seconds=1)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="AssetWatcher name"):
        AssetWatcher("", trigger=DirectoryTrigger("/data"))
    watcher = AssetWatcher("w", trigger=DirectoryTrigger("/data"))
    with pytest.raises(ValueError, match="two watchers named 'w'"):
        Asset("a", watchers=[watcher, watcher])
    with pytest.raises(TypeError, match="takes assets"):
        AssetAll(ORDERS, "daily")  # type: ignore[arg-type]


def test_bad_schedules_and_declarations_are_clear_errors() -> None:
    with pytest.raises(ScheduleError, match="cannot mix"):
        DAG("mixed", schedule=[ORDERS, "@daily"])
    with pytest.raises(ScheduleError, match="at least one Asset"):
        DAG("empty", schedule=[])
    with pytest.raises(TypeError, match="outlets must hold Asset values"):
        PythonOperator(task_id="t", python_callable=print, outlets=["orders"])
    with DAG("twice", schedule=[Asset("orders", uri="a")]) as dag:
        PythonOperator(task_id="t", python_callable=print, outlets=[Asset("orders", uri="b")])
    with pytest.raises(ValueError, match="declared twice, differently"):
        dag.validate()


async def test_two_dags_declaring_one_name_with_two_uris_are_refused(store: Store) -> None:
    first = _consumer("first", [Asset("shared", uri="s3://one")])
    second = _consumer("second", [Asset("shared", uri="s3://two")])
    await record_dags(store, [first])
    await record_dags(store, [second])
    assert [a.uri for a in await store.list_assets()] == ["s3://one"]
    assert await store.get_dag("second") is not None  # recorded, its assets refused
    [asset] = await store.list_assets()
    assert asset.scheduled_dags == ["first"]


#: Tries of the flaky consumer task (it fails its first).
TRIES: list[int] = []
CALLED: list[str] = []


async def test_an_asset_triggered_run_has_callbacks_and_can_be_cleared(store: Store) -> None:
    SEEN.clear()
    TRIES.clear()
    CALLED.clear()

    def flaky(**context: Any) -> None:
        TRIES.append(context["try_number"])
        SEEN.append({a.name: len(e) for a, e in context["triggering_asset_events"].items()})
        if len(TRIES) == 1:
            raise ValueError("first time")

    with DAG(
        "flaky_consumer",
        schedule=[ORDERS],
        on_failure_callback=lambda context: CALLED.append(context["dag_run"].run_type),
    ) as dag:
        PythonOperator(task_id="use", python_callable=flaky)
    async with run_engine(store, dags=[dag]) as engine:
        await engine.add_dag(dag)
        await store.record_asset_events(_emit("orders", extra={"k": 1}))

        async def run_ended() -> bool:
            runs = await _runs(store, dag.dag_id)
            return bool(runs) and runs[0].state == "failed" and CALLED != []

        await wait_until(run_ended, what="the asset-triggered run to fail and call back")
        assert CALLED == ["asset_triggered"]
        [run] = await _runs(store, dag.dag_id)
        [ti] = await store.list_task_instances(dag_id=dag.dag_id)
        await store.clear_task(ti.id, who="test")
        await engine.finish(dag.dag_id, run.run_id)
    [run] = await _runs(store, dag.dag_id)
    assert run.state == "success"
    # the cleared try saw the same triggering event as the first
    assert SEEN == [{"orders": 1}, {"orders": 1}]


_ISOLATED_DAGS = """
from engine import DAG, Asset
from operators.python import PythonOperator

ORDERS = Asset("orders", uri="postgres://warehouse/orders")


def produce(**context):
    context["outlet_events"][ORDERS].extra = {"from": "child"}


def consume(**context):
    events = context["triggering_asset_events"][ORDERS]
    assert [e.extra for e in events] == [{"from": "child"}], events
    return [e.extra for e in events]


with DAG(dag_id="iso_producer") as producer:
    PythonOperator(task_id="load", python_callable=produce, outlets=[ORDERS], isolation="process")

with DAG(dag_id="iso_consumer", schedule=[ORDERS]) as consumer:
    PythonOperator(task_id="use", python_callable=consume, isolation="process")
"""


async def test_outlet_events_and_triggering_events_cross_a_child_process(
    store: Store, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "isolated_assets.py").write_text(_ISOLATED_DAGS)
    dagbag = DagBag(dags)
    assert not dagbag.import_errors, dagbag.import_errors
    producer, consumer = dagbag.get_dag("iso_producer"), dagbag.get_dag("iso_consumer")
    async with run_engine(store, dagbag=dagbag) as engine:
        await engine.add_dag(consumer)
        tis = await engine.run_dag(producer)
        assert tis["load"]["state"] == "success"

        async def consumed() -> bool:
            runs = await _runs(store, "iso_consumer")
            return len(runs) == 1 and runs[0].state in ("success", "failed")

        await wait_until(consumed, what="the asset-triggered run to end")
    [run] = await _runs(store, "iso_consumer")
    assert run.state == "success"


async def test_taskflow_outlets_record_their_extra(store: Store) -> None:
    from engine import get_current_context, task

    with DAG("tf_producer") as dag:

        @task(outlets=[CUSTOMERS])
        def load() -> int:
            get_current_context()["outlet_events"][CUSTOMERS].extra = {"via": "taskflow"}
            return 3

        load()
    async with run_engine(store, dags=[dag]) as engine:
        tis = await engine.run_dag(dag)
    assert tis["load"]["state"] == "success"
    [event] = await store.asset_events("customers")
    assert (event.extra, event.source_task_id) == ({"via": "taskflow"}, "load")


async def test_a_deferrable_sensor_with_outlets_records_its_event(store: Store) -> None:
    # (a sensor's trigger ends it without a worker hop, unless it has outlets: their events
    # are written with its success by the worker)
    from operators.sensors.temporal import DateTimeSensor

    with DAG("sensing") as dag:
        DateTimeSensor(
            task_id="wait",
            target_time=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1),
            deferrable=True,
            outlets=[ORDERS],
        )
    async with run_engine(store, dags=[dag]) as engine:
        tis = await engine.run_dag(dag)
    assert tis["wait"]["state"] == "success"
    assert tis["wait"]["try_number"] == 1  # (it deferred once and resumed)
    [event] = await store.asset_events("orders")
    assert (event.source_dag_id, event.source_task_id) == ("sensing", "wait")


async def test_a_dag_declaring_no_watchers_keeps_the_watchers_another_declared(
    store: Store, tmp_path: Path
) -> None:
    watched = Asset(
        "orders",
        group="sales",
        extra={"team": "a"},
        watchers=[AssetWatcher("w", DirectoryTrigger(str(tmp_path), "*"))],
    )
    await record_dags(store, [_consumer("consumer", [watched])])
    with DAG("producer") as producer:
        PythonOperator(task_id="p", python_callable=print, outlets=[Asset("orders")])
    await record_dags(store, [producer])
    [asset] = await store.list_assets()
    assert [w["name"] for w in asset.watchers] == ["w"]
    assert (asset.group, asset.extra) == ("sales", {"team": "a"})
    assert [w.asset for w in await store.asset_watchers()] == ["orders"]


def test_a_nul_in_an_assets_extra_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="NUL"):
        Asset("a", extra={"k": "a\x00b"})
    with pytest.raises(ValueError, match="NUL"):
        Asset("a", extra={"k\x00": [1, {"x": "\x00"}]})


async def test_assets_the_database_refuses_fail_that_dag_only_and_are_tried_again(
    store: Store,
) -> None:
    bad = Asset("nul")
    bad.extra = {"k": "a\x00b"}  # past the checks: what the database refuses
    refused = _consumer("refused", [bad])
    after = _consumer("zz_after", [Asset("fine")])
    await record_dags(store, [refused, after])
    assert [a.name for a in await store.list_assets()] == ["fine"]
    # its row is written again by the next scan (its fingerprint forgotten)
    assert await store.get_dag("refused") is not None
    fingerprints = {d.dag_id: serialize_dag(d).fingerprint for d in (refused, after)}
    assert await store.dags_to_record(fingerprints) == {"refused"}
    bad.extra = {"k": "ab"}
    await record_dags(store, [_consumer("refused", [bad])])
    assert [a.name for a in await store.list_assets()] == ["fine", "nul"]


#: deferral_asset_condition made to wait, before it answers, for the advisory lock named by
#: its session's deferral_test.gate (none: no wait): a scheduler's statement stops there,
#: its snapshot taken and no DAG locked yet.
GATED_CONDITION = """
ALTER FUNCTION deferral_asset_condition(jsonb, text[]) RENAME TO deferral_asset_condition_real;
CREATE FUNCTION deferral_asset_condition(cond jsonb, present text[]) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF COALESCE(current_setting('deferral_test.gate', true), '') <> '' THEN
        PERFORM pg_advisory_xact_lock_shared(current_setting('deferral_test.gate')::bigint);
    END IF;
    RETURN deferral_asset_condition_real(cond, present);
END $$;
"""


async def test_two_schedulers_make_no_run_the_condition_does_not_hold_for(
    store: Store, db_url: str
) -> None:
    """Scheduler 1 evaluates on a snapshot with a1, b1; a2 arrives; scheduler 2 evaluates on
    a snapshot with a1, b1, a2; scheduler 1 consumes a1, b1 and commits its run; then
    scheduler 2 goes on. It must not make a run of a2 alone (the DAG needs a and b), nor a
    second run (max_active_runs=1). (One statement judging on its start snapshot did.)"""
    import asyncpg

    with DAG("ab", schedule=Asset("a") & Asset("b"), max_active_runs=1) as dag:
        PythonOperator(task_id="t", python_callable=print)
    await record_dags(store, [dag])
    gate, one, two, watch = [await asyncpg.connect(db_url) for _ in range(4)]
    try:
        await gate.execute(GATED_CONDITION)
        await gate.execute("SELECT pg_advisory_lock(1), pg_advisory_lock(2)")
        await one.execute("SET deferral_test.gate = '1'")
        await two.execute("SET deferral_test.gate = '2'")
        await store.record_asset_events(_emit("a", "b"))
        first = asyncio.ensure_future(store.create_asset_runs(conn=one))
        await wait_until(lambda: waiting_on_locks(watch, 1), what="scheduler 1 at its gate")
        await store.record_asset_events(_emit("a"))
        second = asyncio.ensure_future(store.create_asset_runs(conn=two))
        await wait_until(lambda: waiting_on_locks(watch, 2), what="scheduler 2 at its gate")
        await gate.execute("SELECT pg_advisory_unlock(1)")
        made = await first
        await gate.execute("SELECT pg_advisory_unlock(2)")
        assert await second == []
        # (scheduler 1 judged again under its lock: a2 went into its run too)
        assert [r.events for r in made] == [3]
        assert len(await _runs(store, "ab")) == 1
        assert await store.queued_asset_events("ab") == []
    finally:
        for c in (gate, one, two, watch):
            await c.close()


async def test_two_dags_declaring_different_watchers_for_one_asset_are_refused(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def watched(pattern: str) -> Asset:
        trigger = DirectoryTrigger(str(tmp_path), pattern)
        return Asset("orders", watchers=[AssetWatcher("w", trigger)])

    await record_dags(store, [_consumer("first", [watched("*.csv")])])
    # the same declaration in another DAG is fine
    await record_dags(store, [_consumer("same", [watched("*.csv")])])
    with caplog.at_level(logging.ERROR):
        await record_dags(store, [_consumer("second", [watched("*.json")])])
    [asset] = await store.list_assets()
    assert asset.scheduled_dags == ["first", "same"]
    [watcher] = await store.asset_watchers()
    assert b"*.csv" in watcher.kwargs
    [refused] = [r.getMessage() for r in caplog.records if "second" in r.getMessage()]
    assert "first" in refused
    assert "watchers" in refused


async def test_a_dag_that_stops_declaring_watchers_stops_them(store: Store, tmp_path: Path) -> None:
    watched = Asset("orders", watchers=[AssetWatcher("w", DirectoryTrigger(str(tmp_path), "*"))])
    await record_dags(store, [_consumer("consumer", [watched])])
    assert [w.name for w in await store.asset_watchers()] == ["w"]
    await record_dags(store, [_consumer("consumer", [Asset("orders")])])
    assert await store.asset_watchers() == []
