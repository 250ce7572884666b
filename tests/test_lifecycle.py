"""Lifecycle: a ``stop()`` that arrives before ``run()`` is not lost (the worker and the
scheduler start, see it and return; nothing is claimed), and one that arrives while the
scheduler registers leaves no row behind."""

from __future__ import annotations

import os

import anyio
import asyncpg
import pytest

from engine import DAG
from engine.dags.dagbag import DagBag
from engine.scheduler.scheduler import Scheduler
from engine.security.keys import Keyring
from engine.store import Store
from engine.worker.worker import Worker
from operators.python import PythonOperator
from tests.conftest import TEST_FERNET_KEY
from tests.helpers import WAIT_S, wait_until
from tests.pg_proxy import PgProxy

pytestmark = pytest.mark.anyio


def _noop() -> None:
    return None


async def test_a_worker_stopped_before_run_returns_and_claims_nothing(store: Store) -> None:
    with DAG(dag_id="early") as dag:
        PythonOperator(task_id="t", python_callable=_noop)
    bag = DagBag(None)
    bag.add_dag(dag)
    await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
    await store.create_dag_run("early", "r1", logical_date=await store.now())
    worker = Worker(store, bag, slots=1, poll_interval_s=0.05)
    worker.stop()
    # A lost stop() would leave run() claiming and running forever: the guard fails the test.
    with anyio.fail_after(WAIT_S):
        await worker.run()
    (ti,) = await store.list_task_instances(dag_id="early")
    assert ti.state == "scheduled"
    assert worker.finished == 0


async def test_a_scheduler_stopped_before_run_returns(store: Store) -> None:
    scheduler = Scheduler(store, None, interval_s=0.05)
    scheduler.stop()
    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tg:
            await tg.start(scheduler.run)
    assert scheduler.housekeeping_passes == 0


_ONE_ROW_COMMITTED = b"s\x00\x00\x00\x04Z\x00\x00\x00\x05I"


async def test_a_scheduler_stopped_while_it_registers_unregisters(db_url: str) -> None:
    """stop() lands when the scheduler's INSERT into deferral_schedulers has committed and its
    reply is on the way (held by a proxy): the scheduler still learns its id and removes its
    row on the way out. (Cut short, the attempt left the row on the status page for an hour,
    until another scheduler's heartbeat duty dropped it.)"""
    count = "SELECT count(*) FROM deferral_schedulers"
    proxy = PgProxy(db_url)
    conn = await asyncpg.connect(db_url)
    try:
        async with proxy.running():
            store = await Store.connect(proxy.url, pool_size=2, keyring=Keyring([TEST_FERNET_KEY]))
            try:
                scheduler = Scheduler(store, None, interval_s=0.05)
                # The registration is the first one-row reply from here on (its LISTENs come
                # before it, the contact probe after it): asyncpg's fetchval, answered by the
                # row, PortalSuspended ('s') and ReadyForQuery idle ('Z', 'I': committed).
                proxy.hold_reply_containing(_ONE_ROW_COMMITTED)
                with anyio.fail_after(WAIT_S):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(scheduler.run)

                        async def committed() -> bool:
                            return bool(await conn.fetchval(count))

                        await wait_until(committed, what="the scheduler's row to be committed")
                        scheduler.stop()
                        proxy.release_reply()
            finally:
                await store.close()
        assert await conn.fetchval(count) == 0
        assert scheduler.id is not None  # (its row was the one removed)
    finally:
        await conn.close()


async def test_an_engine_process_writes_no_configuration_into_the_environment(
    store: Store, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_component (what ``deferral triggerer`` runs) hands the database and
    default_deferrable to the code it runs explicitly; os.environ stays as it was."""
    from engine.config import load_settings
    from engine.launch.app import run_component
    from tests.conftest import TEST_FERNET_KEY
    from tests.helpers import wait_until

    for name in ("DEFERRAL_CONN_DEFERRAL", "DEFERRAL_DEFAULT_DEFERRABLE"):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    settings = load_settings(
        {
            "DEFERRAL_DATABASE_URL": db_url,
            "DEFERRAL_FERNET_KEY": TEST_FERNET_KEY,
            "DEFERRAL_DEFAULT_DEFERRABLE": "true",
        }
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_component, "triggerer", settings)

        async def registered() -> bool:
            return bool(await store.list_triggerers())

        await wait_until(registered, what="the triggerer to register")
        assert dict(os.environ) == before
        tg.cancel_scope.cancel()
