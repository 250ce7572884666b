"""A trigger the database says a triggerer owns, but that runs nowhere in it, is given back
and claimed again, so its task still resumes."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from engine import DAG
from engine.store import Store
from engine.testing import run_engine
from tests.helpers import wait_until
from tests.test_engine import Deferrer
from tests.triggers_for_tests import FileTrigger, release_file

pytestmark = pytest.mark.anyio


async def test_an_owned_trigger_that_runs_nowhere_is_released_and_claimed_again(
    store: Store, tmp_path: Path
) -> None:
    landing = tmp_path / "landing"
    with DAG(dag_id="leak") as dag:
        Deferrer(task_id="wait", tag=uuid.uuid4().hex, trigger=FileTrigger(str(landing)))
    async with run_engine(store, lease_s=1.5) as engine:
        triggerer = engine.triggerer
        await engine.start_run(dag)

        async def held() -> bool:
            return len(triggerer.held) == 1

        await wait_until(held, what="the triggerer to hold the trigger")
        (trigger_id,) = triggerer.held
        # Lose the trigger in memory only, as a bug would: the row still names this triggerer.
        triggerer._drop(trigger_id)
        assert trigger_id not in triggerer.held
        owned = await store.owned_triggers(triggerer.id or 0)
        assert trigger_id in owned

        async def running_again() -> bool:
            return trigger_id in triggerer.held

        await wait_until(running_again, what="the lease check to release and re-claim it")
        release_file(landing, "here")
        tis = await engine.finish("leak", "run1")
    assert tis["__run__"]["state"] == "success"
    assert tis["wait"]["try_number"] == 1
