"""Admission, in one process on a real PostgreSQL: pools (pool_slots, include_deferred, a
missing pool, a pool resized while tasks wait), priorities by weight rule, the limits
(max_active_tasks, max_active_tis_per_dag, parallelism) and queues for workers and
triggerers. (Two worker processes sharing a pool: tests/test_admission_processes.py.)

Tasks that must stay running hold on a gate the test opens. That a limit holds is checked by
one more claim, made by the test itself through the same admission as the worker's: it must
admit nothing while the tasks it holds back stay ``scheduled``.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import asyncpg
import hypothesis
import pytest
from click.testing import CliRunner
from hypothesis import strategies as st

from engine import DAG
from engine.cli import cli
from engine.config import ConfigError, Settings, load
from engine.scheduler.dagrecord import record_dags
from engine.store import ClaimedTask, Store, TaskClaim, TaskOutcome, TriggerOutcome
from engine.store.queries import load_queries
from engine.testing import LocalEngine, run_engine
from operators.base import BaseOperator, Context
from operators.python import PythonOperator
from tests.helpers import never_deferral, wait_until, waiting_on_locks
from tests.triggers_for_tests import NeverTrigger, WaitTrigger

pytestmark = pytest.mark.anyio


class _Probe:
    """What the tasks of one test did: the order they started in, how many ran at once, and
    the gate the gated ones wait on."""

    def __init__(self) -> None:
        self.gate = anyio.Event()
        self.started: list[str] = []
        self.running = 0
        self.peak = 0

    def enter(self, name: str) -> None:
        self.started.append(name)
        self.running += 1
        self.peak = max(self.peak, self.running)

    def leave(self) -> None:
        self.running -= 1


#: Probes by tag (operators are deep-copied for each execution: they keep the tag only).
PROBES: dict[str, _Probe] = {}


@pytest.fixture
def probe() -> Iterator[tuple[str, _Probe]]:
    tag = uuid.uuid4().hex
    PROBES[tag] = probe = _Probe()
    try:
        yield tag, probe
    finally:
        probe.gate.set()
        del PROBES[tag]


class Gated(BaseOperator):
    """Runs until the test opens the gate of its probe (at once when ``gated=False``)."""

    def __init__(self, *, tag: str, gated: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tag = tag
        self.gated = gated

    async def execute(self, context: Context) -> Any:
        probe = PROBES[self.tag]
        probe.enter(f"{context['run_id']}.{self.task_id}")
        try:
            if self.gated:
                await probe.gate.wait()
        finally:
            probe.leave()


class Waits(BaseOperator):
    """Defers on ``trigger`` and succeeds with the event when it fires."""

    def __init__(self, *, trigger: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trigger = trigger

    def execute(self, context: Context) -> Any:
        self.defer(trigger=self.trigger, method_name="resume")

    def resume(self, context: Context, event: Any = None) -> Any:
        return event


async def _states(store: Store, dag_id: str) -> dict[str, str]:
    """State by ``run_id.task_id``."""
    return {
        f"{ti.run_id}.{ti.task_id}": ti.state
        for ti in await store.list_task_instances(dag_id=dag_id)
    }


async def _count(store: Store, dag_id: str) -> collections.Counter[str]:
    return collections.Counter((await _states(store, dag_id)).values())


async def _running(store: Store, dag_id: str, n: int) -> None:
    async def there() -> bool:
        return (await _count(store, dag_id))["running"] >= n

    await wait_until(there, what=f"{n} running tasks of {dag_id}")


async def _one_more_claim(store: Store, *, parallelism: int = 0) -> list[str]:
    """A claim by a worker of the test's own, through the same admission as the engine's
    worker: what it admits now (``dag_id.task_id``)."""
    worker = await store.register_worker("admission-probe", 1, 100)
    claimed = (await store.claim_tasks(worker, 100, parallelism=parallelism)).claimed
    return [f"{ti.dag_id}.{ti.task_id}" for ti in claimed]


async def _all_ended(engine: LocalEngine, dag_id: str, *run_ids: str) -> None:
    for run_id in run_ids:
        assert (await engine.finish(dag_id, run_id))["__run__"]["state"] == "success"


async def _record(store: Store, dag: DAG, *run_ids: str) -> None:
    """Record the DAG and create its runs ``run_ids`` (default: run1) with no engine running:
    the first claim then sees the tasks of every run at once."""
    await record_dags(store, [dag])
    for run_id in run_ids or ("run1",):
        await store.create_dag_run(dag.dag_id, run_id, logical_date=await store.now())


# -- priorities ----------------------------------------------------------------------------


def _weights(rule: str) -> dict[str, int]:
    """a(1) >> b(2) >> c(4); a >> d(8); e(16) >> c: every task with ``rule``."""
    with DAG(dag_id=f"weights_{rule}") as dag:
        a, b, c, d, e = (
            BaseOperator(task_id=name, priority_weight=w, weight_rule=rule)
            for name, w in (("a", 1), ("b", 2), ("c", 4), ("d", 8), ("e", 16))
        )
        a >> b >> c
        a >> d
        e >> c
    return dag.priority_weights()


def test_priority_weights_by_rule() -> None:
    # downstream: own + every task downstream of it (transitively), each counted once
    assert _weights("downstream") == {"a": 1 + 2 + 4 + 8, "b": 2 + 4, "c": 4, "d": 8, "e": 20}
    # upstream: own + every task upstream of it
    assert _weights("upstream") == {"a": 1, "b": 3, "c": 4 + 2 + 1 + 16, "d": 9, "e": 16}
    assert _weights("absolute") == {"a": 1, "b": 2, "c": 4, "d": 8, "e": 16}


def test_priority_weights_follow_each_tasks_own_rule() -> None:
    with DAG(dag_id="weights_mixed") as dag:
        a = BaseOperator(task_id="a", priority_weight=1, weight_rule="absolute")
        b = BaseOperator(task_id="b", priority_weight=10)  # downstream, the default
        c = BaseOperator(task_id="c", priority_weight=100, weight_rule="upstream")
        a >> b >> c
    assert dag.priority_weights() == {"a": 1, "b": 110, "c": 111}
    assert dag.serialize_tasks()[1]["priority"] == 110


def _closure_weights(dag: DAG) -> dict[str, int]:
    """Priority weights the plain way: walk each task's relatives (the reference)."""
    weights = {}
    for task_id, task in dag.tasks.items():
        seen: set[str] = set()
        if task.weight_rule != "absolute":
            edges = f"{task.weight_rule}_task_ids"
            stack = [task_id]
            while stack:
                for other in getattr(dag.tasks[stack.pop()], edges):
                    if other not in seen:
                        seen.add(other)
                        stack.append(other)
        total = task.priority_weight + sum(dag.tasks[o].priority_weight for o in seen)
        weights[task_id] = max(-(2**31), min(total, 2**31 - 1))
    return weights


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    st.lists(
        st.tuples(
            st.sampled_from([1, 1, 2, -3, 7, 10**9]),
            st.sampled_from(["downstream", "upstream", "absolute"]),
        ),
        max_size=12,
    ),
    st.sets(st.tuples(st.integers(0, 11), st.integers(0, 11))),
)
def test_priority_weights_equal_summing_each_tasks_relatives(
    tasks: list[tuple[int, str]], edges: set[tuple[int, int]]
) -> None:
    # The weights come from bit sets built in topological order (a chain of 5,000 tasks took
    # 17 s by walking each task's relatives): they must be the same sums.
    with DAG(dag_id="weights_any") as dag:
        ops = [
            BaseOperator(task_id=f"t{i}", priority_weight=weight, weight_rule=rule)
            for i, (weight, rule) in enumerate(tasks)
        ]
        for a, b in edges:
            if a < b < len(ops):  # forward edges only: no cycle
                ops[a] >> ops[b]
    assert dag.priority_weights() == _closure_weights(dag)


