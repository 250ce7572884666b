"""Connections: a trigger names a connection id instead of carrying a secret in its kwargs.

``DEFERRAL_CONN_<ID>`` holds the connection's URL (``DEFERRAL_CONN_WAREHOUSE=postgresql://...``,
``DEFERRAL_CONN_JOBS_API=https://user:token@jobs.example.com``). The id is upper-cased and every
character that is not a letter or digit becomes ``_``. The lookup happens where the trigger runs
(the triggerer, or the worker for a sensor's check), so the secret is never stored with the
trigger.

An engine process also knows some URLs itself: the database it runs on is the connection id
``deferral``, also when that is the embedded server, whose URL exists only once it started. It
hands them over with :func:`connection_defaults` around the code that runs tasks and triggers
(the environment is never written). That is a context variable, not a process-wide registry:
it reaches the asyncio tasks and the worker threads started within the block, and two engines
in one process (tests) each see their own.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from types import MappingProxyType

__all__ = [
    "DEFAULT_DEFERRAL_CONN_ID",
    "ConnectionNotFound",
    "conn_env_name",
    "connection_defaults",
    "resolve_url",
]

#: The connection id of the engine's own database (``TaskStateTrigger`` reads it).
DEFAULT_DEFERRAL_CONN_ID = "deferral"


class ConnectionNotFound(LookupError):
    """No environment variable defines the connection id."""


#: URLs by connection id that the running engine provides (see :func:`connection_defaults`).
_NONE: Mapping[str, str] = MappingProxyType({})
_defaults: ContextVar[Mapping[str, str]] = ContextVar("deferral_connection_defaults", default=_NONE)


@contextlib.contextmanager
def connection_defaults(urls: Mapping[str, str]) -> Iterator[None]:
    """Within this block, the connection ids in ``urls`` that no ``DEFERRAL_CONN_<ID>``
    variable defines resolve to these URLs (the environment still wins)."""
    token = _defaults.set({**_defaults.get(), **urls})
    try:
        yield
    finally:
        _defaults.reset(token)


def conn_env_name(conn_id: str) -> str:
    """The environment variable that defines ``conn_id``."""
    return "DEFERRAL_CONN_" + re.sub(r"[^A-Za-z0-9]", "_", conn_id).upper()


def resolve_url(conn: str, environ: dict[str, str] | None = None) -> str:
    """A URL as given (anything with ``://``), or the URL of the connection id ``conn``.

    Looked up in order: ``DEFERRAL_CONN_<ID>``, what the running engine provides
    (:func:`connection_defaults`), and for the id ``deferral`` ``DEFERRAL_DATABASE_URL``.
    """
    if "://" in conn:
        return conn
    env = os.environ if environ is None else environ
    name = conn_env_name(conn)
    url = env.get(name, "") or _defaults.get().get(conn, "")
    if not url and conn == DEFAULT_DEFERRAL_CONN_ID:
        url = env.get("DEFERRAL_DATABASE_URL", "")
    if not url:
        raise ConnectionNotFound(
            f"connection {conn!r} is not defined: set the environment variable {name} to its URL"
        )
    return url
