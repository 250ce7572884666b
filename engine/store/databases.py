"""Whole databases on a server: a fresh one for the demo, each benchmark run and each test.

Database names are identifiers, which SQL parameters cannot carry, so these few statements
are built here, from names checked to be plain identifiers, instead of in queries.sql.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

import asyncpg

__all__ = ["create_database", "drop_database", "with_database"]

_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def _checked(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"database name {name!r} must be a lower-case identifier")
    return name


def with_database(url: str, name: str) -> str:
    """The same server URL, naming another database."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{_checked(name)}"))


async def create_database(
    admin_url: str, name: str, *, template: str | None = None, replace: bool = False
) -> str:
    """Create database ``name`` (from ``template``; dropping an old one first with
    ``replace``) on the server of ``admin_url``; returns a URL for it."""
    conn = await asyncpg.connect(admin_url)
    try:
        if replace:
            await conn.execute(f'DROP DATABASE IF EXISTS "{_checked(name)}" WITH (FORCE)')
        sql = f'CREATE DATABASE "{_checked(name)}"'
        if template is not None:
            sql += f' TEMPLATE "{_checked(template)}"'
        await conn.execute(sql)
    finally:
        await conn.close()
    return with_database(admin_url, name)


async def drop_database(admin_url: str, name: str) -> None:
    """Drop database ``name`` if it exists, disconnecting its sessions."""
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{_checked(name)}" WITH (FORCE)')
    finally:
        await conn.close()
