"""Record DAGs in the store, writing only the ones that changed.

What the store keeps of a DAG (its tasks and their edges, its schedule, description, file) is
serialized once per DAG object and hashed: the *fingerprint*, a SHA-256 of that record as
canonical JSON. The DAG bag hands out the same DAG objects for as long as their file is
unchanged (:mod:`engine.dags.dagbag`), so a rescan of an unchanged folder serializes nothing; it
sends the fingerprints in one statement, and only the DAGs whose row is missing, inactive or
holds another fingerprint are written. A DAG of 5,000 tasks is serialized and sent (about
a megabyte) when its file changed, not at every rescan.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from engine.dags.timetables import DataInterval
from engine.runtime.retry import REFUSED_DATA_ERRORS
from engine.scheduler.dagruns import next_run
from engine.store.assets import AssetConflict
from engine.store.models import AssetRecord, NextRun

if TYPE_CHECKING:
    from engine.dags.dag import DAG
    from engine.store import Store

__all__ = ["DagRecord", "DagRecorder", "record_dags", "serialize_dag"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DagRecord:
    """What the store keeps of one DAG, and its hash."""

    dag_id: str
    fileloc: str
    tasks: list[dict[str, Any]]
    description: str | None
    schedule: dict[str, Any]
    fingerprint: str
    #: The assets it uses (DAG.serialize_assets).
    assets: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def serialize_dag(dag: DAG) -> DagRecord:
    """Serialize a DAG for the store and hash the result (dict keys sorted: the same DAG
    always gives the same hash)."""
    tasks = dag.serialize_tasks()
    schedule = dag.serialize_schedule()
    assets = dag.serialize_assets()
    canonical = msgspec.json.encode(
        [dag.dag_id, dag.fileloc, tasks, dag.description, schedule, *([assets] if assets else [])],
        order="deterministic",
    )
    return DagRecord(
        dag_id=dag.dag_id,
        fileloc=dag.fileloc,
        tasks=tasks,
        description=dag.description,
        schedule=schedule,
        fingerprint=hashlib.sha256(canonical).hexdigest(),
        assets=assets,
    )


class DagRecorder:
    """Records DAGs, remembering each DAG object's fingerprint (one recorder per DAG bag: the
    scheduler keeps one for its folder)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        #: The fingerprint of each DAG object seen last, by DAG id.
        self._known: dict[str, tuple[DAG, str]] = {}
        #: DAGs serialized (a new or changed DAG object) and DAG rows written: for tests and
        #: introspection.
        self.serialized = 0
        self.written = 0
        #: DAG rows the database refused to store (bad data, logged).
        self.refused = 0

    async def record(self, dags: Iterable[DAG]) -> int:
        """Record the DAGs (those whose row differs); for those new or whose schedule changed,
        compute the next scheduled run again. Returns how many DAGs were given."""
        given = list(dags)
        # Serializing a big DAG takes tens of milliseconds: off the event loop.
        fresh = await anyio.to_thread.run_sync(self._serialize_new, given)
        fingerprints = {
            dag.dag_id: fresh[dag.dag_id].fingerprint
            if dag.dag_id in fresh
            else self._known[dag.dag_id][1]
            for dag in given
        }
        for dag in given:
            self._known[dag.dag_id] = (dag, fingerprints[dag.dag_id])
        for gone in set(self._known) - set(fingerprints):
            del self._known[gone]
        stale = await self.store.dags_to_record(fingerprints) if fingerprints else set()
        # A row changed by someone else (another scheduler, a restored database) for a DAG
        # object that did not change here: serialized again (rare).
        again = [dag for dag in given if dag.dag_id in stale and dag.dag_id not in fresh]
        if again:
            fresh.update(await anyio.to_thread.run_sync(self._serialize, again))
        await self._write([fresh[dag.dag_id] for dag in given if dag.dag_id in stale], given)
        return len(given)

    def _serialize_new(self, dags: Sequence[DAG]) -> dict[str, DagRecord]:
        return self._serialize([d for d in dags if self._known.get(d.dag_id, (None,))[0] is not d])

    def _serialize(self, dags: Sequence[DAG]) -> dict[str, DagRecord]:
        records = {dag.dag_id: serialize_dag(dag) for dag in dags}
        self.serialized += len(records)
        return records

    async def _write(self, records: Sequence[DagRecord], dags: Sequence[DAG]) -> None:
        by_id = {dag.dag_id: dag for dag in dags}
        changed: list[NextRun] = []
        now: dt.datetime | None = None
        for record in records:
            try:
                reschedule = await self.store.upsert_dag(
                    record.dag_id,
                    record.fileloc,
                    record.tasks,
                    record.description,
                    record.schedule,
                    fingerprint=record.fingerprint,
                )
            except REFUSED_DATA_ERRORS as exc:
                # That DAG only: the others are recorded (it is tried again at the next scan).
                self.refused += 1
                log.error(
                    "DAG %s (%s) cannot be recorded, the database refuses it: %s: %s",
                    record.dag_id,
                    record.fileloc,
                    type(exc).__name__,
                    exc,
                )
                continue
            if not await self._record_assets(record):
                continue
            self.written += 1
            log.debug("recorded DAG %s (%d tasks)", record.dag_id, len(record.tasks))
            if not reschedule:
                continue
            dag = by_id[record.dag_id]
            now = now or await self.store.now()
            last = await self.store.last_scheduled_interval(dag.dag_id)
            changed.append(
                next_run(
                    dag.dag_id,
                    dag.timetable,
                    last=None if last is None else DataInterval(*last),
                    start_date=dag.start_date,
                    end_date=dag.end_date,
                    catchup=dag.catchup,
                    now=now,
                )
            )
        if changed:
            await self.store.set_next_dagruns(changed)
        if records:
            # Watchers of assets a DAG now uses (or no longer uses) start (or stop) at once.
            await sync_watchers(self.store)

    async def _record_assets(self, record: DagRecord) -> bool:
        """Record the assets the DAG uses; False (logged, the DAG written again by the next
        scan) when another DAG declares one of them differently or the database refuses
        them (the DAG's row is already written: its fingerprint is forgotten, so the next
        scan tries again rather than taking the DAG as recorded)."""
        try:
            await self.store.record_dag_assets(
                record.dag_id, [msgspec.convert(a, AssetRecord) for a in record.assets]
            )
        except AssetConflict as exc:
            self.refused += 1
            log.error("DAG %s (%s): %s", record.dag_id, record.fileloc, exc)
            await self.store.forget_dag_fingerprint(record.dag_id)
            return False
        except REFUSED_DATA_ERRORS as exc:
            self.refused += 1
            log.error(
                "DAG %s (%s): its assets cannot be recorded, the database refuses them: %s: %s",
                record.dag_id,
                record.fileloc,
                type(exc).__name__,
                exc,
            )
            await self.store.forget_dag_fingerprint(record.dag_id)
            return False
        return True


async def record_dags(store: Store, dags: Iterable[DAG]) -> int:
    """Record the DAGs' structure and schedule (those whose row differs); for those new or
    whose schedule changed, compute the next scheduled run again. Returns how many DAGs were
    given. A scheduler keeps one :class:`DagRecorder` for its folder instead, which remembers
    what it serialized."""
    return await DagRecorder(store).record(dags)


async def sync_watchers(store: Store) -> None:
    """Start the watchers of the assets the active DAGs use, stop the others (their trigger
    rows, engine/store/watchers.py); a failure is logged, the scheduler's duty tries again."""
    try:
        done = await store.sync_watchers()
    except Exception as exc:
        log.warning(
            "could not sync the asset watchers (%s: %s); trying later", type(exc).__name__, exc
        )
        return
    if done.started or done.stopped:
        log.info("asset watchers: %d started, %d stopped", done.started, done.stopped)
