"""The scheduler: housekeeping that no single completion does.

* ends DAG runs whose tasks are all finished (woken when a leaf task finishes);
* resolves pending tasks that no completion resolved (a backstop);
* reaps task instances whose worker stopped heartbeating (retries apply);
* ends deferrals whose deadline passed while no triggerer was alive to do it;
* frees the triggers of triggerers whose lease expired, drops triggers nobody waits on;
* records the DAGs of its DAGs folder in the store, so ``dags trigger`` finds them.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time

import anyio
from anyio.abc import TaskStatus

from engine.dagbag import DagBag
from engine.retry import TRANSIENT_ERRORS, Backoff, with_db_retry
from engine.store import CHANNEL_FINISHED, Listener, Store
from engine.store.downstream import resolve_all_pending, settle
from engine.wakeup import Wakeup

__all__ = ["Scheduler", "sync_dags"]

log = logging.getLogger(__name__)


async def sync_dags(store: Store, dagbag: DagBag) -> int:
    """Parse the DAGs folder and record every DAG's structure; returns how many."""
    dags = await anyio.to_thread.run_sync(dagbag.collect)
    for dag in dags.values():
        await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), dag.description)
    return len(dags)


class Scheduler:
    def __init__(
        self,
        store: Store,
        dagbag: DagBag | None = None,
        *,
        interval_s: float = 1.0,
        zombie_threshold_s: float = 30.0,
        timeout_backstop_grace_s: float = 5.0,
        dag_sync_interval_s: float = 10.0,
    ) -> None:
        self.store = store
        self.dagbag = dagbag
        self.interval_s = interval_s
        self.zombie_threshold_s = zombie_threshold_s
        self.timeout_backstop_grace_s = timeout_backstop_grace_s
        self.dag_sync_interval_s = dag_sync_interval_s
        self._wake = Wakeup()
        self._stopping = False
        self._orphans_swept_at = -math.inf
        #: Database time at which the scheduler regained contact after losing it (None: it
        #: never lost it). Heartbeats are not counted as missed before then.
        self.contact_since: dt.datetime | None = None
        self._contact_lost = False
        #: Housekeeping passes completed (for tests and introspection).
        self.housekeeping_passes = 0

    def stop(self) -> None:
        """Graceful stop; safe before ``run`` (which then returns at once) and more than once;
        a stopped scheduler stays stopped."""
        self._stopping = True
        self._wake.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # (``_stopping`` is not reset here: a stop() that came before run() must hold.)
        if self.dagbag is not None:
            await self._sync_dags(first=True)
        listener = self.store.listener(CHANNEL_FINISHED)
        listener.on_notify(lambda _channel, _payload: self._wake.set())
        await self._listen(listener)
        task_status.started()
        last_sync = last_housekeeping = time.monotonic()
        backoff = Backoff()
        try:
            while not self._stopping:
                try:
                    if self._contact_lost:
                        self.contact_since = await self.store.now()
                        self._contact_lost = False
                    await self.finish_runs()
                    now = time.monotonic()
                    if now - last_housekeeping >= self.interval_s:
                        last_housekeeping = now
                        await self.housekeeping()
                        await self._listen(listener)
                    if self.dagbag is not None and now - last_sync >= self.dag_sync_interval_s:
                        last_sync = now
                        await sync_dags(self.store, self.dagbag)
                except TRANSIENT_ERRORS as exc:
                    # The workers may have lost the database too: their heartbeats are counted
                    # again only from when contact is back.
                    self._contact_lost = True
                    await backoff.wait("scheduler pass", exc)
                    continue
                backoff.reset()
                await self._wake.wait(self.interval_s)
        finally:
            with anyio.move_on_after(5, shield=True):
                await listener.close()

    async def _sync_dags(self, *, first: bool = False) -> None:
        assert self.dagbag is not None
        dagbag = self.dagbag
        count = await with_db_retry("record DAGs", lambda: sync_dags(self.store, dagbag))
        if first:
            log.info("recorded %d DAG(s) from %s", count, dagbag.folder)
            for path, error in dagbag.import_errors.items():
                log.error("DAG file %s failed to import: %s", path, error.splitlines()[-1])

    @staticmethod
    async def _listen(listener: Listener) -> None:
        try:
            await listener.ensure_connected()
        except TRANSIENT_ERRORS as exc:
            log.warning("cannot LISTEN (%s: %s); polling only for now", type(exc).__name__, exc)

    async def finish_runs(self) -> None:
        for run in await self.store.finish_dag_runs():
            log.info("DAG run %s/%s ended: %s", run.dag_id, run.run_id, run.state)

    async def housekeeping(self) -> None:
        zombies = await self.store.reap_zombie_tasks(
            self.zombie_threshold_s, contact_since=self.contact_since
        )
        await settle(self.store, zombies)
        for row in zombies:
            log.warning("reaped task instance %s of a dead worker (now %s)", row.id, row.state)
        await self.store.reap_triggerers()
        late = await self.store.timeout_deferrals(None, grace_s=self.timeout_backstop_grace_s)
        await settle(self.store, late)
        for row in late:
            log.warning(
                "deferral of task instance %s timed out (no triggerer ended it; now %s)",
                row.id,
                row.state,
            )
        resolved = await resolve_all_pending(self.store)
        if resolved:
            log.info("resolved %d pending task instance(s)", resolved)
        # Orphans are dropped once older than zombie_threshold_s; looking every half of that
        # keeps them at most 1.5 times as long. The look reads every trigger (about 90 ms at
        # 100,000 waiting), which every second was most of the database's idle CPU.
        now = time.monotonic()
        if now - self._orphans_swept_at >= self.zombie_threshold_s / 2:
            self._orphans_swept_at = now
            ownerless = await self.store.release_ownerless_triggers()
            if ownerless:
                log.warning("freed %d trigger(s) owned by no registered triggerer", ownerless)
            orphans = await self.store.delete_orphan_triggers(self.zombie_threshold_s)
            if orphans:
                log.info("dropped %d trigger(s) nobody waits on", orphans)
        if zombies or late or resolved:
            await self.finish_runs()
        self.housekeeping_passes += 1
