"""``deferral standalone``: a scheduler, a worker and a triggerer, one child process each, and
the status page (``deferral webserver``, read-only) as a fourth unless turned off, supervised
by the calling process.

The children run in sessions of their own, so the terminal's Ctrl-C (SIGINT to the
foreground process group) and a signal to this process's group reach only this process;
it forwards exactly one request per signal it gets, through each child's pipe
(``engine.runtime.runner``):

* the first SIGINT or SIGTERM asks every child to stop gracefully: the worker lets running
  tasks finish (up to ``worker_shutdown_grace_s``), the triggerer writes the events it has
  and releases its triggers to others;
* a second one asks them to cancel (running tasks are then reaped and retried per their
  policy);
* a third one kills them.

A child that exits on its own makes the others stop gracefully, and the command exit 1.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from engine.config import STANDALONE_METRICS_PORT, ConfigError, Settings
from engine.launch.app import Child, spawn
from engine.runtime import logs
from engine.runtime.listen import ListenError, bound_port, listen, listen_url
from engine.runtime.runner import CANCEL, STOP

__all__ = [
    "KINDS",
    "Listeners",
    "Supervisor",
    "bind_listeners",
    "metrics_ports",
    "run_standalone",
]

log = logging.getLogger(__name__)

#: The children, in the order they start (then the webserver, unless turned off).
KINDS = ("scheduler", "worker", "triggerer")
#: The status page's child.
WEBSERVER = "webserver"
#: After a graceful request, how much longer than ``worker_shutdown_grace_s`` the children
#: get (the triggerer's release, closing connections) before they are killed.
STOP_MARGIN_S = 30.0
#: After a cancel request, how long the children get before they are killed.
CANCEL_WAIT_S = 15.0

_Event = tuple[str, str | int]


class Supervisor:
    """Waits for signals and child exits (one queue: signal handlers and one waiting thread
    per child put into it) and turns each signal into one request to every child."""

    def __init__(self, *, drain_s: float) -> None:
        self.drain_s = drain_s
        self.children: dict[str, Child] = {}
        #: Kinds whose exit does not stop the others (the status page: a port in use must not
        #: stop the engine).
        self.optional: set[str] = set()
        self.stage = 0
        self.code = 0
        self._events: queue.SimpleQueue[_Event] = queue.SimpleQueue()  # put() is reentrant
        self._deadline: float | None = None
        self._deadline_reason = ""
        self._old: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    def install(self) -> None:
        """Take SIGINT and SIGTERM (before the children start: none is lost meanwhile)."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._old[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        self._old.clear()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._events.put(("signal", signum))

    def add(self, child: Child) -> None:
        self.children[child.kind] = child

        def waiter() -> None:
            child.wait()
            self._events.put(("exit", child.kind))

        threading.Thread(target=waiter, name=f"wait-{child.kind}", daemon=True).start()

    def run(self) -> int:
        """Until every child has exited; the exit code for the command."""
        alive = set(self.children)
        while alive:
            timeout = None if self._deadline is None else self._deadline - time.monotonic()
            try:
                kind, what = self._events.get(timeout=None if timeout is None else max(0, timeout))
            except queue.Empty:
                self._kill(f"still running {self._deadline_reason}")
                continue
            if kind == "signal":
                self._on_request(signal.Signals(int(what)).name)
            else:
                child = self.children[str(what)]
                alive.discard(child.kind)
                child.close_control()
                self._on_exit(child)
        return self.code

    def _on_request(self, name: str) -> None:
        self.stage += 1
        names = ", ".join(c.label for c in self.children.values() if c.poll() is None)
        if self.stage == 1:
            log.info(
                "%s: stopping gracefully: asking %s to stop (again to cancel)",
                name,
                names or "no child",
            )
            self._ask(STOP, self.drain_s, f"{self.drain_s:.0f}s after the stop request")
        elif self.stage == 2:
            log.warning("%s again: asking %s to cancel", name, names or "no child")
            self._ask(CANCEL, CANCEL_WAIT_S, f"{CANCEL_WAIT_S:.0f}s after the cancel request")
        else:
            self._kill(f"after a third {name}")

    def _on_exit(self, child: Child) -> None:
        code = child.returncode
        if self.stage == 0 and child.kind in self.optional:
            log.error(
                "the %s process %s exited with %s; the others go on without it",
                child.kind,
                child.label,
                code,
            )
        elif self.stage == 0:
            log.error(
                "the %s process %s exited with %s; stopping the others",
                child.kind,
                child.label,
                code,
            )
            self.code = 1
            self.stage = 1
            self._ask(STOP, self.drain_s, f"{self.drain_s:.0f}s after the stop request")
        elif code != 0:
            log.warning("%s exited with %s", child.label, code)
            self.code = 1
        else:
            log.info("%s stopped", child.label)

    def _ask(self, what: bytes, wait_s: float, reason: str) -> None:
        for child in self.children.values():
            child.ask(what)
        self._deadline = time.monotonic() + wait_s
        self._deadline_reason = reason

    def _kill(self, why: str) -> None:
        for child in self.children.values():
            if child.poll() is None:
                log.warning("killing %s (%s)", child.label, why)
                child.kill()
        self._deadline = None
        self.code = 1


