"""Test JobDoneTrigger with pytest and anyio's pytest plugin: the how-to's example.

Run: ``pytest docs/examples/_tests/test_job_trigger.py`` (from the repository root). The
folder starts with ``_``, so the engine does not import it as DAG files when
``docs/examples`` is the DAGs folder.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

# The DAGs folder on sys.path, as the engine puts it (or `pythonpath = ["dags"]` in your
# pytest configuration).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from job_api import make_app
from submit_and_wait import JobDoneTrigger

from engine.testing import TriggerTimedOut, assert_serializable, run_trigger
from triggers.base import TaskFailedEvent

# Every async test of this module runs on anyio's plugin (installed with anyio).
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    """The event loop the tests run on ("asyncio"; parametrize it to run on "trio" too)."""
    return "asyncio"


@pytest.fixture
async def jobs_api(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """The job API on a free port, as the connection ``jobs_api``."""
    runner = web.AppRunner(make_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    monkeypatch.setenv("DEFERRAL_CONN_JOBS_API", base)
    try:
        yield base
    finally:
        await runner.cleanup()


async def submit(base: str, command: str, duration_s: float | None) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base}/jobs", json={"command": command, "duration_s": duration_s}) as r,
    ):
        job_id: str = (await r.json())["job_id"]
        return job_id


async def finish(base: str, job_id: str, state: str) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base}/jobs/{job_id}/finish", json={"state": state}) as r,
    ):
        r.raise_for_status()


def test_it_serializes() -> None:  # a plain test next to the async ones
    assert_serializable(JobDoneTrigger("job-1", poll_interval=1.0))


async def test_it_fires_with_the_output_when_the_job_is_done(jobs_api: str) -> None:
    job_id = await submit(jobs_api, "hello", duration_s=0)
    event = await run_trigger(JobDoneTrigger(job_id, poll_interval=0.05), timeout=10)
    assert event.payload == {"job_id": job_id, "output": "hello: ok"}


async def test_it_waits_while_the_job_runs(jobs_api: str) -> None:
    job_id = await submit(jobs_api, "slow", duration_s=None)  # runs until finished by hand
    with pytest.raises(TriggerTimedOut):
        await run_trigger(JobDoneTrigger(job_id, poll_interval=0.05), timeout=0.5)


async def test_a_failed_job_fails_the_task_and_is_logged(
    jobs_api: str, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = await submit(jobs_api, "doomed", duration_s=None)
    await finish(jobs_api, job_id, "failed")
    with caplog.at_level(logging.WARNING, logger="submit_and_wait.JobDoneTrigger"):
        event = await run_trigger(JobDoneTrigger(job_id, poll_interval=0.05), timeout=10)
    assert isinstance(event, TaskFailedEvent)
    assert f"job {job_id} failed" in caplog.messages
