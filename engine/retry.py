"""Keep a database write going through a lost connection or a restarting server."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import asyncpg

__all__ = ["TRANSIENT_ERRORS", "with_db_retry"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Errors after which the same statement may succeed if tried again.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.SerializationError,
    asyncpg.DeadlockDetectedError,
    TimeoutError,
)


async def with_db_retry(
    what: str,
    call: Callable[[], Awaitable[T]],
    *,
    attempts: int | None = None,
    max_delay_s: float = 5.0,
) -> T:
    """Run ``call`` until it succeeds, backing off after transient errors.

    ``attempts=None`` tries until cancelled: used for writes that must not be dropped
    (an event, a task's outcome), whose loss would only be repaired by a lease or reaper.
    """
    delay = 0.05
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except TRANSIENT_ERRORS as exc:
            if attempts is not None and attempt >= attempts:
                raise
            log.warning(
                "%s failed (%s: %s); retrying in %.2fs", what, type(exc).__name__, exc, delay
            )
            await anyio.sleep(delay)
            delay = min(delay * 2, max_delay_s)
