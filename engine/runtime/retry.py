"""Keep a database write going through a lost connection or a restarting server."""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
import asyncpg

from engine.runtime import metrics

__all__ = [
    "CONNECTION_ERRORS",
    "REFUSED_DATA_ERRORS",
    "TRANSIENT_ERRORS",
    "Backoff",
    "with_db_retry",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Errors after which the same statement may succeed if tried again: the connection or the
#: server, not the statement's data (a shutdown, a cancelled query, no connection slot or
#: memory left, a standby reached during a failover, a conflict between transactions).
#: ``InternalClientError`` is what asyncpg raises for a connection killed in the middle of an
#: operation ("cannot switch to state ...; another operation is in progress"): the pool drops
#: that connection, and the next try gets another.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.OperatorInterventionError,  # admin shutdown, cannot connect now, query canceled
    asyncpg.InsufficientResourcesError,  # too many connections, disk full, out of memory
    asyncpg.ReadOnlySQLTransactionError,
    asyncpg.SerializationError,
    asyncpg.DeadlockDetectedError,
)

#: The part of TRANSIENT_ERRORS that says the connection itself is gone or unusable (a
#: statement that timed out is not counted: the connection stays usable).
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    ConnectionError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.AdminShutdownError,
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

#: First and largest pause between tries, in seconds.
FIRST_DELAY_S = 0.05
MAX_DELAY_S = 5.0


class Backoff:
    """Growing, jittered pauses after failures; ``reset()`` after a success.

    Jitter (a uniform draw in [delay/2, delay]) keeps a fleet of processes that lost the
    database at the same moment from reconnecting in lock step."""

    def __init__(self, *, first_s: float = FIRST_DELAY_S, max_s: float = MAX_DELAY_S) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self._next = first_s

    def reset(self) -> None:
        self._next = self.first_s

    def next_delay(self) -> float:
        delay = random.uniform(self._next / 2, self._next)
        self._next = min(self._next * 2, self.max_s)
        return delay

    async def wait(self, what: str, exc: BaseException) -> None:
        metrics.current().count_db_error(exc)
        delay = self.next_delay()
        log.warning("%s failed (%s: %s); retrying in %.2fs", what, type(exc).__name__, exc, delay)
        await anyio.sleep(delay)


async def with_db_retry(
    what: str,
    call: Callable[[], Awaitable[T]],
    *,
    attempts: int | None = None,
    max_delay_s: float = MAX_DELAY_S,
) -> T:
    """Run ``call`` until it succeeds, backing off (jittered) after transient errors.

    ``attempts=None`` tries until cancelled: used for writes that must not be dropped
    (an event, a task's outcome), whose loss would only be repaired by a lease or reaper.
    """
    backoff = Backoff(max_s=max_delay_s)
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except TRANSIENT_ERRORS as exc:
            if attempts is not None and attempt >= attempts:
                raise
            await backoff.wait(what, exc)
