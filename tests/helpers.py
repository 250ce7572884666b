"""Test helpers: condition waits, child process environments. (The engine itself runs in a
test through the public harness, ``engine.testing.run_engine``.)"""

from __future__ import annotations

import datetime as dt
import itertools
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import asyncpg

from engine.store import ClaimedTask, Deferral, Store
from engine.store.models import FiredTriggers

#: The test triggers live in tests/, outside the built-in ``triggers.*`` of the allow-list.
TEST_TRIGGER_ALLOW = "triggers.*,tests.*"

#: Upper bound for any wait in a test; pytest-timeout is the outer guard.
WAIT_S = 30.0
REPO_ROOT = Path(__file__).resolve().parent.parent


async def wait_until(
    condition: Callable[[], Awaitable[bool]], *, timeout_s: float = WAIT_S, what: str = ""
) -> None:
    """Wait for a condition (re-checked every few ms); fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition}")
        await anyio.sleep(0.01)


def fired_summary(fired: FiredTriggers) -> tuple[set[int], int]:
    """What ``Store.fire_triggers`` wrote: the accepted trigger ids, how many tasks moved."""
    return set(fired.accepted), len(fired.moved)


def free_port() -> int:
    """A TCP port free on the loopback address now (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def child_env(*, test_triggers: bool = True, **settings: str) -> dict[str, str]:
    """The environment of an engine child process in a test: this process's environment
    without its ``DEFERRAL_*`` variables, plus the test key, the repository on ``PYTHONPATH``,
    an allow-list that admits the test triggers (unless ``test_triggers=False``: the default
    list, built-ins and DAGs folder modules), and ``settings`` (``DEFERRAL_<NAME>`` values by
    upper-case name, e.g. ``DATABASE_URL=...``)."""
    from tests.conftest import TEST_FERNET_KEY

    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFERRAL_")}
    env.update(
        DEFERRAL_FERNET_KEY=TEST_FERNET_KEY,
        # No fixed metrics ports (standalone's default): tests of several sessions share the
        # machine. A test that wants them passes --metrics-port with a free port.
        DEFERRAL_METRICS_PORT="0",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    )
    if test_triggers:
        env["DEFERRAL_TRIGGER_ALLOW"] = TEST_TRIGGER_ALLOW
    env.update({f"DEFERRAL_{name}": value for name, value in settings.items()})
    return env


_dag_numbers = itertools.count()


def _noop() -> None:
    return None


def never_deferral(tag: str) -> Deferral:
    """A deferral on a trigger that never fires (``tag`` tells triggers apart)."""
    from tests.triggers_for_tests import NeverTrigger
    from triggers.base import encode_value, validate_trigger

    trigger = validate_trigger(NeverTrigger(tag))
    return Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name="resume",
        method_kwargs=encode_value({}),
        timeout_s=None,
    )


def defer_args(
    store: Store, worker: int, deferrals: list[tuple[int, Deferral]]
) -> tuple[object, ...]:
    """The arguments Store.defer_tasks gives the defer_tasks statement (kwargs encrypted, the
    keyed dedup hash): for a test that runs it on a connection of its own (in a transaction it
    holds open)."""
    keys = store.keyring
    ds = [d for _, d in deferrals]
    return (
        [ti_id for ti_id, _ in deferrals],
        worker,
        [d.classpath for d in ds],
        [keys.encrypt(d.kwargs) for d in ds],
        [keys.dedup_key(d.classpath, d.kwargs, d.dedup_key) for d in ds],
        [d.timeout_s for d in ds],
        [d.method_name for d in ds],
        [keys.encrypt(d.method_kwargs) for d in ds],
        [d.try_number for d in ds],
        [d.line for d in ds],
    )


async def claimed_tasks(
    store: Store, n: int, prefix: str = "claimed"
) -> tuple[str, int, list[ClaimedTask]]:
    """A new DAG of ``n`` independent tasks, one run, every task claimed by a new worker:
    ``(dag_id, worker id, the claimed tasks by id)``."""
    from engine.dags.dag import DAG
    from operators.python import PythonOperator

    dag_id = f"{prefix}_{next(_dag_numbers)}"
    # A pool of their own, as large as the batch: default_pool (128 slots) would admit fewer.
    await store.set_pool(dag_id, n)
    with DAG(dag_id=dag_id) as dag:
        for i in range(n):
            PythonOperator(task_id=f"t{i}", python_callable=_noop, pool=dag_id)
    await store.upsert_dag(dag_id, f"{dag_id}.py", dag.serialize_tasks(), None)
    await store.create_dag_run(dag_id, "r1", logical_date=await store.now())
    worker = await store.register_worker("test", 1, n)
    # (Claims what earlier tests in this database resumed too: keeps this DAG's tasks only.)
    claimed = [
        ti for ti in (await store.claim_tasks(worker, 10_000)).claimed if ti.dag_id == dag_id
    ]
    assert len(claimed) == n
    return dag_id, worker, sorted(claimed, key=lambda ti: ti.id)


async def waiting_on_locks(watch: asyncpg.Connection, n: int = 1) -> bool:
    """Whether at least ``n`` other sessions of the database wait for a lock."""
    waiting = await watch.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'"
    )
    return bool(waiting >= n)
