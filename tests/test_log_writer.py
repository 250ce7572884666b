"""The log sink's writer (engine/usercode/logsink.py, through engine/runtime/outbox.py) against
the real database: a line the database refuses takes no other line with it, and the lines of
a trigger that are in a write in flight are stored before its ``flush_keys`` returns (its
event is written after it)."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import asyncpg
import pytest

from engine.store import LogLine, Store
from engine.usercode.logsink import LogSink
from tests.helpers import wait_until

pytestmark = pytest.mark.anyio


async def _task_messages(store: Store, *key: Any) -> list[str]:
    page = await store.task_logs(*key, after_seq=0, limit=10_000)
    return [line.message for line in page.lines]


class _FarFuture(logging.Filter):
    """A user's filter that dates its records past what a timestamp holds."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.created = 1e300
        return True


async def test_a_line_the_database_refuses_takes_no_other_line_with_it(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (Other handlers of this process, pytest's among them, cannot format a time past the end
    # of time either: their "--- Logging error ---" reports on stderr would be the try's lines.)
    monkeypatch.setattr(logging, "raiseExceptions", False)
    sink = LogSink(store, "task")
    bad = logging.getLogger("user.far_future")
    bad.addFilter(_FarFuture())
    sink.open()
    try:
        token = sink.bind_task(1, "d", "r", "a", 1, fresh=True)
        try:
            print("a0")
            print("a1")
            bad.warning("dated past the end of time")
            print("a2")
        finally:
            sink.unbind(token)
        token = sink.bind_task(2, "d", "r", "b", 1, fresh=True)
        try:
            print("b0")
        finally:
            sink.unbind(token)
        await sink.flush()  # (one statement for both tries, before the refusal)
    finally:
        await sink.close()
        bad.filters.clear()
    a = await _task_messages(store, "d", "r", "a", 1)
    assert a[:2] == ["a0", "a1"]
    assert a[2].startswith("1 line dropped (the database refused it: ")
    assert a[3:] == ["a2"]
    assert await _task_messages(store, "d", "r", "b", 1) == ["b0"]
    assert sink.dropped == 1


async def test_a_trigger_s_lines_in_a_write_in_flight_are_stored_before_flush_keys_returns(
    store: Store, db_url: str
) -> None:
    # The periodic write takes trigger 7's line and is held up in its INSERT (the table is
    # locked); then the trigger fires: flush_keys, which runs before its event is written,
    # must not return before that write has stored the line.
    sink = LogSink(store, "trigger")
    sink.open()
    locker = await asyncpg.connect(db_url)
    seen: list[LogLine] = []
    try:
        token = sink.bind_trigger(7)
        try:
            logging.getLogger("user").warning("fired soon")
        finally:
            sink.unbind(token)
        await locker.execute("BEGIN; LOCK TABLE deferral_trigger_logs IN EXCLUSIVE MODE")

        async def insert_waits() -> bool:
            waiting = await locker.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
            return bool(waiting)

        async def fires() -> None:
            await sink.flush_keys([7])
            seen.extend((await store.trigger_logs(7, after_seq=0, limit=100)).lines)

        async with anyio.create_task_group() as tg:
            tg.start_soon(sink.flush)  # the periodic write
            await wait_until(insert_waits, what="the periodic INSERT waiting on the lock")
            tg.start_soon(fires)
            await anyio.wait_all_tasks_blocked()
            await locker.execute("COMMIT")
    finally:
        await locker.close()
        await sink.close()
    assert [line.message for line in seen] == ["fired soon"]


async def test_close_gives_up_on_a_database_that_does_not_answer(store: Store, db_url: str) -> None:
    # A process stopping while the database hangs (its log table locked here: the INSERT
    # waits, no error comes) goes on with its stop: close tries for CLOSE_TIMEOUT_S, then
    # says the lines could not be written, and returns.
    sink = LogSink(store, "trigger")
    sink.open()
    locker = await asyncpg.connect(db_url)
    try:
        token = sink.bind_trigger(8)
        try:
            logging.getLogger("user").warning("at stop")
        finally:
            sink.unbind(token)
        await locker.execute("BEGIN; LOCK TABLE deferral_trigger_logs IN EXCLUSIVE MODE")
        with anyio.move_on_after(60) as deadline:  # (a hang fails the test, not the run)
            await sink.close()
        assert not deadline.cancelled_caught, "close waited on the database for good"
        assert sink.written == 0
    finally:
        await locker.execute("ROLLBACK")
        await locker.close()
