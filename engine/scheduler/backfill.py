"""``deferral dags backfill``: runs for past logical dates of a DAG's schedule.

One run per logical date of the schedule in ``[start, end]`` (both ends inclusive), of type
``backfill``, created while fewer than ``max_active_runs`` of the backfill's runs are queued or
running. A date that already has a run is left alone unless the reprocess behaviour says to
run it again (``failed``: the failed ones; ``completed``: every ended one). The unique index
on ``(dag_id, logical_date)`` makes a backfill resumable: run it again after an interruption
and it creates only the runs still missing (with ``none``), never a second run of a date.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Literal

import anyio
import msgspec

from engine.dags.timetables import DagRunInfo, load_timetable, stored_timezone, to_aware
from engine.runtime.wakeup import Wakeup
from engine.scheduler.dagruns import run_id_for
from engine.store import CHANNEL_RUNS, Store, UnknownDag
from engine.store.models import NewRun, RunRow

__all__ = ["REPROCESS", "BackfillProgress", "backfill"]

Reprocess = Literal["none", "failed", "completed"]
REPROCESS: tuple[Reprocess, ...] = ("none", "failed", "completed")
_ENDED = ("success", "failed")


class BackfillProgress(msgspec.Struct, kw_only=True):
    """Where a backfill is: runs planned, created (or queued again), ended, failed, and the
    dates left alone because a run exists."""

    total: int = 0
    created: int = 0
    skipped: int = 0
    ended: int = 0
    failed: int = 0


def _reprocess(run: RunRow, behaviour: Reprocess) -> bool:
    if behaviour == "completed":
        return run.state in _ENDED
    if behaviour == "failed":
        return run.state == "failed"
    return False


async def backfill(
    store: Store,
    dag_id: str,
    start: dt.datetime,
    end: dt.datetime,
    *,
    reprocess: Reprocess = "none",
    max_active_runs: int | None = None,
    wait: bool = False,
    on_progress: Callable[[BackfillProgress], None] = lambda _p: None,
    poll_s: float = 1.0,
) -> BackfillProgress:
    """Backfill ``dag_id`` over ``[start, end]`` (naive times are in the DAG's time zone).
    Returns once every run is created (with ``wait``: once every one has ended). Raises
    UnknownDag, or ValueError for a DAG without a schedule or an empty range."""
    dag = await store.get_dag(dag_id)
    if dag is None:
        raise UnknownDag(f"unknown DAG {dag_id!r}: no DAG of that id has been recorded")
    timetable = load_timetable(dag.timetable)
    if not timetable.periodic:
        raise ValueError(f"DAG {dag_id} has no schedule: there are no logical dates to backfill")
    tz = stored_timezone(dag.timetable)
    start, end = to_aware(start, tz), to_aware(end, tz)
    if start > end:
        raise ValueError(f"--start-date {start.isoformat()} is after --end-date {end.isoformat()}")
    limit = max_active_runs or dag.max_active_runs
    infos = list(timetable.runs_between(start, end))
    progress = BackfillProgress(total=len(infos))
    existing: dict[dt.datetime, list[RunRow]] = {}
    for row in await store.runs_at(dag_id, [i.logical_date for i in infos]):
        existing.setdefault(row.logical_date, []).append(row)
    todo: list[tuple[DagRunInfo, RunRow | None]] = []
    # Runs not ended yet (of an interrupted backfill, say): waited for, not created again.
    active: dict[int, dt.datetime] = {}
    for info in infos:
        runs = existing.get(info.logical_date, [])
        if not runs:
            todo.append((info, None))
            continue
        again = [r for r in runs if _reprocess(r, reprocess)]
        if again and all(r.state in _ENDED for r in runs):
            todo.append((info, again[0]))
        else:
            progress.skipped += 1
            active.update((r.id, r.logical_date) for r in runs if r.state not in _ENDED)
    on_progress(progress)
    wake = Wakeup()
    listener = store.listener(CHANNEL_RUNS)
    listener.on_notify(lambda _c, payload: wake.set() if payload.startswith(f"{dag_id} ") else None)
    await listener.ensure_connected()
    try:
        while todo or (wait and active):
            while todo and len(active) < limit:
                info, run = todo.pop(0)
                pk = await _start(store, dag_id, info, run)
                if pk is None:
                    progress.skipped += 1
                else:
                    progress.created += 1
                    active[pk] = info.logical_date
                on_progress(progress)
            if not todo and not wait:
                break
            await wake.wait(poll_s)
            await _collect_ended(store, dag_id, active, progress)
            on_progress(progress)
    finally:
        with anyio.move_on_after(5, shield=True):
            await listener.close()
    return progress


async def _start(store: Store, dag_id: str, info: DagRunInfo, run: RunRow | None) -> int | None:
    """Create the run of one logical date, or queue an ended one again; None when another
    process created that date's run meanwhile."""
    if run is not None:
        if not await store.reset_dag_runs([run.id]):
            return None
        await store.start_queued_runs([dag_id])
        return run.id
    new = NewRun(
        dag_id=dag_id,
        run_id=run_id_for("backfill", info.logical_date),
        logical_date=info.logical_date,
        data_interval_start=info.data_interval.start,
        data_interval_end=info.data_interval.end,
        run_type="backfill",
    )
    try:
        created = await store.create_queued_run(new)
    except ValueError:
        return None
    return None if created is None else created[0]


async def _collect_ended(
    store: Store, dag_id: str, active: dict[int, dt.datetime], progress: BackfillProgress
) -> None:
    if not active:
        return
    for row in await store.runs_at(dag_id, sorted(set(active.values()))):
        if row.id in active and row.state in _ENDED:
            del active[row.id]
            progress.ended += 1
            progress.failed += row.state == "failed"