async def test_a_fired_sensor_of_a_pool_counting_deferred_tasks_resumes_before_new_tasks(
    store: Store,
) -> None:
    # The pool is full of its two deferred sensors; three new tasks wait in it, older than the
    # event. When the trigger fires, the sensors keep their slots and resume: the new tasks,
    # first in claim order by age, must not take the slots the event freed (they did: a
    # fired sensor waited behind every new task of a pool kept full).
    await store.set_pool("sensing", 2, include_deferred=True)
    with DAG(dag_id="sensing") as sensing:
        for name in ("a", "b"):
            PythonOperator(task_id=name, python_callable=lambda: 1, pool="sensing",
                           weight_rule="absolute")  # fmt: skip
    await store.upsert_dag("sensing", "sensing.py", sensing.serialize_tasks(), None)
    await store.create_dag_run("sensing", "r1", logical_date=await store.now())
    worker = await store.register_worker("test", 1, 10)
    sensors = (await store.claim_tasks(worker, 10)).claimed
    assert sorted(ti.task_id for ti in sensors) == ["a", "b"]
    for ti in sensors:
        assert await store.defer_task(ti.id, worker, never_deferral("sensing"))

    with DAG(dag_id="newcomers") as newcomers:
        for i in range(3):
            PythonOperator(task_id=f"n{i}", python_callable=lambda: 1, pool="sensing",
                           weight_rule="absolute")  # fmt: skip
    await store.upsert_dag("newcomers", "newcomers.py", newcomers.serialize_tasks(), None)
    await store.create_dag_run("newcomers", "r1", logical_date=await store.now())
    assert (await store.claim_tasks(worker, 10)).claimed == []  # the sensors hold both slots

    triggerer = await store.register_triggerer("test", 1, 10, 60.0)
    (trigger,) = (await store.claim_triggers(triggerer, 10)).claimed
    event = TriggerOutcome(trigger_id=trigger.id, fence=trigger.fence, kind="event")
    await store.fire_triggers(triggerer, [event])
    resumed = (await store.claim_tasks(worker, 10)).claimed
    assert sorted((ti.dag_id, ti.task_id) for ti in resumed) == [
        ("sensing", "a"),
        ("sensing", "b"),
    ]
    assert all(ti.next_method == "resume" for ti in resumed)


