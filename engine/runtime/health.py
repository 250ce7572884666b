"""The metrics port of a process: ``/metrics``, ``/livez`` and ``/readyz``, served by aiohttp
on the process's own event loop.

* ``/livez`` answers 200 whenever the loop runs its handler: being served at all is the proof
  that the loop is not stuck (a probe's timeout is what catches a blocked loop).
* ``/readyz`` answers 200 when every check passes, else 503: ``database`` (``SELECT now()``
  answers within ``DB_TIMEOUT_S``; the answer is kept for ``DB_CACHE_S`` so that frequent
  probes cost the database little) and the component's own freshness check (a triggerer's
  lease renewed, a worker's heartbeat written, a scheduler's pass completed recently).
* ``?verbose`` lists the checks, one a line: ``[+]database ok`` or ``[-]database failed: ...``.

The server runs for as long as its process's component (``WithHealth``): while a worker drains
its running tasks after SIGTERM, ``/livez`` still answers and ``/readyz`` says ``stopping``.

The same loop also samples its own lag twice a second (``deferral_loop_lag_seconds``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable

import anyio
from aiohttp import web
from anyio.abc import TaskStatus

from engine.runtime.metrics import Metrics
from engine.runtime.runner import Component, stops_at_once
from engine.runtime.wakeup import Wakeup

__all__ = ["Check", "HealthServer", "Readiness", "WithHealth", "database_check", "freshness"]

log = logging.getLogger(__name__)

#: How long the database may take to answer a readiness check, and how long an answer holds.
DB_TIMEOUT_S = 1.0
DB_CACHE_S = 1.0
#: How often the loop's lag is sampled.
LAG_SAMPLE_S = 0.5

#: A readiness check: (passed, what it found).
Readiness = tuple[bool, str]
Check = Callable[[], Awaitable[Readiness]]


def database_check(now: Callable[[], Awaitable[object]]) -> Check:
    """A check that the database answers ``now()`` within ``DB_TIMEOUT_S``, cached
    ``DB_CACHE_S``."""
    cached: list[tuple[float, Readiness]] = []

    async def check() -> Readiness:
        if cached and time.monotonic() - cached[0][0] < DB_CACHE_S:
            return cached[0][1]
        try:
            async with asyncio.timeout(DB_TIMEOUT_S):
                await now()
            result: Readiness = (True, "ok")
        except TimeoutError:
            result = (False, f"no answer within {DB_TIMEOUT_S:g}s")
        except Exception as exc:
            result = (False, f"{type(exc).__name__}: {exc}")
        cached[:] = [(time.monotonic(), result)]
        return result

    return check


class HealthServer:
    """Serves the metrics port until ``stop()``; a component of ``engine.runtime.runner.serve``.

    A port that cannot be bound (taken) is logged as an error and the process runs on
    without it: metrics are not a reason to stop tasks and triggers. ``sock``: a socket
    already listening, served as it is."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        port: int,
        host: str = "127.0.0.1",
        checks: dict[str, Check] | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        self.metrics = metrics
        #: A socket already listening (bound by the process's parent, or by its launcher):
        #: served instead of binding ``host:port``.
        self.sock = sock
        self.host = host
        self.port = port
        self.checks = dict(checks or {})
        self._stopped = Wakeup()
        self._stopping = False
        #: The process is stopping (its component was asked to): not ready any more.
        self.draining = False
        #: The port actually bound (``port=0`` binds a free one), once running.
        self.bound_port: int | None = None

    def stop(self) -> None:
        self._stopping = True
        self._stopped.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/readyz", self._readyz)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site: web.BaseSite = (
                web.TCPSite(runner, self.host, self.port)
                if self.sock is None
                else web.SockSite(runner, self.sock)
            )
            try:
                await site.start()
            except OSError as exc:
                log.error(
                    "cannot serve metrics on %s:%d (%s); running without them",
                    self.host,
                    self.port,
                    exc,
                )
                task_status.started()
                return
            server = getattr(site, "_server", None)
            sockets = getattr(server, "sockets", None) or []
            self.bound_port = sockets[0].getsockname()[1] if sockets else self.port
            log.info(
                "metrics on http://%s:%d/metrics (health: /livez, /readyz)",
                self.host,
                self.bound_port,
            )
            task_status.started()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._sample_lag)
                while not self._stopping:
                    await self._stopped.wait(None)
                tg.cancel_scope.cancel()
        finally:
            with anyio.move_on_after(2, shield=True):
                await runner.cleanup()

    async def _sample_lag(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(LAG_SAMPLE_S)
            self.metrics.loop_lag.observe(max(0.0, loop.time() - start - LAG_SAMPLE_S))

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def _livez(self, request: web.Request) -> web.Response:
        text = "[+]loop ok\nlive\n" if "verbose" in request.query else "ok\n"
        return web.Response(text=text)

    async def _readyz(self, request: web.Request) -> web.Response:
        names = list(self.checks)
        results = await asyncio.gather(*(self._run_check(n) for n in names))
        if self.draining:
            names.append("stopping")
            results.append((False, "the process is stopping"))
        ready = all(ok for ok, _ in results)
        if "verbose" in request.query:
            lines = [
                f"[+]{name} {detail}" if ok else f"[-]{name} failed: {detail}"
                for name, (ok, detail) in zip(names, results, strict=True)
            ]
            text = "\n".join([*lines, "ready" if ready else "not ready"]) + "\n"
        else:
            text = "ok\n" if ready else "not ready\n"
        return web.Response(text=text, status=200 if ready else 503)

    async def _run_check(self, name: str) -> Readiness:
        try:
            return await self.checks[name]()
        except Exception as exc:  # a check that breaks says so, it does not break the probe
            return False, f"{type(exc).__name__}: {exc}"


def freshness(what: str, last: Callable[[], float | None], max_age_s: float) -> Check:
    """A check that ``last()`` (a monotonic time) is at most ``max_age_s`` old."""

    async def check() -> Readiness:
        at = last()
        if at is None:
            return False, f"no {what} yet"
        age = time.monotonic() - at
        if age > max_age_s:
            return False, f"last {what} {age:.1f}s ago (limit {max_age_s:g}s)"
        return True, f"ok ({what} {age:.1f}s ago)"

    return check


class WithHealth:
    """A component and its metrics server, as one component: the server starts first, so
    probes get answers while the component starts, and stops once the component returned
    (a graceful stop marks it not ready meanwhile)."""

    def __init__(self, component: Component, server: HealthServer) -> None:
        self.component = component
        self.server = server
        #: As its component's (engine.runtime.runner.stops_at_once).
        self.stops_at_once = stops_at_once(component)

    def stop(self) -> None:
        self.server.draining = True
        self.component.stop()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self.server.run)
            try:
                await self.component.run(task_status=task_status)
            finally:
                self.server.stop()
