"""Test helpers: condition waits, child process environments. (The engine itself runs in a
test through the public harness, ``engine.testing.run_engine``.)"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

from engine.store.models import FiredTriggers

#: The test triggers live in tests/, outside the built-in ``triggers.*`` of the allow-list.
TEST_TRIGGER_ALLOW = "triggers.*,tests.*"

#: Upper bound for any wait in a test; pytest-timeout is the outer guard.
WAIT_S = 30.0
REPO_ROOT = Path(__file__).resolve().parent.parent


async def wait_until(
    condition: Callable[[], Awaitable[bool]], *, timeout_s: float = WAIT_S, what: str = ""
) -> None:
    """Wait for a condition (re-checked every few ms); fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what or condition}")
        await anyio.sleep(0.01)


def fired_summary(fired: FiredTriggers) -> tuple[set[int], int]:
    """What ``Store.fire_triggers`` wrote: the accepted trigger ids, how many tasks moved."""
    return set(fired.accepted), len(fired.moved)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def child_env(*, test_triggers: bool = True, **settings: str) -> dict[str, str]:
    """The environment of an engine child process in a test: this process's environment
    without its ``DEFERRAL_*`` variables, plus the test key, the repository on ``PYTHONPATH``,
    an allow-list that admits the test triggers (unless ``test_triggers=False``: the default
    list, built-ins and DAGs folder modules), and ``settings`` (``DEFERRAL_<NAME>`` values by
    upper-case name, e.g. ``DATABASE_URL=...``)."""
    from tests.conftest import TEST_FERNET_KEY

    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFERRAL_")}
    env.update(
        DEFERRAL_FERNET_KEY=TEST_FERNET_KEY,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    )
    if test_triggers:
        env["DEFERRAL_TRIGGER_ALLOW"] = TEST_TRIGGER_ALLOW
    env.update({f"DEFERRAL_{name}": value for name, value in settings.items()})
    return env
