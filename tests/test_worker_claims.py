"""How a worker claims a backlog: in statements of at most ``claim_batch`` task instances."""

from __future__ import annotations

from typing import Any

import pytest

from engine import DAG
from engine.config import DEFAULT_WORKER_CLAIM_BATCH
from engine.store import Store
from engine.testing import run_engine
from engine.worker.config import WorkerConfig
from operators.python import PythonOperator
from tests.helpers import wait_until

pytestmark = pytest.mark.anyio


def _ok() -> str:
    return "ok"


def _spy_claims(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(limit asked, task instances claimed) of every claim of tasks on ``store``."""
    claims: list[tuple[int, int]] = []
    claim_tasks = store.claim_tasks

    async def spied(worker_id: int, limit: int, **kwargs: Any) -> Any:
        claim = await claim_tasks(worker_id, limit, **kwargs)
        claims.append((limit, len(claim.claimed)))
        return claim

    monkeypatch.setattr(store, "claim_tasks", spied)
    return claims


@pytest.mark.parametrize("batch", [None, 5])
async def test_a_backlog_is_claimed_in_batches_and_all_of_it_runs(
    store: Store, monkeypatch: pytest.MonkeyPatch, batch: int | None
) -> None:
    """With more slots free than a batch and more runnable than a batch, each claim asks for
    one batch and the next follows at once: everything runs, no claim took more."""
    size = DEFAULT_WORKER_CLAIM_BATCH if batch is None else batch
    n = 2 * size + 3
    dag_id = f"claim_batches_{size}"
    with DAG(dag_id=dag_id) as dag:
        for i in range(n):
            PythonOperator(task_id=f"t{i}", python_callable=_ok)
    claims = _spy_claims(store, monkeypatch)
    options = {} if batch is None else {"claim_batch": batch}
    async with run_engine(store, slots=n + 10, worker_options=options) as engine:
        await engine.start_run(dag)

        async def all_ended() -> bool:
            tis = await store.list_task_instances(dag_id=dag_id)
            return len(tis) == n and all(ti.state == "success" for ti in tis)

        await wait_until(all_ended, what=f"the {n} tasks to succeed")
        assert engine.worker.claim_batch == size
    taken = [got for _, got in claims if got]
    assert sum(taken) == n
    assert max(limit for limit, _ in claims) <= size
    assert len(taken) >= 3  # (n is more than two batches)


def test_claim_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="claim_batch must be >= 1, got 0"):
        WorkerConfig(claim_batch=0)
