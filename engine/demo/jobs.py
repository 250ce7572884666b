"""The demo's submit-and-wait pieces: a tiny job API, an operator that submits a job, and the
custom trigger that waits for the job to finish."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from operators.base import BaseOperator, Context
from triggers.base import BaseTrigger, TriggerEvent

__all__ = ["JobApi", "JobDoneTrigger", "SubmitAndWait"]


class JobApi:
    """An in-memory job service on 127.0.0.1: ``POST /jobs`` starts a job that finishes after
    the requested duration; ``GET /jobs/<id>`` reports ``running`` or ``done``."""

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[float, float]] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _submit(self, request: web.Request) -> web.Response:
        body = await request.json()
        duration = float(body.get("duration_s", 5.0))
        job_id = f"job-{len(self._jobs) + 1}"
        self._jobs[job_id] = (time.time(), duration)
        return web.json_response({"job_id": job_id}, status=201)

    async def _status(self, request: web.Request) -> web.Response:
        job = self._jobs.get(request.match_info["job_id"])
        if job is None:
            return web.json_response({"error": "no such job"}, status=404)
        started, duration = job
        done = time.time() >= started + duration
        return web.json_response(
            {"state": "done" if done else "running", "finished_at": started + duration}
        )

    async def start(self) -> str:
        app = web.Application()
        app.add_routes([web.post("/jobs", self._submit), web.get("/jobs/{job_id}", self._status)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class JobDoneTrigger(BaseTrigger):
    """Polls the job API until the job is done; the event carries the job's id and end time."""

    def __init__(self, api_url: str, job_id: str, poll_interval: float = 0.5) -> None:
        self.api_url = api_url
        self.job_id = job_id
        self.poll_interval = float(poll_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "engine.demo.jobs.JobDoneTrigger",
            {"api_url": self.api_url, "job_id": self.job_id, "poll_interval": self.poll_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(f"{self.api_url}/jobs/{self.job_id}") as resp:
                    resp.raise_for_status()
                    body = await resp.json()
                if body["state"] == "done":
                    yield TriggerEvent({"job_id": self.job_id, "finished_at": body["finished_at"]})
                    return
                await asyncio.sleep(self.poll_interval)


class SubmitAndWait(BaseOperator):
    """Submits a job, then hands the wait to a triggerer; resumes with the job's outcome."""

    def __init__(self, *, duration_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.duration_s = duration_s

    async def execute(self, context: Context) -> None:
        api_url = context["conf"]["job_api"]
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{api_url}/jobs", json={"duration_s": self.duration_s}) as resp,
        ):
            resp.raise_for_status()
            job_id = (await resp.json())["job_id"]
        self.defer(
            trigger=JobDoneTrigger(api_url, job_id),
            method_name="execute_complete",
            timeout=self.duration_s + 60,
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        return {
            "job_id": event["job_id"],
            "due": event["finished_at"],
            "resumed": time.time(),
        }
