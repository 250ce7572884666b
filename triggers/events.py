"""Built-in event triggers: what asset watchers run on the triggerer.

Each is a :class:`~triggers.base.BaseEventTrigger`: ``run()`` yields one event per outside
event for as long as it runs, and never returns on its own. What each one guarantees across
a restart or a failover of its triggerer (the triggerer stores each event's cursor with the
event, fenced; see ``BaseEventTrigger``):

* :class:`PostgresNotifyTrigger` keeps no cursor: ``NOTIFY`` is not durable. A notification
  sent while no watcher listens (between a triggerer's death and the adoption of the watcher,
  while the connection is re-established, before the first ``LISTEN``) is lost, and so is one
  received but not yet written when the triggerer died. Each one received and written is
  recorded once.
* :class:`DirectoryTrigger`'s cursor is a high-water mark of the files' change times
  (``ctime``, which a rename into the directory also sets) and the files seen at its edge:
  no file state it recorded is recorded again, and every file created, changed or moved in
  while no triggerer watched is recorded when the next one starts. Only a file's latest
  state is seen (a file changed twice between two looks is one event).
* :class:`HttpPollTrigger`'s cursor is the last response's ``ETag`` and body hash: a change
  made while no triggerer polled is recorded once by the next one; a response that changes
  and changes back between two polls is not seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import fnmatch
import hashlib
import os
import stat
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import anyio
import asyncpg

from triggers.base import BaseEventTrigger, Checkpoint, CursorEvent, TriggerEvent
from triggers.connections import aresolve_url

__all__ = ["DirectoryTrigger", "HttpPollTrigger", "PostgresNotifyTrigger"]


def _poll_interval(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"poll_interval must be a number of seconds, got {value!r}")
    if not value > 0:
        raise ValueError(f"poll_interval must be positive, got {value!r}")
    return float(value)


# -- PostgreSQL NOTIFY ------------------------------------------------------------------------


class PostgresNotifyTrigger(BaseEventTrigger):
    """One event per ``NOTIFY`` on ``channel`` of a PostgreSQL database, named by ``conn_id``
    (see :mod:`triggers.connections`) or given as ``dsn``. The event's payload is
    ``{"channel", "payload", "pid"}`` (the notifying backend's pid).

    A lost connection ends ``run()`` with an error: the triggerer records it on the watcher
    and starts the trigger again with backoff. What a restart can miss: see the module
    docstring (``NOTIFY`` is not durable)."""

    def __init__(self, channel: str, *, conn_id: str | None = None, dsn: str | None = None):
        if not isinstance(channel, str) or not channel:
            raise ValueError(f"channel must be a non-empty string, got {channel!r}")
        if (conn_id is None) == (dsn is None):
            raise ValueError("give exactly one of conn_id and dsn")
        self.channel = channel
        self.conn_id = conn_id
        self.dsn = dsn
        self._connection: asyncpg.Connection | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.events.PostgresNotifyTrigger",
            {"channel": self.channel, "conn_id": self.conn_id, "dsn": self.dsn},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        url = self.dsn if self.dsn is not None else await aresolve_url(str(self.conn_id))
        received: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()

        def on_notify(_conn: Any, pid: int, _channel: str, payload: object) -> None:
            received.put_nowait((pid, str(payload)))

        def on_lost(_conn: object) -> None:
            received.put_nowait(None)

        self._connection = connection = await asyncpg.connect(url)
        connection.add_termination_listener(on_lost)
        await connection.add_listener(self.channel, on_notify)
        self.log.info("listening on channel %r", self.channel)
        while True:
            item = await received.get()
            if item is None:
                raise ConnectionError(
                    f"the connection listening on channel {self.channel!r} was lost; "
                    "notifications sent until it listens again are not seen"
                )
            pid, payload = item
            yield TriggerEvent({"channel": self.channel, "payload": payload, "pid": pid})

    async def cleanup(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and not connection.is_closed():
            connection.terminate()  # no round trip: the server ends the LISTEN with it


# -- a directory ------------------------------------------------------------------------------

#: A change whose ctime is this much older than the start of a look at the directory certainly
#: happened before that look (the kernel stamps ctime from a clock a tick coarser than ours).
CLOCK_MARGIN_NS = 100_000_000


def _matches(name: str, pattern: str) -> bool:
    """``pattern`` matched as a glob on the file name; hidden files only by a hidden pattern."""
    if name.startswith(".") and not pattern.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, pattern)


def _look(path: str, pattern: str) -> tuple[int, list[tuple[int, str, int, int]]]:
    """The start of the look (ns, wall clock) and the matching regular files as (ctime_ns,
    name, size, mtime_ns). Blocking: run in a thread."""
    started = time.time_ns()
    found = []
    with os.scandir(path) as entries:
        for entry in entries:
            if not _matches(entry.name, pattern):
                continue
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue  # removed meanwhile
            if stat.S_ISREG(st.st_mode):
                found.append((st.st_ctime_ns, entry.name, st.st_size, st.st_mtime_ns))
    return started, found


class _SharedInotify:
    """One inotify instance per event loop, shared by every :class:`DirectoryTrigger` on it
    (a process has 128 instances by default, and a triggerer runs thousands of watchers), with
    one watch per directory: each change wakes the triggers watching that directory."""

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _SharedInotify] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, inotify: Any) -> None:
        self.inotify = inotify
        self.watches: dict[str, Any] = {}
        #: The events to set, by directory; a directory removed sets them and is named in gone.
        self.waiting: dict[str, set[asyncio.Event]] = {}
        self.gone: set[str] = set()
        self.reader: asyncio.Task[None] | None = None

    @classmethod
    def of_loop(cls) -> _SharedInotify | None:
        """This loop's instance (made on first use); None where there is no inotify (not
        Linux, no library, no instance left)."""
        loop = asyncio.get_running_loop()
        shared = cls._by_loop.get(loop)
        if shared is None:
            try:
                from asyncinotify import Inotify
            except ImportError:
                return None
            try:
                shared = cls(Inotify())
            except OSError:
                return None
            cls._by_loop[loop] = shared
        return shared

    def subscribe(self, path: str, changed: asyncio.Event) -> None:
        """Set ``changed`` at each change of ``path``'s files (OSError: cannot watch it)."""
        from asyncinotify import Mask

        if path not in self.watches:
            self.watches[path] = self.inotify.add_watch(
                path, Mask.CLOSE_WRITE | Mask.MOVED_TO | Mask.ATTRIB | Mask.ONLYDIR
            )
            self.gone.discard(path)
        self.waiting.setdefault(path, set()).add(changed)
        if self.reader is None or self.reader.done():
            # (Not any one trigger's task: it outlives each of them. Its context is emptied so
            # that its lines are nobody's.)
            self.reader = asyncio.get_running_loop().create_task(
                self._read(), name="directory-trigger-inotify", context=contextvars.Context()
            )

    def unsubscribe(self, path: str, changed: asyncio.Event) -> None:
        waiting = self.waiting.get(path)
        if waiting is None:
            return
        waiting.discard(changed)
        if not waiting:
            del self.waiting[path]
            watch = self.watches.pop(path, None)
            if watch is not None and path not in self.gone:
                with contextlib.suppress(OSError):
                    self.inotify.rm_watch(watch)

    async def _read(self) -> None:
        from asyncinotify import Mask

        async for event in self.inotify:
            path = str(event.watch.path) if event.watch is not None else None
            if path is None or self.watches.get(path) is not event.watch:
                continue  # a watch removed since
            if event.mask & Mask.IGNORED:
                self.gone.add(path)
                self.watches.pop(path, None)
            for changed in self.waiting.get(path, ()):
                changed.set()