async def test_summed_weights_past_the_databases_integer_are_clamped_not_a_crash(
    store: Store,
) -> None:
    # Three tasks of 10^9 downstream of each other sum past 2^31 - 1: the scheduler's start of
    # the run used to fail on it (an error that is not transient ends the scheduler's loop).
    with DAG(dag_id="heavy") as dag:
        a = BaseOperator(task_id="a", priority_weight=10**9)
        b = BaseOperator(task_id="b", priority_weight=10**9)
        c = BaseOperator(task_id="c", priority_weight=10**9)
        a >> b >> c
    assert dag.priority_weights()["a"] == 2**31 - 1
    await store.upsert_dag("heavy", "heavy.py", dag.serialize_tasks(), None)
    await store.create_dag_run("heavy", "r1", logical_date=await store.now())
    assert (await _states(store, "heavy"))["r1.a"] == "scheduled"


@pytest.mark.parametrize(
    "kwargs", [{"pool_slots": 2**31}, {"priority_weight": 2**31}, {"max_active_tis_per_dag": 2**31}]
)
def test_counts_past_the_databases_integer_are_refused(kwargs: dict[str, int]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"{name} must be in"):
        BaseOperator(task_id="t", **kwargs)
    with pytest.raises(ValueError, match="max_active_tasks must be an int in"):
        DAG(dag_id="too_many", max_active_tasks=2**31)


async def test_a_claim_takes_its_queues_task_past_higher_priority_tasks_of_another_queue(
    store: Store,
) -> None:
    # The candidates are read by pool and queue (deferral_ti_runnable_pool starts with both):
    # fifty gpu tasks ahead in claim order do not stand in a default worker's way.
    with DAG(dag_id="mixed_queues") as dag:
        for i in range(50):
            PythonOperator(task_id=f"gpu{i}", python_callable=lambda: 1, queue="gpu",
                           priority_weight=100)  # fmt: skip
        PythonOperator(task_id="cpu", python_callable=lambda: 1)
    await store.upsert_dag("mixed_queues", "mq.py", dag.serialize_tasks(), None)
    await store.create_dag_run("mixed_queues", "r1", logical_date=await store.now())
    worker = await store.register_worker("test", 1, 1)
    claimed = (await store.claim_tasks(worker, 1)).claimed
    assert [ti.task_id for ti in claimed] == ["cpu"]


def test_an_unknown_weight_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="weight_rule 'sideways'"):
        BaseOperator(task_id="t", weight_rule="sideways")


async def _run_in_order(
    store: Store, dag: DAG, tag: str, probe: _Probe, ordered: set[str]
) -> list[str]:
    """Run ``dag`` on a worker of 1 slot, with the tasks ``ordered`` in pool "ordered" of 0
    slots until every one of them is runnable, then 1 slot: they run one at a time, in
    admission order, which is returned (their task_ids)."""
    await store.set_pool("ordered", 0)
    async with run_engine(store, slots=1) as engine:
        await engine.start_run(dag)

        async def all_runnable() -> bool:
            states = await _states(store, dag.dag_id)
            return all(states[f"run1.{t}"] == "scheduled" for t in ordered)

        await wait_until(all_runnable, what="the ordered tasks to be runnable")
        assert await _one_more_claim(store) == []  # a pool of 0 slots admits nothing
        await store.set_pool("ordered", 1)
        await _all_ended(engine, dag.dag_id, "run1")
    return [name.removeprefix("run1.") for name in probe.started if name[5:] in ordered]


async def test_priority_downstream_rule_orders_by_own_plus_downstream_weights(
    store: Store, probe: tuple[str, _Probe]
) -> None:
    tag, p = probe
    with DAG(dag_id="prio_downstream") as dag:
        # the ordered tasks, in pool "ordered"; their downstream tasks in the default pool
        ordered = {
            name: Gated(task_id=name, tag=tag, gated=False, pool="ordered", priority_weight=w)
            for name, w in (("a", 1), ("b", 2), ("c", 1), ("d", 4))
        }
        ordered["a"] >> Gated(task_id="a1", tag=tag, gated=False, priority_weight=3)
        c1 = Gated(task_id="c1", tag=tag, gated=False)
        ordered["c"] >> c1 >> Gated(task_id="c2", tag=tag, gated=False, priority_weight=5)
    assert dag.priority_weights()["c"] == 7
    order = await _run_in_order(store, dag, tag, p, set(ordered))
    # c: 1+1+5, a: 1+3 and d: 4 (equal: the same age, then creation order), b: 2
    assert order == ["c", "a", "d", "b"]


