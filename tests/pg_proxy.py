"""A TCP proxy in front of PostgreSQL that a test controls, for faults without crashes.

* ``hold()`` / ``release()``: new connections wait at a gate (a database that cannot be
  reached yet, for one process only);
* ``pause()`` / ``resume()``: nothing passes either way on any connection, and new ones wait
  (a network partition of one process: its statements hang, nothing fails);
* ``stall_connections()`` / ``resume()``: nothing passes on the connections open now, new
  ones work (half-open sockets, or backends that hang, while the server answers);
* ``cut_reply_containing(marker)``: the first server reply that carries ``marker`` is not
  passed on; the connection is cut instead. The statement has run (and committed, in
  autocommit), its reply is lost: what a connection killed right after a commit leaves.
* ``hold_reply_containing(marker)`` / ``release_reply()``: the first server reply that carries
  ``marker`` waits in the proxy until released. The statement has run (and committed, in
  autocommit); its client does not know yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import AsyncIterator

import anyio
import anyio.abc
from anyio.abc import ByteStream


class _UnixStream(ByteStream):
    """A Unix socket through asyncio's streams. (anyio's own Unix socket stream waits with a
    reader callback that can fire on a future already cancelled, an InvalidStateError the test
    runner reports, when many of the proxy's connections end at once.)"""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def connect(cls, path: str) -> _UnixStream:
        return cls(*await asyncio.open_unix_connection(path))

    async def receive(self, max_bytes: int = 65536) -> bytes:
        data = await self._reader.read(max_bytes)
        if not data:
            raise anyio.EndOfStream
        return data

    async def send(self, item: bytes) -> None:
        self._writer.write(item)
        await self._writer.drain()

    async def send_eof(self) -> None:
        self._writer.write_eof()

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()


class PgProxy:
    def __init__(self, upstream_url: str) -> None:
        parts = urllib.parse.urlsplit(upstream_url)
        query = urllib.parse.parse_qs(parts.query)
        self._socket_dir = query.get("host", [None])[0] or (
            parts.hostname if (parts.hostname or "").startswith("/") else None
        )
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 5432
        self._user = urllib.parse.unquote(parts.username or "postgres")
        self._password = urllib.parse.unquote(parts.password or "")
        self._database = parts.path.lstrip("/") or "postgres"
        self.port = 0
        self._open = anyio.Event()
        self._open.set()
        self._flowing = anyio.Event()
        self._flowing.set()
        #: Each open connection's own gate (a one-item list: the gate is replaced to close it).
        self._gates: list[list[anyio.Event]] = []
        self._marker: bytes | None = None
        #: Where the reply that carries the marker waits (None: that reply is cut instead).
        self._reply_gate: anyio.Event | None = None
        #: How many replies were cut, and how many connections were made.
        self.cuts = 0
        self.connections = 0

    @property
    def url(self) -> str:
        auth = urllib.parse.quote(self._user)
        if self._password:
            auth += ":" + urllib.parse.quote(self._password)
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{self._database}?sslmode=disable"

    def hold(self) -> None:
        if self._open.is_set():
            self._open = anyio.Event()

    def release(self) -> None:
        self._open.set()

    def pause(self) -> None:
        self.hold()
        if self._flowing.is_set():
            self._flowing = anyio.Event()

    def resume(self) -> None:
        self._flowing.set()
        for gate in self._gates:
            gate[0].set()
        self.release()

    def stall_connections(self) -> int:
        """Stop the traffic of the connections open now; returns how many were made so far."""
        for gate in self._gates:
            if gate[0].is_set():
                gate[0] = anyio.Event()
        return self.connections

    def cut_reply_containing(self, marker: bytes) -> None:
        self._marker = marker
        self._reply_gate = None

    def hold_reply_containing(self, marker: bytes) -> None:
        self._marker = marker
        self._reply_gate = anyio.Event()

    def release_reply(self) -> None:
        if self._reply_gate is not None:
            self._reply_gate.set()

    async def _upstream(self) -> ByteStream:
        if self._socket_dir:
            return await _UnixStream.connect(f"{self._socket_dir}/.s.PGSQL.{self._port}")
        return await anyio.connect_tcp(self._host, self._port)

    async def _handle(self, client: ByteStream) -> None:
        async with client:
            await self._open.wait()
            try:
                server = await self._upstream()
            except OSError:
                return  # the server is down: the client sees its connection closed
            self.connections += 1
            gate = [anyio.Event()]
            gate[0].set()
            self._gates.append(gate)
            async with server, anyio.create_task_group() as tg:

                async def pump(src: ByteStream, dst: ByteStream, watch: bool) -> None:
                    tail = b""
                    try:
                        async for chunk in src:
                            marker = self._marker if watch else None
                            if marker is not None and marker in tail + chunk:
                                self._marker = None
                                if self._reply_gate is None:
                                    self.cuts += 1
                                    break
                                await self._reply_gate.wait()
                            if marker is not None:
                                tail = (tail + chunk)[-len(marker) :]
                            await self._flowing.wait()
                            await gate[0].wait()
                            await dst.send(chunk)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(pump, client, server, False)
                tg.start_soon(pump, server, client, True)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[PgProxy]:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, self._handle)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()