class DirectoryTrigger(BaseEventTrigger):
    """One event per file of ``path`` (not its subdirectories) whose name matches
    ``pattern`` (a glob; hidden files only with a hidden pattern) that is new, changed or
    moved in. The payload is ``{"path", "name", "size", "mtime"}``.

    The directory is looked at when inotify says a file in it was written and closed, moved
    in or had its attributes changed (Linux, through ``asyncinotify``), and every
    ``poll_interval`` seconds besides (the only way without inotify, or with
    ``use_inotify=False``). Write a file elsewhere and rename it in when complete: a look that
    happens while a file is being written records it, and records it again once changed.
    Deleted files are not events. The first start records the files already there as seen,
    without events.

    The cursor (see the module docstring): ``{"before": ns, "seen": [[name, ctime_ns, size],
    ...]}``: every file state whose ctime is before ``before`` was recorded (or replaced by a
    later one), and of the later ones those listed. It relies on the host's clock not
    stepping back and on ctimes stamped by this host (not a network file system's server).
    """

    def __init__(
        self,
        path: str,
        pattern: str = "*",
        *,
        poll_interval: float = 5.0,
        use_inotify: bool = True,
    ) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty string, got {path!r}")
        if not isinstance(pattern, str) or not pattern or "/" in pattern:
            raise ValueError(f"pattern must be a file name glob without '/', got {pattern!r}")
        self.path = path
        self.pattern = pattern
        self.poll_interval = _poll_interval(poll_interval)
        self.use_inotify = bool(use_inotify)
        self._shared: _SharedInotify | None = None
        self._changed: asyncio.Event | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.events.DirectoryTrigger",
            {
                "path": self.path,
                "pattern": self.pattern,
                "poll_interval": self.poll_interval,
                "use_inotify": self.use_inotify,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        changed = asyncio.Event()
        if self.use_inotify:
            self._watch(changed)
        cursor = self.cursor
        if cursor is None:
            started, found = await anyio.to_thread.run_sync(_look, self.path, self.pattern)
            before = started - CLOCK_MARGIN_NS
            seen = [[name, ctime, size] for ctime, name, size, _ in found if ctime >= before]
            cursor = {"before": before, "seen": seen}
            yield Checkpoint(cursor=cursor)
        while True:
            changed.clear()
            started, found = await anyio.to_thread.run_sync(_look, self.path, self.pattern)
            for event in self._events(cursor, started, found):
                cursor = event.cursor
                yield event
            if self._shared is not None and self.path in self._shared.gone:
                raise FileNotFoundError(f"directory {self.path} was removed or unmounted")
            with anyio.move_on_after(self.poll_interval):
                await changed.wait()

    def _events(
        self, cursor: dict[str, Any], started: int, found: list[tuple[int, str, int, int]]
    ) -> list[CursorEvent]:
        """The events of one look, oldest change first, each with the cursor after it."""
        before = int(cursor["before"])
        seen = {(str(n), int(c), int(s)) for n, c, s in cursor["seen"]}
        new = sorted(
            (ctime, name, size, mtime)
            for ctime, name, size, mtime in found
            if ctime >= before and (name, ctime, size) not in seen
        )
        edge = max(before, started - CLOCK_MARGIN_NS)
        events = []
        for k, (ctime, name, size, mtime) in enumerate(new):
            seen.add((name, ctime, size))
            # Every change older than the next one's (or than this look, for the last) has
            # now been recorded: it becomes the new "before"; the states at or past it are
            # listed.
            after = min(new[k + 1][0], edge) if k + 1 < len(new) else edge
            after = max(after, before)
            seen = {s for s in seen if s[1] >= after}
            payload = {
                "path": os.path.join(self.path, name),
                "name": name,
                "size": size,
                "mtime": dt.datetime.fromtimestamp(mtime / 1e9, tz=dt.UTC).isoformat(),
            }
            next_cursor = {"before": after, "seen": sorted([list(s) for s in seen])}
            events.append(CursorEvent(payload, cursor=next_cursor))
        return events

    def _watch(self, changed: asyncio.Event) -> None:
        """Set ``changed`` whenever inotify reports a change of the directory's files."""
        shared = _SharedInotify.of_loop()
        if shared is None:
            self.log.info("no inotify here: looking at %s every %ss", self.path, self.poll_interval)
            return
        try:
            shared.subscribe(self.path, changed)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError | NotADirectoryError):
                raise
            self.log.info("cannot watch %s with inotify (%s): polling", self.path, exc)
            return
        self._shared, self._changed = shared, changed

    async def cleanup(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None and self._changed is not None:
            shared.unsubscribe(self.path, self._changed)


# -- an HTTP resource -------------------------------------------------------------------------

#: Response text kept in an event's payload.
MAX_EVENT_TEXT = 4096
#: Failed polls in a row after which the trigger raises (its error is shown on the watcher).
MAX_FAILED_POLLS = 3


class HttpPollTrigger(BaseEventTrigger):
    """Requests ``url`` every ``poll_interval`` seconds and yields an event when the answer
    changes: a body whose SHA-256 differs from the last one's (with ``If-None-Match`` when
    the server gave an ``ETag``: a ``304`` is no change). The payload is ``{"url",
    "status", "etag", "hash", "text"}`` (the first 4 KiB of the body).

    The first start records the answer it finds as seen, without an event. ``conn_id``: the
    URL is relative to the connection, whose ``user:password@`` becomes basic authentication
    (as :class:`~triggers.http.HttpTrigger`). A status outside ``expected_status`` or a
    connection error is retried at the next poll; after three failed polls in a row the
    trigger raises, so the watcher shows the error and is restarted with backoff.

    The cursor: ``{"etag", "hash"}`` of the last answer recorded."""

    def __init__(
        self,
        url: str,
        *,
        method: str = "GET",
        headers: dict[str, str] | None = None,
        conn_id: str | None = None,
        expected_status: Sequence[int] = (200,),
        poll_interval: float = 60.0,
        request_timeout: float = 30.0,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be a non-empty string, got {url!r}")
        self.url = url
        self.method = method.upper()
        self.headers = dict(headers or {})
        self.conn_id = conn_id
        self.expected_status = sorted({int(s) for s in expected_status})
        self.poll_interval = _poll_interval(poll_interval)
        self.request_timeout = float(request_timeout)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.events.HttpPollTrigger",
            {
                "url": self.url,
                "method": self.method,
                "headers": self.headers,
                "conn_id": self.conn_id,
                "expected_status": self.expected_status,
                "poll_interval": self.poll_interval,
                "request_timeout": self.request_timeout,
            },
        )

    async def _target(self) -> tuple[str, dict[str, str]]:
        from triggers.http import HttpTrigger

        # The same URL and credentials rules as HttpTrigger's (credentials stay on the
        # connection's origin).
        return await HttpTrigger(self.url, headers=self.headers, conn_id=self.conn_id)._target()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        cursor = self.cursor
        failures = 0
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                url, headers = await self._target()
                etag = cursor.get("etag") if cursor else None
                if etag:
                    headers = {**headers, "If-None-Match": etag}
                try:
                    async with session.request(self.method, url, headers=headers) as resp:
                        status = resp.status
                        body = await resp.read() if status != 304 else b""
                        new_etag = resp.headers.get("ETag")
                        text = body[:MAX_EVENT_TEXT].decode(resp.charset or "utf-8", "replace")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    failures += 1
                    if failures >= MAX_FAILED_POLLS:
                        raise ConnectionError(
                            f"{self.method} {self.url}: {failures} polls in a row failed, the "
                            f"last with {type(exc).__name__}: {exc}"
                        ) from exc
                    self.log.info("%s %s: %s; trying again", self.method, url, exc)
                else:
                    if status == 304 or status in self.expected_status:
                        failures = 0
                    else:
                        failures += 1
                        if failures >= MAX_FAILED_POLLS:
                            raise ConnectionError(
                                f"{self.method} {self.url} answered {status} {failures} "
                                f"times in a row; expected {self.expected_status}"
                            )
                    if status in self.expected_status:
                        digest = hashlib.sha256(body).hexdigest()
                        new = {"etag": new_etag, "hash": digest}
                        if cursor is None:
                            cursor = new
                            yield Checkpoint(cursor=cursor)
                        elif digest != cursor.get("hash"):
                            cursor = new
                            yield CursorEvent(
                                {
                                    "url": self.url,
                                    "status": status,
                                    "etag": new_etag,
                                    "hash": digest,
                                    "text": text,
                                },
                                cursor=cursor,
                            )
                await asyncio.sleep(self.poll_interval)
