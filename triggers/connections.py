"""Connections: a trigger names a connection id instead of carrying a secret in its kwargs.

``DEFERRAL_CONN_<ID>`` holds the connection's URL (``DEFERRAL_CONN_WAREHOUSE=postgresql://...``,
``DEFERRAL_CONN_JOBS_API=https://user:token@jobs.example.com``). The id is upper-cased and every
character that is not a letter or digit becomes ``_``. The lookup happens where the trigger runs
(the triggerer, or the worker for a sensor's check), so the secret is never stored with the
trigger.
"""

from __future__ import annotations

import os
import re

__all__ = ["DEFAULT_DEFERRAL_CONN_ID", "ConnectionNotFound", "conn_env_name", "resolve_url"]

#: The connection id of the engine's own database (``TaskStateTrigger`` reads it).
DEFAULT_DEFERRAL_CONN_ID = "deferral"


class ConnectionNotFound(LookupError):
    """No environment variable defines the connection id."""


def conn_env_name(conn_id: str) -> str:
    """The environment variable that defines ``conn_id``."""
    return "DEFERRAL_CONN_" + re.sub(r"[^A-Za-z0-9]", "_", conn_id).upper()


def resolve_url(conn: str, environ: dict[str, str] | None = None) -> str:
    """A URL as given (anything with ``://``), or the URL of the connection id ``conn``.

    The id ``deferral`` falls back to ``DEFERRAL_DATABASE_URL``: the engine's own database.
    """
    if "://" in conn:
        return conn
    env = os.environ if environ is None else environ
    name = conn_env_name(conn)
    url = env.get(name, "")
    if not url and conn == DEFAULT_DEFERRAL_CONN_ID:
        url = env.get("DEFERRAL_DATABASE_URL", "")
    if not url:
        raise ConnectionNotFound(
            f"connection {conn!r} is not defined: set the environment variable {name} to its URL"
        )
    return url
