"""The built-in event triggers (triggers/events.py), each against a real source: a temp
directory, a PostgreSQL NOTIFY, a local aiohttp server. A "failover" here is a new trigger
built from the same kwargs and started from the cursor of the last event the old one
yielded, as the triggerer does."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from engine.testing import assert_serializable
from tests.helpers import WAIT_S, wait_until
from tests.sensor_helpers import http_server
from triggers.base import (
    BaseEventTrigger,
    Checkpoint,
    CursorEvent,
    TriggerEvent,
    validate_trigger,
)
from triggers.events import DirectoryTrigger, HttpPollTrigger, PostgresNotifyTrigger

pytestmark = pytest.mark.anyio


class Running:
    """One event trigger's run, its events read one at a time with a deadline."""

    def __init__(self, trigger: BaseEventTrigger, cursor: Any = None) -> None:
        trigger.resume_from(cursor)
        self.trigger = trigger
        self.agen: Any = trigger.run()
        self.cursor = cursor

    async def next(self, timeout_s: float = WAIT_S) -> TriggerEvent:
        event: TriggerEvent = await asyncio.wait_for(self.agen.__anext__(), timeout_s)
        if isinstance(event, CursorEvent | Checkpoint):
            self.cursor = event.cursor
        return event

    async def close(self) -> None:
        await self.agen.aclose()
        await self.trigger.cleanup()


def test_event_triggers_survive_the_trip_to_the_triggerer() -> None:
    for trigger in [
        PostgresNotifyTrigger("orders", conn_id="warehouse"),
        PostgresNotifyTrigger("orders", dsn="postgresql://u@h/db"),
        DirectoryTrigger("/data/in", "*.csv", poll_interval=2, use_inotify=False),
        HttpPollTrigger("https://example.org/feed", headers={"A": "1"}, poll_interval=30),
    ]:
        assert_serializable(trigger)
        validate_trigger(trigger)


def test_bad_arguments_are_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="exactly one of conn_id and dsn"):
        PostgresNotifyTrigger("orders")
    with pytest.raises(ValueError, match="exactly one of conn_id and dsn"):
        PostgresNotifyTrigger("orders", conn_id="a", dsn="postgresql://x")
    with pytest.raises(ValueError, match="pattern"):
        DirectoryTrigger("/data", "in/*.csv")
    with pytest.raises(ValueError, match="poll_interval must be positive"):
        HttpPollTrigger("http://x", poll_interval=0)


# -- DirectoryTrigger ---------------------------------------------------------------------------


def _put(folder: Path, name: str, text: str) -> None:
    """Write a file elsewhere and rename it in, as a producer should."""
    tmp = folder / f".{name}.tmp"
    tmp.write_text(text)
    os.replace(tmp, folder / name)


@pytest.mark.parametrize("use_inotify", [True, False], ids=["inotify", "polling"])
async def test_directory_reports_new_and_changed_files_and_resumes_from_its_cursor(
    tmp_path: Path, use_inotify: bool
) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "old.csv").write_text("there before")
    poll = 3600.0 if use_inotify else 0.05  # with inotify, a change must wake it at once

    def trigger() -> DirectoryTrigger:
        return DirectoryTrigger(str(folder), "*.csv", poll_interval=poll, use_inotify=use_inotify)

    run = Running(trigger())
    first = await run.next()
    assert isinstance(first, Checkpoint)  # the files already there are seen, not events
    _put(folder, "a.csv", "1")
    (folder / "ignored.txt").write_text("other pattern")
    event = await run.next()
    assert isinstance(event, CursorEvent)
    assert event.payload["name"] == "a.csv"
    assert event.payload["path"] == str(folder / "a.csv")
    assert event.payload["size"] == 1
    _put(folder, "a.csv", "22")  # changed
    event = await run.next()
    assert (event.payload["name"], event.payload["size"]) == ("a.csv", 2)
    await run.close()

    # Down: files arrive and one changes while nobody watches.
    _put(folder, "b.csv", "333")
    _put(folder, "old.csv", "changed while down")
    again = Running(trigger(), run.cursor)
    names = {(await again.next()).payload["name"] for _ in range(2)}
    assert names == {"b.csv", "old.csv"}
    _put(folder, "c.csv", "4")
    event = await again.next()
    assert event.payload["name"] == "c.csv"  # nothing recorded before came again
    await again.close()


