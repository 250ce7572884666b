"""Runs from schedules: record a DAG's schedule, keep its next run stored, create due runs.

The interval maths is in :mod:`engine.dags.timetables`; this module joins it to the store. The
scheduler does not evaluate every DAG's schedule on every pass: each DAG's next run (logical
date, interval, when it may be created) is stored in ``deferral_dags``, computed when the
schedule is first seen or changes and again each time runs of the DAG are created. A pass
reads the DAGs that are due through one indexed query, locked with SKIP LOCKED, and creates
their runs in the same transaction; the unique index on ``(dag_id, logical_date)`` of
scheduled runs is the last word when two schedulers meet. The new runs are started (behind
max_active_runs) once every due DAG's runs are created.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.dags.timetables import (
    DagRunInfo,
    DataInterval,
    Timetable,
    load_timetable,
    manual_run_interval,
    stored_timezone,
)
from engine.store.models import NewRun, NextRun

if TYPE_CHECKING:
    from engine.store import Store
    from engine.store.models import DueDag

__all__ = [
    "DUE_BATCH",
    "MAX_RUNS_PER_PASS",
    "create_due_runs",
    "manual_data_interval",
    "next_run",
    "run_id_for",
]

log = logging.getLogger(__name__)

#: DAGs locked and handled in one transaction of a pass.
DUE_BATCH = 500
#: Catch-up runs one DAG gets in one pass (the rest in the next passes).
MAX_RUNS_PER_PASS = 100


def run_id_for(run_type: str, logical_date: dt.datetime) -> str:
    """``scheduled__2024-01-01T00:00:00+00:00`` (as Airflow names them)."""
    return f"{run_type}__{logical_date.astimezone(dt.UTC).isoformat()}"


def next_run(
    dag_id: str,
    timetable: Timetable,
    *,
    last: DataInterval | None,
    start_date: dt.datetime | None,
    end_date: dt.datetime | None,
    catchup: bool,
    now: dt.datetime,
) -> NextRun:
    """The next run to store for a DAG, after the run whose interval was ``last``."""
    info = timetable.next_dagrun_info(
        last=last, earliest=start_date, latest=end_date, catchup=catchup, now=now
    )
    return _stored(dag_id, info)


def _stored(dag_id: str, info: DagRunInfo | None) -> NextRun:
    """What ``deferral_dags`` keeps of a DAG's next run (None: it has none)."""
    if info is None:
        return NextRun(dag_id=dag_id, logical_date=None, interval_end=None, create_after=None)
    return NextRun(
        dag_id=dag_id,
        logical_date=info.logical_date,
        interval_end=info.data_interval.end,
        create_after=info.run_after,
    )


def _runs_due(due: DueDag, timetable: Timetable) -> tuple[list[DagRunInfo], NextRun]:
    """The runs to create now for a due DAG (oldest first) and the next one to store."""
    now = due.db_now
    kwargs: dict[str, Any] = {
        "earliest": due.start_date,
        "latest": due.end_date,
        "catchup": due.catchup,
        "now": now,
    }
    stored = DagRunInfo(
        DataInterval(due.next_dagrun_data_interval_start, due.next_dagrun_data_interval_end),
        due.next_dagrun_create_after,
    )
    if not due.catchup:
        # Only the latest complete interval, however long the DAG was paused or the
        # schedulers were down.
        latest = timetable.next_dagrun_info(last=None, **kwargs)
        # (Only a run due by now replaces the stored one: a timetable of the user's own that
        # proposes a later, unended interval must not cost the stored run.)
        if (
            latest is not None
            and latest.logical_date > stored.logical_date
            and latest.run_after <= now
        ):
            stored = latest
    infos: list[DagRunInfo] = []
    info: DagRunInfo | None = stored
    while info is not None and info.run_after <= now and len(infos) < MAX_RUNS_PER_PASS:
        infos.append(info)
        info = timetable.next_dagrun_info(last=info.data_interval, **kwargs)
    return infos, _stored(due.dag_id, info)


async def create_due_runs(store: Store, *, batch: int = DUE_BATCH) -> int:
    """Create the runs whose interval has ended for the DAGs that are due, store each DAG's
    next run, then start the new runs that max_active_runs admits. Returns how many runs were
    created.

    Every due DAG's runs are created before any is started: starting a run creates its task
    instances, which for a batch of DAGs takes as long as creating their runs or longer, and
    the runs of the next batch would wait for it (the scheduling delay is measured to a run's
    creation, as Airflow's ``dagrun.schedule_delay``). A scheduler that stops in between
    leaves queued runs, which the housekeeping's backstop starts.
    """
    created = 0
    due_ids: list[str] = []
    while True:
        async with store.due_dags(batch) as (conn, due):
            if not due:
                break
            runs: list[NewRun] = []
            nexts: list[NextRun] = []
            for dag in due:
                try:
                    timetable = load_timetable(dag.timetable)
                    infos, following = _runs_due(dag, timetable)
                except Exception:  # a bad stored timetable must not stop the other DAGs
                    log.exception("cannot compute the next run of DAG %s", dag.dag_id)
                    nexts.append(_stored(dag.dag_id, None))
                    continue
                nexts.append(following)
                runs.extend(
                    NewRun(
                        dag_id=dag.dag_id,
                        run_id=run_id_for("scheduled", info.logical_date),
                        logical_date=info.logical_date,
                        data_interval_start=info.data_interval.start,
                        data_interval_end=info.data_interval.end,
                        run_type="scheduled",
                    )
                    for info in infos
                )
            inserted = await store.insert_runs(runs, conn)
            await store.set_next_dagruns(nexts, conn)
        created += len(inserted)
        due_ids.extend(d.dag_id for d in due)
        for _, run_id in inserted:
            log.debug("created run %s", run_id)
        if len(due) < batch:
            break
    ordered = sorted(set(due_ids))
    for i in range(0, len(ordered), batch):
        await store.start_queued_runs(ordered[i : i + batch])
    return created


async def manual_data_interval(
    store: Store, dag_id: str, logical_date: dt.datetime
) -> tuple[dt.datetime, dt.datetime, dt.datetime]:
    """A manual run's logical date (aware: a naive one is in the DAG's time zone) and its
    data interval, inferred from the DAG's schedule as Airflow does (the last complete
    interval before it, for a cron schedule)."""
    dag = await store.get_dag(dag_id)
    stored = dag.timetable if dag is not None else None
    when, interval = manual_run_interval(
        load_timetable(stored), stored_timezone(stored), logical_date
    )
    return when, interval.start, interval.end


def backfill_infos(
    timetable: Timetable, start: dt.datetime, end: dt.datetime
) -> Sequence[DagRunInfo]:
    """The runs of a backfill: one per logical date of the schedule in ``[start, end]``."""
    return list(timetable.runs_between(start, end))