async def test_priority_upstream_rule_orders_by_own_plus_upstream_weights(
    store: Store, probe: tuple[str, _Probe]
) -> None:
    tag, p = probe
    with DAG(dag_id="prio_upstream") as dag:
        s1, s2, s3, s4 = (
            Gated(task_id=name, tag=tag, gated=False, priority_weight=w)
            for name, w in (("s1", 5), ("s2", 1), ("s3", 3), ("s4", 4))
        )
        s3 >> s4
        ordered = {
            name: Gated(task_id=name, tag=tag, gated=False, pool="ordered", weight_rule="upstream")
            for name in ("x", "y", "z", "w")
        }
        s2 >> ordered["x"]  # 1 + 1
        s1 >> ordered["y"]  # 1 + 5
        s4 >> ordered["z"]  # 1 + 4 + 3 (s3 through s4)
        [s1, s2] >> ordered["w"]  # 1 + 5 + 1
    order = await _run_in_order(store, dag, tag, p, set(ordered))
    assert order == ["z", "w", "y", "x"]


async def test_priority_absolute_rule_is_the_own_weight_only(
    store: Store, probe: tuple[str, _Probe]
) -> None:
    tag, p = probe
    with DAG(dag_id="prio_absolute") as dag:
        ordered = {
            name: Gated(task_id=name, tag=tag, gated=False, pool="ordered", priority_weight=w,
                        weight_rule="absolute")
            for name, w in (("p3", 3), ("q5", 5), ("r1", 1))
        }  # fmt: skip
        # (with the downstream rule p3 would come first: 3 + 100)
        ordered["p3"] >> Gated(task_id="heavy", tag=tag, gated=False, priority_weight=100)
    order = await _run_in_order(store, dag, tag, p, set(ordered))
    assert order == ["q5", "p3", "r1"]


async def test_priority_ties_go_to_the_task_runnable_longest(
    store: Store, probe: tuple[str, _Probe]
) -> None:
    tag, p = probe
    with DAG(dag_id="prio_ties") as dag:
        # "late" is created first (the lower id) but becomes runnable only after "setup"
        late = Gated(task_id="late", tag=tag, gated=False, pool="ordered",
                     weight_rule="absolute")  # fmt: skip
        Gated(task_id="setup", tag=tag, gated=False) >> late
        Gated(task_id="early", tag=tag, gated=False, pool="ordered", weight_rule="absolute")
    order = await _run_in_order(store, dag, tag, p, {"late", "early"})
    assert order == ["early", "late"]


# -- pools -----------------------------------------------------------------------------------


async def test_pool_slots_over_one_take_that_many_slots(
    store: Store, probe: tuple[str, _Probe]
) -> None:
    tag, p = probe
    await store.set_pool("four", 4)
    with DAG(dag_id="wide") as dag:
        for i in range(4):
            Gated(task_id=f"two_{i}", tag=tag, pool="four", pool_slots=2, priority_weight=10)
        # first in line, and never fits: stays scheduled, not failed
        Gated(task_id="five", tag=tag, pool="four", pool_slots=5, priority_weight=100)
    async with run_engine(store, slots=8) as engine:
        await engine.start_run(dag)
        await _running(store, "wide", 2)
        assert await _one_more_claim(store) == []
        assert await _count(store, "wide") == {"running": 2, "scheduled": 3}
        (pool,) = await store.list_pools("four")
        assert (pool.running, pool.open, pool.queued) == (4, 0, 3)
        p.gate.set()

        async def twos_done() -> bool:
            states = await _states(store, "wide")
            return all(states[f"run1.two_{i}"] == "success" for i in range(4))

        await wait_until(twos_done, what="the two-slot tasks to succeed")
        # an empty pool of 4 slots: still no room for 5
        assert await _one_more_claim(store) == []
        assert (await _states(store, "wide"))["run1.five"] == "scheduled"
    assert p.peak == 2
    assert "run1.five" not in p.started
    (pool,) = await store.list_pools("four")
    assert (pool.running, pool.open, pool.queued) == (0, 4, 1)


