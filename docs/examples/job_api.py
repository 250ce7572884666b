"""A tiny HTTP job API for the submit-and-wait example (in memory, on 127.0.0.1).

``POST /jobs {"command": ..., "duration_s": 2}`` starts a job and answers ``{"job_id": ...}``;
``GET /jobs/<id>`` answers ``{"state": "running" | "done" | "failed", "output": ...}``. A job
finishes ``duration_s`` seconds after it was submitted, or, with ``"duration_s": null``, when
someone calls ``POST /jobs/<id>/finish {"state": "done" | "failed"}`` (what the tests do).

Run it on its own with ``python docs/examples/job_api.py [PORT]`` (default 8080).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from aiohttp import web

__all__ = ["make_app"]


def make_app() -> web.Application:
    jobs: dict[str, dict[str, Any]] = {}

    def current(job: dict[str, Any]) -> dict[str, Any]:
        due = job["due"]
        if job["state"] == "running" and due is not None and time.monotonic() >= due:
            job["state"] = "done"
        return {"job_id": job["job_id"], "state": job["state"], "output": job_output(job)}

    def job_output(job: dict[str, Any]) -> str | None:
        return f"{job['command']}: ok" if job["state"] == "done" else None

    async def submit(request: web.Request) -> web.Response:
        body = await request.json()
        job_id = f"job-{len(jobs) + 1}"
        duration = body.get("duration_s", 2.0)
        jobs[job_id] = {
            "job_id": job_id,
            "command": str(body.get("command", "")),
            "state": "running",
            "due": None if duration is None else time.monotonic() + float(duration),
        }
        return web.json_response({"job_id": job_id}, status=201)

    async def status(request: web.Request) -> web.Response:
        job = jobs.get(request.match_info["job_id"])
        if job is None:
            return web.json_response({"error": "no such job"}, status=404)
        return web.json_response(current(job))

    async def finish(request: web.Request) -> web.Response:
        job = jobs[request.match_info["job_id"]]
        job["state"] = (await request.json()).get("state", "done")
        return web.json_response(current(job))

    app = web.Application()
    app.router.add_post("/jobs", submit)
    app.router.add_get("/jobs/{job_id}", status)
    app.router.add_post("/jobs/{job_id}/finish", finish)
    return app


if __name__ == "__main__":
    web.run_app(make_app(), host="127.0.0.1", port=int(sys.argv[1]) if len(sys.argv) > 1 else 8080)
