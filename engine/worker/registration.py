"""The worker's row in ``deferral_workers``: registering, the heartbeat's timing, leaving.

The row is what the scheduler watches: a worker whose heartbeats stop is declared dead and
its tries are reaped (retried per their policy). Registering and leaving retry transient
errors; a worker that cannot say it leaves is removed by the scheduler once its heartbeats
stop. What a heartbeat brings back (the requests to stop a try) is the worker's own
business (``worker.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Sequence

from engine.runtime.keepalive import KeepAlive
from engine.runtime.retry import MAX_DELAY_S, TRANSIENT_ERRORS, with_db_retry
from engine.store import Store

__all__ = ["MIN_HEARTBEAT_TIMEOUT_S", "heartbeat_timeout_s", "keepalive", "register", "unregister"]

log = logging.getLogger("engine.worker")  # the process's logger

#: The shortest time a heartbeat gets to be answered (see :func:`heartbeat_timeout_s`).
MIN_HEARTBEAT_TIMEOUT_S = 2.0


def heartbeat_timeout_s(heartbeat_s: float) -> float:
    """How long one heartbeat may wait for its answer: twice the heartbeat interval, at least
    ``MIN_HEARTBEAT_TIMEOUT_S``. Past it the heartbeat is given up, its connection dropped, and
    the next one goes on a fresh connection: a connection that hangs must not keep the worker
    silent until the scheduler reaps its tasks while the database itself answers."""
    return max(2 * heartbeat_s, MIN_HEARTBEAT_TIMEOUT_S)


async def register(
    store: Store,
    slots: int,
    queues: Sequence[str],
    *,
    parallelism: int = 0,
    heartbeat_s: float = 5.0,
    takes_resumes: bool = True,
    retry: bool = True,
) -> int:
    """A new row for this process, which takes the resumes triggerers hand it; its id.
    ``retry``: transient errors are retried (at start; a heartbeat that registers again
    leaves that to the next heartbeat)."""
    call = functools.partial(
        store.register_worker,
        socket.gethostname(),
        os.getpid(),
        slots,
        queues,
        parallelism=parallelism,
        heartbeat_s=heartbeat_s,
        takes_resumes=takes_resumes,
    )
    return await (with_db_retry("register worker", call) if retry else call())


async def unregister(store: Store, worker_id: int) -> None:
    """Remove the row, at a graceful stop; a failure is only logged."""
    try:
        await with_db_retry(
            "unregister worker", functools.partial(store.unregister_worker, worker_id), attempts=5
        )
    except TRANSIENT_ERRORS as exc:
        log.warning(
            "could not unregister worker %s (%s: %s); the scheduler removes it once its "
            "heartbeats stop",
            worker_id,
            type(exc).__name__,
            exc,
        )


def keepalive(beat: Callable[[], Awaitable[None]], heartbeat_s: float) -> KeepAlive:
    """The heartbeat's loop: ``beat`` every ``heartbeat_s``, the first one interval after
    the registration. Retries come at least as often as heartbeats, so a short outage costs
    no reaping."""
    return KeepAlive(
        "heartbeat",
        beat,
        interval_s=heartbeat_s,
        max_backoff_s=min(MAX_DELAY_S, heartbeat_s),
        errors=TRANSIENT_ERRORS,
        first_after_s=heartbeat_s,
    )