async def test_include_deferred_makes_deferred_tasks_hold_their_slots(store: Store) -> None:
    await store.set_pool("sensors", 2, include_deferred=True)
    with DAG(dag_id="sensing") as sensing:
        for i in range(2):
            Waits(task_id=f"wait_{i}", trigger=NeverTrigger(f"sensor-{i}"), pool="sensors")
    with DAG(dag_id="compute") as compute:
        # first in line; "beside" shows that a claim came after it was runnable
        PythonOperator(task_id="work", python_callable=lambda: "done", pool="sensors",
                       priority_weight=100)  # fmt: skip
        PythonOperator(task_id="beside", python_callable=lambda: "done")
    async with run_engine(store) as engine:
        await engine.start_run(sensing)
        for i in range(2):
            await engine.wait_for_state("sensing", f"wait_{i}", "deferred")
        await engine.start_run(compute)
        await engine.wait_for_state("compute", "beside", "success")
        assert await _one_more_claim(store) == []
        assert (await _states(store, "compute"))["run1.work"] == "scheduled"
        (pool,) = await store.list_pools("sensors")
        assert (pool.running, pool.deferred, pool.open, pool.queued) == (0, 2, 0, 1)

        # without include_deferred the deferred tasks hold nothing
        await store.set_pool("sensors", 2, include_deferred=False)
        await engine.wait_for_state("compute", "work", "success")
        (pool,) = await store.list_pools("sensors")
        assert (pool.deferred, pool.open, pool.include_deferred) == (2, 2, False)
        assert (await _count(store, "sensing")) == {"deferred": 2}

        # and with it again, the pool is full once more
        await store.set_pool("sensors", 2, include_deferred=True)
        await engine.start_run(compute, "run2")
        await engine.wait_for_state("compute", "beside", "success", run_id="run2")
        assert (await _states(store, "compute"))["run2.work"] == "scheduled"


async def test_a_task_naming_a_missing_pool_fails_at_claim_naming_it(
    store: Store, probe: tuple[str, _Probe]
) -> None:
    tag, p = probe
    with DAG(dag_id="nopool") as dag:
        Gated(task_id="lost", tag=tag, gated=False, pool="no_such_pool", retries=3)
        Gated(task_id="beside", tag=tag, gated=False)
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["__run__"]["state"] == "failed"
    assert tis["beside"]["state"] == "success"
    lost = tis["lost"]
    assert lost["state"] == "failed"  # not up_for_retry: no try would find the pool
    assert lost["try_number"] == 1
    assert "pool 'no_such_pool' does not exist" in lost["error"]
    assert "deferral pools set no_such_pool --slots" in lost["error"]
    assert p.started == ["run1.beside"]  # the task itself never ran


async def test_a_pool_grown_while_tasks_wait_starts_them(
    store: Store, probe: tuple[str, _Probe]
) -> None:
    tag, p = probe
    await store.set_pool("small", 1)
    with DAG(dag_id="grown") as dag:
        for i in range(4):
            Gated(task_id=f"t{i}", tag=tag, pool="small")
    async with run_engine(store, slots=8) as engine:
        await engine.start_run(dag)
        await _running(store, "grown", 1)
        assert await _one_more_claim(store) == []
        assert await _count(store, "grown") == {"running": 1, "scheduled": 3}
        assert await store.set_pool("small", 3) is False  # changed, not created
        await _running(store, "grown", 3)
        assert await _one_more_claim(store) == []
        assert await _count(store, "grown") == {"running": 3, "scheduled": 1}
        p.gate.set()
        await _all_ended(engine, "grown", "run1")
    assert p.peak == 3


# -- limits ----------------------------------------------------------------------------------


async def test_max_active_tasks_limits_the_dags_running_tasks_across_its_runs(
    store: Store, probe: tuple[str, _Probe]
) -> None:
    tag, p = probe
    with DAG(dag_id="capped", max_active_tasks=2) as dag:
        for i in range(3):
            Gated(task_id=f"t{i}", tag=tag)
    with DAG(dag_id="uncapped") as other:
        Gated(task_id="t", tag=tag)
    async with run_engine(store, slots=8) as engine:
        await engine.start_run(dag, "r1")
        await engine.start_run(dag, "r2")
        await engine.start_run(other)
        await _running(store, "capped", 2)
        await _running(store, "uncapped", 1)  # another DAG is not held back
        assert await _one_more_claim(store) == []
        assert await _count(store, "capped") == {"running": 2, "scheduled": 4}
        p.gate.set()
        await _all_ended(engine, "capped", "r1", "r2")
    assert sum(name.startswith(("r1.", "r2.")) for name in p.started) == 6


