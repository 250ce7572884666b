"""Test JobDoneTrigger on its own, with no engine and no database: the tutorial's step 2.

Starts the job API on a free port, submits a job that finishes at once, and runs the trigger
with the authoring kit, which also proves it serializes and never blocks the loop.
Run: ``python docs/examples/check_trigger.py`` (from the repository root).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))  # what --dags does for the engine

from job_api import make_app
from submit_and_wait import JobDoneTrigger

from engine.testing import assert_serializable, run_trigger


async def main() -> None:
    runner = web.AppRunner(make_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    os.environ["DEFERRAL_CONN_JOBS_API"] = f"http://127.0.0.1:{port}"
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"http://127.0.0.1:{port}/jobs", json={"command": "hello", "duration_s": 0}
            ) as response,
        ):
            job_id = (await response.json())["job_id"]

        trigger = JobDoneTrigger(job_id, poll_interval=0.1)
        assert_serializable(trigger)  # it can travel to a triggerer
        event = await run_trigger(trigger, timeout=10)  # first event, or a clear error
        print(event.payload)
        assert event.payload == {"job_id": job_id, "output": "hello: ok"}
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