async def test_directory_triggers_of_one_loop_share_one_inotify_instance(tmp_path: Path) -> None:
    """A process has 128 inotify instances by default and a triggerer runs thousands of
    watchers: the DirectoryTriggers of one loop share one instance, one watch a directory."""
    from triggers.events import _SharedInotify

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    runs = [
        Running(DirectoryTrigger(str(folder), poll_interval=3600.0)) for folder in (one, one, two)
    ]
    for run in runs:
        assert isinstance(await run.next(), Checkpoint)
    shared = _SharedInotify.of_loop()
    assert shared is not None
    assert sorted(shared.watches) == sorted([str(one), str(two)])
    _put(one, "x", "1")
    assert [(await run.next()).payload["name"] for run in runs[:2]] == ["x", "x"]
    # The first trigger of "one" goes: the second is still woken.
    await runs[0].close()
    assert str(one) in shared.watches
    _put(one, "y", "1")
    _put(two, "z", "1")
    assert (await runs[1].next()).payload["name"] == "y"
    assert (await runs[2].next()).payload["name"] == "z"
    for run in runs[1:]:
        await run.close()
    assert shared.watches == {}
    # A watched directory removed: its trigger raises, for the watcher to show and restart it.
    gone = tmp_path / "gone"
    gone.mkdir()
    run = Running(DirectoryTrigger(str(gone), poll_interval=3600.0))
    await run.next()
    gone.rmdir()
    with pytest.raises(FileNotFoundError):
        await run.next()
    await run.close()


async def test_directory_that_does_not_exist_raises(tmp_path: Path) -> None:
    run = Running(DirectoryTrigger(str(tmp_path / "missing"), use_inotify=False))
    with pytest.raises(FileNotFoundError):
        await run.next()
    await run.close()


_files = st.lists(
    st.tuples(st.integers(0, 5), st.sampled_from("abcdef"), st.integers(0, 3)),
    unique_by=lambda f: f[1],
    max_size=6,
)


@given(before=_files, after=_files, stop_after=st.integers(0, 6))
def test_directory_cursor_never_repeats_nor_skips_a_file_state(
    before: list[tuple[int, str, int]], after: list[tuple[int, str, int]], stop_after: int
) -> None:
    """Whatever the change times (equal ones included) and wherever a run stops, a run from
    the last cursor yields exactly the file states the stopped run had not yielded."""
    trigger = DirectoryTrigger("/d", use_inotify=False)
    margin = 100_000_000
    second = 1_000_000_000
    first_look = [(c * second, n, s, 0) for c, n, s in before]
    cursor: dict[str, Any] = {"before": 0, "seen": []}
    events = trigger._events(cursor, 6 * second + margin, first_look)
    assert [(e.payload["name"]) for e in events] == [n for _, n, _, _ in sorted(first_look)]
    done = events[:stop_after]
    if done:
        cursor = done[-1].cursor  # type: ignore[assignment]
    # Later, some files changed (a later ctime); the next look sees them all.
    changed = {n: (c, s) for c, n, s in after}
    second_look = []
    for c, n, s, _ in first_look:
        if n in changed:
            second_look.append((6 * second + changed[n][0] * second, n, changed[n][1], 0))
        else:
            second_look.append((c, n, s, 0))
    done_names = {e.payload["name"] for e in done}
    again = trigger._events(cursor, 20 * second, second_look)
    got = [(e.payload["name"], e.payload["size"]) for e in again]
    expected = {(n, changed[n][1]) for n in changed if any(n == f[1] for f in first_look)} | {
        (n, s) for _, n, s, _ in first_look if n not in changed and n not in done_names
    }
    assert len(got) == len(set(got))  # none twice
    assert set(got) == expected  # every state not yet recorded, none recorded before