async def test_max_active_tis_per_dag_limits_a_task_across_runs(
    store: Store, probe: tuple[str, _Probe]
) -> None:
    tag, p = probe
    with DAG(dag_id="per_task") as dag:
        Gated(task_id="one_at_a_time", tag=tag, max_active_tis_per_dag=1)
        Gated(task_id="free", tag=tag)
    # (all runs there before the first claim: one claim must not take the task of two runs)
    await _record(store, dag, "r1", "r2", "r3")
    async with run_engine(store, dags=[dag], slots=8) as engine:
        await _running(store, "per_task", 4)
        assert await _one_more_claim(store) == []
        states = await _states(store, "per_task")
        assert [states[f"{r}.free"] for r in ("r1", "r2", "r3")] == ["running"] * 3
        limited = collections.Counter(states[f"{r}.one_at_a_time"] for r in ("r1", "r2", "r3"))
        assert limited == {"running": 1, "scheduled": 2}
        p.gate.set()
        await _all_ended(engine, "per_task", "r1", "r2", "r3")


async def test_parallelism_limits_running_tasks_across_workers(
    store: Store, probe: tuple[str, _Probe]
) -> None:
    tag, p = probe
    with DAG(dag_id="parallel") as dag:
        for i in range(5):
            Gated(task_id=f"t{i}", tag=tag)
    async with run_engine(store, slots=8, worker_options={"parallelism": 2}) as engine:
        await engine.start_run(dag)
        await _running(store, "parallel", 2)
        assert await _one_more_claim(store, parallelism=2) == []
        assert await _count(store, "parallel") == {"running": 2, "scheduled": 3}
        # the limit counts what runs anywhere: one more allowed admits exactly one more
        (extra,) = await _one_more_claim(store, parallelism=3)
        assert extra.startswith("parallel.t")
        p.gate.set()

        async def the_engines_ended() -> bool:
            return (await _count(store, "parallel")) == {"success": 4, "running": 1}

        await wait_until(the_engines_ended, what="the engine's tasks to succeed")
    assert p.peak == 2


# -- queues ----------------------------------------------------------------------------------


async def test_a_task_runs_only_on_a_worker_serving_its_queue(store: Store) -> None:
    with DAG(dag_id="routed") as dag:
        PythonOperator(task_id="on_gpu", python_callable=lambda: "gpu", queue="gpu",
                       priority_weight=100)  # fmt: skip
        PythonOperator(task_id="beside", python_callable=lambda: "cpu")
    async with run_engine(store) as engine:
        await engine.start_run(dag)
        await engine.wait_for_state("routed", "beside", "success")
        assert await _one_more_claim(store) == []  # a default worker's claim
        assert (await _states(store, "routed"))["run1.on_gpu"] == "scheduled"
    async with run_engine(store, dags=[dag], worker_options={"queues": ("gpu",)}) as engine:
        tis = await engine.finish("routed")
    assert tis["on_gpu"]["state"] == "success"
    assert tis["__run__"]["state"] == "success"


async def test_a_trigger_runs_only_on_a_triggerer_serving_its_queue(store: Store) -> None:
    with DAG(dag_id="team_waits") as team:
        Waits(task_id="wait", trigger=WaitTrigger(0.01, "team"), trigger_queue="team")
    with DAG(dag_id="plain_waits") as plain:
        Waits(task_id="wait", trigger=WaitTrigger(0.01, "plain"))
    async with run_engine(store) as engine:
        await engine.start_run(team)
        await engine.wait_for_state("team_waits", "wait", "deferred")
        # a trigger claimed after the team's was there: the team's was passed over
        await engine.start_run(plain)
        await engine.wait_for_state("plain_waits", "wait", "success")
        (trigger,) = await store.list_triggers()
        assert trigger.triggerer_id is None
        assert [(t.dag_id, t.task_id) for t in trigger.tasks] == [("team_waits", "wait")]
    async with run_engine(store, dags=[team], triggerer_options={"queues": ("team",)}) as engine:
        tis = await engine.finish("team_waits")
    assert tis["wait"]["state"] == "success"


async def test_identical_triggers_of_two_queues_are_two_triggers(store: Store) -> None:
    with DAG(dag_id="two_queues") as dag:
        Waits(task_id="team", trigger=NeverTrigger("same"), trigger_queue="team")
        Waits(task_id="plain", trigger=NeverTrigger("same"))
        Waits(task_id="plain_too", trigger=NeverTrigger("same"))
    async with run_engine(store, triggerer=False) as engine:
        await engine.start_run(dag)
        for task_id in ("team", "plain", "plain_too"):
            await engine.wait_for_state("two_queues", task_id, "deferred")
    waiting = sorted(
        sorted(t.task_id for t in trigger.tasks) for trigger in await store.list_triggers()
    )
    assert waiting == [["plain", "plain_too"], ["team"]]


# -- settings and command line ---------------------------------------------------------------


