"""A transaction cut short by a cancel (a stopping scheduler, a try's execution_timeout, a
stopping process) is rolled back before its connection goes back to the pool, wherever the
cancel lands: as it begins, or while a statement of it waits. Else asyncpg's pool rolls it back
itself and logs an error ('Resetting connection with an active transaction')."""

from __future__ import annotations

import logging

import anyio
import asyncpg
import pytest

from engine.security.keys import Keyring
from engine.store import Store
from engine.store.core import in_tx
from tests.conftest import TEST_FERNET_KEY
from tests.helpers import WAIT_S, claimed_tasks, wait_until, waiting_on_locks

pytestmark = pytest.mark.anyio

RESET_ERROR = "Resetting connection with an active transaction"


def _reset_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if RESET_ERROR in r.getMessage()]


async def test_a_cancel_that_lands_as_a_transaction_begins_leaves_it_closed(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # One connection: the second acquire waits for the first one's release (and its reset).
    pool = await asyncpg.create_pool(db_url, min_size=1, max_size=1)
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            async with pool.acquire() as conn:
                with anyio.CancelScope() as scope:
                    scope.cancel()  # lands at the transaction's first wait: its BEGIN
                    async with in_tx(conn):
                        await anyio.sleep_forever()
                assert scope.cancelled_caught
            async with pool.acquire() as conn:
                assert not conn.is_in_transaction()
                async with in_tx(conn):  # (a transaction of its own, not a savepoint)
                    assert await conn.fetchval("SELECT count(*) FROM pg_stat_activity") > 0
        assert not _reset_errors(caplog), caplog.text
    finally:
        await pool.close()


async def test_an_override_cancelled_while_it_waits_on_a_lock_is_rolled_back(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A clear (the status page's, the CLI's) waits on a task instance a worker holds; its
    caller goes away (a request cancelled, Ctrl-C). Its transaction is rolled back: the clear
    changed nothing, and the pool logs no error."""
    store = await Store.connect(db_url, pool_size=1, keyring=Keyring([TEST_FERNET_KEY]))
    holder = await asyncpg.connect(db_url)
    try:
        dag_id, _, (ti,) = await claimed_tasks(store, 1)

        async def clear() -> None:
            await store.clear_task(ti.id, who="me")

        with caplog.at_level(logging.ERROR, logger="asyncio"), anyio.fail_after(WAIT_S):
            async with holder.transaction():
                await holder.execute(
                    "SELECT 1 FROM deferral_task_instances WHERE id = $1 FOR UPDATE", ti.id
                )
                async with anyio.create_task_group() as tg:
                    tg.start_soon(clear)
                    await wait_until(
                        lambda: waiting_on_locks(holder), what="the clear to wait on the row"
                    )
                    tg.cancel_scope.cancel()
            # (The pool's one connection: back, and reset, once this answers.)
            (after,) = await store.list_task_instances(dag_id=dag_id)
        assert (after.state, after.try_number) == ("running", 1)
        assert not _reset_errors(caplog), caplog.text
    finally:
        await holder.close()
        await store.close()
