"""Running the status page: ``deferral webserver`` and the webserver child of ``deferral
standalone``. A component like the engine's processes (``run`` / ``stop``), so it stops on
the same signals and supervisor requests."""

from __future__ import annotations

import errno
import logging
import socket
import sys

import anyio
from aiohttp import web
from anyio.abc import TaskStatus

from engine.config import ConfigError, Settings
from engine.runtime import logs
from engine.runtime.listen import inherited_socket
from engine.runtime.runner import exit_without_threads, serve, supervisor_fd
from engine.store import Store, open_store
from engine.store.endpoints import advertised
from engine.web.app import make_app

__all__ = ["WebServer", "run_webserver", "status_url"]

log = logging.getLogger(__name__)


def status_url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"


class WebServer:
    """The status page on ``store``, listening on ``host:port`` (port 0: any free one; the
    bound one is ``port`` once started)."""

    def __init__(
        self,
        store: Store,
        *,
        host: str,
        port: int,
        token: str | None = None,
        webhook_token: str | None = None,
        sock: socket.socket | None = None,
    ) -> None:
        self.store = store
        #: The asset webhook's token (setting webhook_token; None: the webhook refuses).
        self.webhook_token = webhook_token
        self.host = host
        self.port = port
        self.token = token
        #: A socket already listening (``deferral standalone`` binds it): served as it is.
        self.sock = sock
        self._stopped = anyio.Event()
        self._stopping = False
        self._runner: web.AppRunner | None = None

    def stop(self) -> None:
        """Graceful stop; safe before ``run`` and more than once."""
        self._stopping = True
        self._stopped.set()

    async def start(self) -> None:
        """Listen (ConfigError, naming the setting, when the address cannot be bound)."""
        if self._runner is not None:
            return
        runner = web.AppRunner(
            make_app(self.store, token=self.token, webhook_token=self.webhook_token),
            access_log=None,
        )
        await runner.setup()
        try:
            site: web.BaseSite = (
                web.TCPSite(runner, self.host, self.port)
                if self.sock is None
                else web.SockSite(runner, self.sock)
            )
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            # An address this machine does not have (or a name that does not resolve) is the
            # host's fault; anything else (in use, not allowed) the port's.
            bad_host = isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL
            hint = (
                "choose another address (--host, setting webserver_host)"
                if bad_host
                else "choose another port (--port, setting webserver_port)"
            )
            raise ConfigError(
                f"the status page cannot listen on {self.host}:{self.port} "
                f"({exc.strerror or exc}); {hint}"
            ) from None
        self._runner = runner
        if runner.addresses:
            self.port = int(runner.addresses[0][1])
        url = status_url(self.host, self.port)
        log.info("status page at %s (%s)", url, "actions enabled" if self.token else "read-only")
        print(f"deferral webserver: {url}", file=sys.stderr, flush=True)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await self.start()
            task_status.started()
            if not self._stopping:
                await self._stopped.wait()
        finally:
            runner, self._runner = self._runner, None
            if runner is not None:
                with anyio.move_on_after(5, shield=True):
                    await runner.cleanup()


async def run_webserver(settings: Settings, token: str | None) -> None:
    """``deferral webserver``: until signalled (or, started by ``spawn``, until its supervisor
    asks)."""
    logs.set_process_name("webserver")
    supervisor = supervisor_fd()
    store = await open_store(settings)
    try:
        server = WebServer(
            store,
            host=settings.webserver_host,
            port=settings.webserver_port,
            token=token,
            webhook_token=settings.webhook_token,
            sock=inherited_socket(),
        )
        await server.start()
        # (`deferral status` says where it listens.)
        url = status_url(server.host, server.port)
        async with advertised(store, "webserver", "webserver", url):
            cancelled = await serve([server], supervisor=supervisor)
    finally:
        with anyio.move_on_after(5, shield=True):
            await store.close()
    if cancelled:
        exit_without_threads()