# -- PostgresNotifyTrigger ----------------------------------------------------------------------


async def _listening(db_url: str, channel: str) -> bool:
    conn = await asyncpg.connect(db_url)
    try:
        n = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE query = $1", f'LISTEN "{channel}"'
        )
    finally:
        await conn.close()
    return bool(n)


async def test_postgres_notify_yields_each_notification(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_CONN_WAREHOUSE", db_url)
    run = Running(PostgresNotifyTrigger("orders", conn_id="warehouse"))
    first = asyncio.ensure_future(run.next())
    await wait_until(lambda: _listening(db_url, "orders"), what="LISTEN")
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute("SELECT pg_notify('orders', 'order 1')")
        await conn.execute("SELECT pg_notify('other', 'not ours')")
        await conn.execute("SELECT pg_notify('orders', 'order 2')")
        event = await first
        assert event.payload["payload"] == "order 1"
        assert event.payload["channel"] == "orders"
        assert isinstance(event.payload["pid"], int)
        assert (await run.next()).payload["payload"] == "order 2"
        # The connection is lost: the trigger raises, for the watcher to restart it.
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query = $1",
            'LISTEN "orders"',
        )
        with pytest.raises(ConnectionError, match="lost"):
            await run.next()
    finally:
        await conn.close()
        await run.close()


# -- HttpPollTrigger ----------------------------------------------------------------------------


@pytest.fixture
async def feed() -> AsyncIterator[dict[str, Any]]:
    state: dict[str, Any] = {"body": "v1", "requests": []}

    async def handle(request: web.Request) -> web.Response:
        etag = f'"{state["body"]}"'
        state["requests"].append(request.headers.get("If-None-Match"))
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers={"ETag": etag})
        return web.Response(text=state["body"], headers={"ETag": etag})

    app = web.Application()
    app.router.add_get("/feed", handle)
    async with http_server(app) as url:
        state["url"] = url + "/feed"
        yield state


async def test_http_poll_fires_when_the_response_changes(feed: dict[str, Any]) -> None:
    def trigger() -> HttpPollTrigger:
        return HttpPollTrigger(feed["url"], poll_interval=0.05)

    run = Running(trigger())
    first = await run.next()
    assert isinstance(first, Checkpoint)
    assert first.cursor["etag"] == '"v1"'
    feed["body"] = "v2"
    event = await run.next()
    assert isinstance(event, CursorEvent)
    assert event.payload["text"] == "v2"
    assert event.payload["status"] == 200
    await run.close()

    # Restarted from the cursor with nothing changed: it asks with the ETag, gets 304, and its
    # first event is the next change, not the one already recorded.
    feed["requests"].clear()
    again = Running(trigger(), run.cursor)
    nxt = asyncio.ensure_future(again.next())
    await wait_until(lambda: _true(len(feed["requests"]) >= 2), what="two polls")
    assert feed["requests"][0] == '"v2"'
    feed["body"] = "v3"
    assert (await nxt).payload["text"] == "v3"
    await again.close()

    # Changed while nobody polled: the first poll of the next run records it.
    feed["body"] = "v4"
    third = Running(trigger(), again.cursor)
    assert (await third.next()).payload["text"] == "v4"
    await third.close()


async def test_http_poll_raises_after_failed_polls(feed: dict[str, Any]) -> None:
    run = Running(HttpPollTrigger(feed["url"] + "/missing", poll_interval=0.01))
    with pytest.raises(ConnectionError, match="answered 404 3 times"):
        await run.next()
    await run.close()


async def _true(value: bool) -> bool:
    return value