def metrics_ports(settings: Settings) -> dict[str, int]:
    """Each child's metrics port: ``metrics_port`` (else 9464) and the next two, in the order
    of ``KINDS``; with 0, each takes a free port (0)."""
    base = STANDALONE_METRICS_PORT if settings.metrics_port is None else settings.metrics_port
    return {kind: base + i if base else 0 for i, kind in enumerate(KINDS)}


class Listeners:
    """The sockets of ``deferral standalone``, bound before any child starts: the status
    page's and each child's metrics server's. Closed here once the children hold them."""

    def __init__(self) -> None:
        self.webserver: socket.socket | None = None
        self.metrics: dict[str, socket.socket] = {}

    def urls(self, settings: Settings) -> tuple[str | None, dict[str, str]]:
        """The status page's address and each child's /metrics, as bound."""
        page = None
        if self.webserver is not None:
            page = listen_url(settings.webserver_host, bound_port(self.webserver))
        metrics = {
            kind: listen_url(settings.metrics_host, bound_port(sock), "/metrics")
            for kind, sock in self.metrics.items()
        }
        return page, metrics

    def close(self) -> None:
        for sock in [self.webserver, *self.metrics.values()]:
            if sock is not None:
                sock.close()


def bind_listeners(settings: Settings, *, webserver: bool, metrics: bool) -> Listeners:
    """Bind the status page's port (``webserver_port``) and the metrics ports
    (:func:`metrics_ports`); port 0 takes a free one. Raises ConfigError naming the flag to
    change when one is taken (or the host cannot be listened on)."""
    bound = Listeners()
    try:
        if webserver:
            bound.webserver = _listen(
                settings.webserver_host,
                settings.webserver_port,
                "--webserver-port (setting webserver_port)",
                "setting webserver_host",
            )
        if metrics:
            for kind, port in metrics_ports(settings).items():
                bound.metrics[kind] = _listen(
                    settings.metrics_host,
                    port,
                    "--metrics-port (setting metrics_port: the first of three ports)",
                    "setting metrics_host",
                )
    except BaseException:
        bound.close()
        raise
    return bound


def _listen(host: str, port: int, port_flag: str, host_setting: str) -> socket.socket:
    try:
        return listen(host, port)
    except ListenError as exc:
        hint = (
            f"choose another address ({host_setting})"
            if exc.bad_host
            else f"choose another port with {port_flag}, or 0 for a free one"
        )
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.reason}): {hint}") from None


def run_standalone(
    settings: Settings,
    *,
    config_file: str | None = None,
    webserver: bool = True,
    listeners: Listeners | None = None,
) -> int:
    """Start the three children (and the webserver, unless ``webserver`` is false) and
    supervise them; the exit code (0: all stopped cleanly when asked). ``listeners``: the
    sockets bound for them (:func:`bind_listeners`; None: bound here). ``config_file``: the
    settings file this process read, which the children read too."""
    logs.set_process_name("standalone")
    extra: dict[str, list[str]] = {
        "scheduler": [],
        "worker": ["--slots", str(settings.worker_slots)],
        "triggerer": ["--capacity", str(settings.triggerer_capacity)],
    }
    env = {"DEFERRAL_CONFIG": str(Path(config_file).resolve())} if config_file else None
    if listeners is None:
        listeners = bind_listeners(settings, webserver=webserver, metrics=True)
    for kind in KINDS:
        sock = listeners.metrics.get(kind)
        extra[kind] += (
            ["--no-metrics"] if sock is None else ["--metrics-port", str(bound_port(sock))]
        )
    supervisor = Supervisor(drain_s=settings.worker_shutdown_grace_s + STOP_MARGIN_S)
    supervisor.install()
    try:
        for kind in KINDS:
            supervisor.add(
                spawn(kind, settings, *extra[kind], env=env, sock=listeners.metrics.get(kind))
            )
        if listeners.webserver is not None:
            supervisor.optional.add(WEBSERVER)
            # Read-only (no --enable-actions): `deferral webserver` serves the actions.
            supervisor.add(
                spawn(
                    WEBSERVER,
                    settings,
                    "--host",
                    settings.webserver_host,
                    "--port",
                    str(bound_port(listeners.webserver)),
                    env=env,
                    sock=listeners.webserver,
                )
            )
        listeners.close()  # (the children hold them now)
        log.info(
            "started %s (process group %d)",
            ", ".join(c.label for c in supervisor.children.values()),
            os.getpgrp(),
        )
        return supervisor.run()
    finally:
        listeners.close()
        supervisor.uninstall()
        for child in supervisor.children.values():
            if child.poll() is None:
                child.kill()
                child.wait()
            child.close_control()
