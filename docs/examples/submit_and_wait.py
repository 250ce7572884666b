"""Submit a job to an HTTP job API, free the worker slot while it runs, resume with its output.

A DAG file: put this folder in ``--dags`` and the engine imports it as module
``submit_and_wait``, which is also how the triggerer finds ``JobDoneTrigger``.
The API's address comes from the connection ``jobs_api``
(``DEFERRAL_CONN_JOBS_API=http://127.0.0.1:8080``), so no URL or token sits in the trigger.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from engine import DAG, task
from operators.base import BaseOperator, Context
from triggers.base import BaseTrigger, TaskFailedEvent, TriggerEvent
from triggers.connections import resolve_url

JOBS_CONN = "jobs_api"


# -- the trigger: waits on the triggerer, async all the way ----------------------------------
class JobDoneTrigger(BaseTrigger):
    """Fires when job ``job_id`` is done (payload: its output); fails the task if it failed."""

    def __init__(self, job_id: str, *, conn_id: str = JOBS_CONN, poll_interval: float = 5.0):
        self.job_id = job_id
        self.conn_id = conn_id
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{__name__}.JobDoneTrigger",
            {"job_id": self.job_id, "conn_id": self.conn_id, "poll_interval": self.poll_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        url = f"{resolve_url(self.conn_id).rstrip('/')}/jobs/{self.job_id}"
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(url) as response:
                    response.raise_for_status()
                    job = await response.json()
                if job["state"] == "done":
                    yield TriggerEvent({"job_id": self.job_id, "output": job["output"]})
                    return
                if job["state"] == "failed":
                    self.log.warning("job %s failed", self.job_id)  # names the trigger id
                    yield TaskFailedEvent(f"job {self.job_id} failed")  # no worker hop
                    return
                await asyncio.sleep(self.poll_interval)


# -- the operator: submits on a worker, then hands the wait over -----------------------------
class SubmitJob(BaseOperator):
    """Submits ``command`` and waits (deferred, holding no slot) until the job is done."""

    def __init__(
        self,
        *,
        command: str,
        duration_s: float | None = 2.0,
        conn_id: str = JOBS_CONN,
        poll_interval: float = 5.0,
        wait_timeout: float = 3600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.command = command
        self.duration_s = duration_s
        self.conn_id = conn_id
        self.poll_interval = poll_interval
        self.wait_timeout = wait_timeout

    async def execute(self, context: Context) -> None:  # async: runs on the worker's loop
        url = f"{resolve_url(self.conn_id).rstrip('/')}/jobs"
        body = {"command": self.command, "duration_s": self.duration_s}
        async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
            response.raise_for_status()
            job_id = (await response.json())["job_id"]
        self.log.info("submitted %s as %s", self.command, job_id)
        self.defer(
            trigger=JobDoneTrigger(job_id, conn_id=self.conn_id, poll_interval=self.poll_interval),
            method_name="execute_complete",
            timeout=self.wait_timeout,
        )

    def execute_complete(self, context: Context, event: dict[str, Any]) -> str:
        return str(event["output"])  # the task's result


# -- the DAG: the job's output handed to a TaskFlow task ---------------------------------------
@task
def report(output: str, ds: str) -> str:
    return f"{ds}: {output}"


with DAG(dag_id="submit_and_wait") as dag:
    train = SubmitJob(task_id="train", command="train --epochs 3")
    report(train.output)  # runs after train, with its result
