"""Keep a database write going through a lost connection or a restarting server."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import asyncpg

__all__ = ["REFUSED_DATA_ERRORS", "TRANSIENT_ERRORS", "with_db_retry"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Errors after which the same statement may succeed if tried again: the connection or the
#: server, not the statement's data (a shutdown, a cancelled query, no connection slot or
#: memory left, a standby reached during a failover, a conflict between transactions).
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.OperatorInterventionError,  # admin shutdown, cannot connect now, query canceled
    asyncpg.InsufficientResourcesError,  # too many connections, disk full, out of memory
    asyncpg.ReadOnlySQLTransactionError,
    asyncpg.SerializationError,
    asyncpg.DeadlockDetectedError,
)

#: Errors that say the statement's data cannot be stored as it is (a value out of range or
#: with characters the database refuses, a constraint): trying again cannot help.
REFUSED_DATA_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.DataError,
    asyncpg.IntegrityConstraintViolationError,
    asyncpg.ProgramLimitExceededError,
    ValueError,
    TypeError,
    OverflowError,
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
