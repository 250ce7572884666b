"""Helpers of the sensor and trigger tests: modes, state waits and a local HTTP server on
127.0.0.1 (the engine itself is ``engine.testing.run_engine``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from engine.store import Store, TaskInstance
from tests.helpers import WAIT_S, wait_until

#: Sensor keyword arguments of each way to wait.
MODES: dict[str, dict[str, Any]] = {
    "poke": {"mode": "poke", "deferrable": False},
    "reschedule": {"mode": "reschedule", "deferrable": False},
    "deferrable": {"deferrable": True},
}
#: Short intervals; the timeout only guards against a hang.
FAST: dict[str, Any] = {"poke_interval": 0.02, "timeout": WAIT_S}


async def task_instance(
    store: Store, dag_id: str, task_id: str, run_id: str = "run1"
) -> TaskInstance:
    for ti in await store.list_task_instances(dag_id=dag_id, run_id=run_id):
        if ti.task_id == task_id:
            return ti
    raise AssertionError(f"no task instance {dag_id}/{run_id}/{task_id}")


async def wait_checked_once(store: Store, dag_id: str, task_id: str, mode: str) -> None:
    """Wait until the sensor has checked at least once and is waiting in its mode's way."""

    async def waiting() -> bool:
        ti = await task_instance(store, dag_id, task_id)
        if mode == "poke":
            return bool(ti.state == "running")
        if mode == "reschedule":
            again = ti.started_at and ti.first_try_at and ti.started_at > ti.first_try_at
            return bool(ti.state == "up_for_reschedule" or again)
        return bool(ti.state == "deferred")

    await wait_until(waiting, what=f"{dag_id}.{task_id} waiting in {mode} mode")


@contextlib.asynccontextmanager
async def http_server(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1 at a free port; yields the base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
