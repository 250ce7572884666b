"""The triggerer's lifecycle: a ``stop()`` that comes before ``run()`` is not lost."""

from __future__ import annotations

import anyio
import pytest

from engine.store import Store
from engine.triggerer import Triggerer

pytestmark = pytest.mark.anyio


async def test_a_stop_before_run_is_not_lost(store: Store) -> None:
    """stop() before run(): run returns at once (readiness still signalled, so tg.start does
    not fail), registers nothing, claims nothing; a second stop() is harmless."""
    triggerer = Triggerer(store, poll_interval_s=0.2, lease_s=1.5)
    triggerer.stop()
    triggerer.stop()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await tg.start(triggerer.run)
    assert triggerer.id is None
    assert await store.list_triggerers() == []
    assert triggerer.stats()["held"] == 0
