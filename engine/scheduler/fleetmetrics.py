"""The scheduler's metrics of the whole fleet, read from the database: task instances by
state, triggers no triggerer runs, each pool's slots, runs queued and running by DAG (gauges,
set every ``FLEET_INTERVAL_S``), and, when the scheduler ends runs, how long they took, how
late scheduled ones started and how long their tasks took (histograms: each run is observed
once, by the scheduler that ended it).

DAG ids and pool names are names users write to the database: each family labels at most
``metrics_max_series`` of them by their own value, the others under ``other``
(:meth:`engine.runtime.metrics.Metrics.bounded_label`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.runtime.metrics import Metrics
from engine.states import STATES
from engine.store import EndedRun, Store

__all__ = ["export_fleet", "observe_ended_runs"]


async def export_fleet(store: Store, metrics: Metrics) -> None:
    """Set the fleet gauges."""
    counts = await store.count_task_states()
    for state in sorted(STATES):
        metrics.tasks.labels(state).set(counts.get(state, 0))
    metrics.triggers_unassigned.set(await store.count_unowned_triggers())

    pools = await store.list_pools()
    gauges = {
        "open": metrics.pool_open_slots,
        "queued": metrics.pool_queued_slots,
        "running": metrics.pool_running_slots,
        "deferred": metrics.pool_deferred_slots,
    }
    for what, gauge in gauges.items():
        values: Counter[str] = Counter()
        for pool in pools:
            values[metrics.bounded_label(gauge, pool.name)] += getattr(pool, what)
        gauge.clear()  # (a pool deleted since is no longer shown)
        for label, value in values.items():
            gauge.labels(label).set(value)

    runs: Counter[tuple[str, str]] = Counter()
    for (dag_id, run_state), n in (await store.active_runs_by_dag()).items():
        runs[metrics.bounded_label(metrics.dag_runs, dag_id), run_state] += n
    metrics.dag_runs.clear()
    for (dag_id, run_state), n in runs.items():
        metrics.dag_runs.labels(dag_id, run_state).set(n)


async def observe_ended_runs(store: Store, metrics: Metrics, ended: Sequence[EndedRun]) -> None:
    """Observe the runs this scheduler just ended (and their task instances)."""
    for run in await store.ended_run_facts([r.id for r in ended]):
        if run.duration_s is not None:
            dag = metrics.bounded_label(metrics.dag_run_duration, run.dag_id)
            metrics.dag_run_duration.labels(dag, run.state).observe(max(0.0, run.duration_s))
        if run.delay_s is not None:
            dag = metrics.bounded_label(metrics.scheduling_delay, run.dag_id)
            metrics.scheduling_delay.labels(dag).observe(max(0.0, run.delay_s))
        for state, seconds in run.tasks:
            metrics.task_duration.labels(state).observe(max(0.0, seconds))