@pytest.mark.parametrize("value", ["", " , ", ","])
def test_worker_queues_option_must_name_a_queue(db_url: str, value: str) -> None:
    result = CliRunner().invoke(
        cli, ["worker", "--queues", value], env={"DEFERRAL_DATABASE_URL": db_url}
    )
    assert result.exit_code == 2, result.output
    assert "--queues" in result.output
    assert "name at least one queue" in result.output
    assert "Traceback" not in result.output


def test_triggerer_queues_option_must_name_a_queue(db_url: str) -> None:
    result = CliRunner().invoke(
        cli, ["triggerer", "--queues", ""], env={"DEFERRAL_DATABASE_URL": db_url}
    )
    assert result.exit_code == 2, result.output
    assert "name at least one queue" in result.output


def test_a_negative_parallelism_is_refused() -> None:
    with pytest.raises(ConfigError, match="parallelism must be >= 0"):
        Settings(parallelism=-1)
    with pytest.raises(ConfigError, match="parallelism must be >= 0"):
        load({"DEFERRAL_PARALLELISM": "-1"})
    assert load({"DEFERRAL_PARALLELISM": "0"}).settings.parallelism == 0


def test_a_worker_with_a_negative_parallelism_does_not_start(db_url: str) -> None:
    result = CliRunner().invoke(
        cli, ["worker"], env={"DEFERRAL_DATABASE_URL": db_url, "DEFERRAL_PARALLELISM": "-1"}
    )
    assert result.exit_code != 0
    assert "parallelism must be >= 0" in result.output, result.output
    assert "Traceback" not in result.output


def test_queue_settings_from_the_environment() -> None:
    settings = load({"DEFERRAL_WORKER_QUEUES": "gpu, default", "DEFERRAL_TRIGGERER_QUEUES": "team"})
    assert settings.settings.worker_queues == ("gpu", "default")
    assert settings.settings.triggerer_queues == ("team",)
    with pytest.raises(ConfigError, match="worker_queues"):
        load({"DEFERRAL_WORKER_QUEUES": " , "})


# -- admission is serial ---------------------------------------------------------------------


async def test_a_claim_waiting_for_admission_sees_a_pool_created_meanwhile(
    store: Store, db_url: str
) -> None:
    """A claim waits for the one before it to commit (admission is serial), then counts what
    is there after it: a pool created while it waited exists for all of the claim, not only
    for its admission (which admitted the task) but for the missing-pool check too (which
    would fail the task, naming a pool that exists)."""
    with DAG(dag_id="late_pool") as dag:
        BaseOperator(task_id="first", priority_weight=10)
        BaseOperator(task_id="pooled", pool="made_meanwhile")
    await _record(store, dag)
    first_worker = await store.register_worker("first", 1, 1)
    second_worker = await store.register_worker("second", 1, 10)

    holding = await asyncpg.connect(db_url)
    watch = await asyncpg.connect(db_url)
    second: list[list[ClaimedTask]] = []
    try:
        tx = holding.transaction()
        await tx.start()
        (first,) = await holding.fetch(
            load_queries()["claim_tasks"], first_worker, 1, ["default"], 0
        )
        assert first["task_id"] == "first"

        async def claim() -> None:
            second.append((await store.claim_tasks(second_worker, 10)).claimed)

        async with anyio.create_task_group() as tg:
            tg.start_soon(claim)
            await wait_until(
                lambda: waiting_on_locks(watch, 1), what="the claim to wait for admission"
            )
            assert await store.set_pool("made_meanwhile", 1) is True
            await tx.commit()
    finally:
        await holding.close()
        await watch.close()

    assert [ti.task_id for ti in second[0]] == ["pooled"]
    pooled = (await _states(store, "late_pool"))["run1.pooled"]
    assert pooled == "running"


