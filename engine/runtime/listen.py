"""Listening sockets, bound before anything is said about them.

``deferral standalone`` binds the ports of its status page and of its children's metrics
servers itself, before it starts them and before it prints an address: a port another
process holds is an error at once, naming the flag to change, and port 0 takes a free one
whose number is then known. Each child is handed its socket (file descriptor inherited, its
number in :data:`LISTEN_FD_ENV`) and serves on it (:func:`inherited_socket`).
"""

from __future__ import annotations

import errno
import logging
import os
import socket

__all__ = [
    "LISTEN_FD_ENV",
    "ListenError",
    "bound_port",
    "inherited_socket",
    "listen",
    "listen_url",
]

log = logging.getLogger(__name__)

#: The environment variable that hands a child the descriptor of its listening socket.
LISTEN_FD_ENV = "DEFERRAL_LISTEN_FD"
#: Connections the kernel queues before the server accepts them.
BACKLOG = 128


class ListenError(OSError):
    """An address that cannot be listened on; ``bad_host``: the host's fault (an address this
    machine does not have, a name that does not resolve), else the port's (in use, not
    allowed)."""

    def __init__(self, host: str, port: int, cause: OSError) -> None:
        self.host = host
        self.port = port
        self.bad_host = isinstance(cause, socket.gaierror) or cause.errno == errno.EADDRNOTAVAIL
        self.reason = cause.strerror or str(cause)
        super().__init__(cause.errno, f"cannot listen on {host}:{port} ({self.reason})")


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (0: a free port; :func:`bound_port` says
    which). Raises :class:`ListenError`."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise ListenError(host, port, exc) from None
    try:
        # (As every server: a port whose last connections linger in TIME_WAIT binds again;
        # one that another process listens on does not.)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise ListenError(host, port, exc) from None
    return sock


def bound_port(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def listen_url(host: str, port: int, path: str = "/") -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{path}"


def inherited_socket() -> socket.socket | None:
    """The listening socket this process's parent bound for it, if any. Taken out of the
    environment and made non-inheritable, so that processes this one starts (tasks) neither
    see nor hold it."""
    raw = os.environ.pop(LISTEN_FD_ENV, None)
    if not raw:
        return None
    try:
        sock = socket.socket(fileno=int(raw))
        sock.set_inheritable(False)
    except (ValueError, OSError) as exc:
        log.warning("ignoring %s=%r: %s", LISTEN_FD_ENV, raw, exc)
        return None
    return sock