async def test_a_claim_waits_for_the_one_before_it_and_counts_what_it_took(
    store: Store, db_url: str
) -> None:
    """The first claim took the pool's only slot and has not committed yet: the second waits
    for it, then admits nothing from that pool (it does not see the slot as free while the
    first is uncommitted, and take the pool's other task beside it)."""
    await store.set_pool("one", 1)
    with DAG(dag_id="one_slot") as dag:
        # (more than the first claim looks at and locks: 4 per task it may take)
        for i in range(6):
            BaseOperator(task_id=f"t{i}", pool="one")
    await _record(store, dag)
    first_worker = await store.register_worker("first", 1, 1)
    second_worker = await store.register_worker("second", 1, 10)

    holding = await asyncpg.connect(db_url)
    watch = await asyncpg.connect(db_url)
    second: list[list[ClaimedTask]] = []
    try:
        tx = holding.transaction()
        await tx.start()
        (first,) = await holding.fetch(
            load_queries()["claim_tasks"], first_worker, 1, ["default"], 0
        )
        assert first["task_id"] == "t0"

        async def claim() -> None:
            second.append((await store.claim_tasks(second_worker, 10)).claimed)

        async def waiting_or_done() -> bool:
            return bool(second) or await waiting_on_locks(watch, 1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(claim)
            await wait_until(waiting_or_done, what="the second claim to wait or end")
            await tx.commit()
    finally:
        await holding.close()
        await watch.close()

    assert second == [[]]
    states = await _states(store, "one_slot")
    assert states == {"run1.t0": "running"} | {f"run1.t{i}": "scheduled" for i in range(1, 6)}


async def test_a_claim_with_nothing_runnable_does_not_wait_for_another_claims_admission(
    store: Store, db_url: str
) -> None:
    """Admission is serial, but a claim that has nothing to admit has nothing to wait for:
    while another worker's claim holds admission (uncommitted), a claim whose queues have no
    runnable task answers at once, empty, and still says when its next waiting task (a retry
    due in ten minutes) becomes runnable. (Several workers wake for each notification; every
    one of those empty claims queued behind the one that took the tasks.)"""
    with DAG(dag_id="nothing_now") as dag:
        BaseOperator(task_id="later", retries=1, retry_delay=600)
        BaseOperator(task_id="elsewhere", queue="other")
    await _record(store, dag)
    default_worker = await store.register_worker("default", 1, 10)
    other_worker = await store.register_worker("other", 1, 10)
    (later,) = (await store.claim_tasks(default_worker, 10)).claimed
    failed = TaskOutcome(
        ti_id=later.id, worker_id=default_worker, try_number=1, kind="failed", error="boom"
    )
    assert [f.state for f in await store.finish_tasks([failed])] == ["up_for_retry"]

    holding = await asyncpg.connect(db_url)
    watch = await asyncpg.connect(db_url)
    answers: list[TaskClaim] = []
    try:
        tx = holding.transaction()
        await tx.start()
        (taken,) = await holding.fetch(load_queries()["claim_tasks"], other_worker, 1, ["other"], 0)
        assert taken["task_id"] == "elsewhere"

        async def claim() -> None:
            answers.append(await store.claim_tasks(default_worker, 10))

        async def waiting_or_done() -> bool:
            return bool(answers) or await waiting_on_locks(watch, 1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(claim)
            await wait_until(waiting_or_done, what="the claim to wait or end")
            done_before_commit = bool(answers)
            await tx.commit()
    finally:
        await holding.close()
        await watch.close()

    assert done_before_commit, "the empty claim waited for the other claim's admission"
    (answer,) = answers
    assert answer.claimed == []
    assert answer.refused == []
    assert answer.next_in is not None
    assert 0 < answer.next_in <= 600
    assert (await _states(store, "nothing_now"))["run1.later"] == "up_for_retry"


async def test_a_claim_that_waited_for_the_one_taking_everything_answers_empty_with_next_in(
    store: Store, db_url: str
) -> None:
    """The claim before it (uncommitted) took the one runnable task: the second claim, which
    saw that task still runnable, waits for admission, then finds nothing left and answers
    empty, still saying when its waiting retry becomes runnable; nothing else changes."""
    with DAG(dag_id="all_taken") as dag:
        BaseOperator(task_id="later", retries=1, retry_delay=600)
        BaseOperator(task_id="now")
    await _record(store, dag)
    first_worker = await store.register_worker("first", 1, 10)
    second_worker = await store.register_worker("second", 2, 10)
    await store.set_pool("default_pool", 1)
    (later,) = (await store.claim_tasks(first_worker, 10)).claimed
    assert later.task_id == "later"
    failed = TaskOutcome(
        ti_id=later.id, worker_id=first_worker, try_number=1, kind="failed", error="boom"
    )
    assert [f.state for f in await store.finish_tasks([failed])] == ["up_for_retry"]

    holding = await asyncpg.connect(db_url)
    watch = await asyncpg.connect(db_url)
    answers: list[TaskClaim] = []
    try:
        tx = holding.transaction()
        await tx.start()
        (taken,) = await holding.fetch(
            load_queries()["claim_tasks"], first_worker, 10, ["default"], 0
        )
        assert taken["task_id"] == "now"

        async def claim() -> None:
            answers.append(await store.claim_tasks(second_worker, 10))

        async with anyio.create_task_group() as tg:
            tg.start_soon(claim)
            await wait_until(
                lambda: waiting_on_locks(watch, 1), what="the claim to wait for admission"
            )
            await tx.commit()
    finally:
        await holding.close()
        await watch.close()

    (answer,) = answers
    assert answer.claimed == []
    assert answer.next_in is not None
    assert 0 < answer.next_in <= 600
    assert await _states(store, "all_taken") == {
        "run1.later": "up_for_retry",
        "run1.now": "running",
    }
