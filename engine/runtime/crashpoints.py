"""Named crash points: the process kills itself with SIGKILL at a named place, for fault tests.

Armed only by the environment of the process, read once at import:
``DEFERRAL_CRASH_AT=<name>`` kills the process the first time it reaches that point,
``DEFERRAL_CRASH_AT=<name>:<n>`` the n-th time. Unarmed, ``crash_point`` is one comparison.
The names in use are listed in :data:`CRASH_POINTS`; tests/test_crash_points.py kills a real
process at each and checks that nothing is lost and nothing resumes twice.
"""

from __future__ import annotations

import os
import signal

__all__ = ["CRASH_POINTS", "crash_point"]

#: Every crash point of the engine: where it is, and what has (not) been written yet.
CRASH_POINTS: dict[str, str] = {
    "worker.claim.after_commit": "tasks claimed and committed, not yet started or heartbeated",
    "worker.defer.before_write": "execute() deferred; the deferral is not written",
    "worker.defer.after_write": "the deferral is committed; the slot not yet freed",
    "worker.resume.before_method": "a resumed task is claimed; its method has not run",
    "worker.outcome.before_write": "a try ended; its outcome is not written",
    "worker.outcome.after_write": "the outcome is committed; the worker has not moved on",
    "worker.callback.before_run": "a callback request is claimed; its callbacks have not run",
    "worker.callback.after_run": "a request's callbacks ran; the request is not deleted",
    "triggerer.claim.after_commit": "triggers claimed and committed, not yet started",
    "triggerer.fire.before_write": "a trigger yielded its event; the event is not written",
    "triggerer.fire.after_write": "the event is committed; the trigger is still held",
    "triggerer.lease.after_renew": "the lease was renewed; nothing else done",
    "dagbag.parse": "a DAG file is being parsed",
    "keys.rotate.after_batch": "a batch of re-encrypted values is committed; later ones are not",
}

_armed_name: str | None = None
_armed_hits = 1
_hits = 0


def _arm(spec: str | None) -> None:
    global _armed_name, _armed_hits, _hits
    _hits = 0
    if not spec:
        _armed_name = None
        return
    name, _, count = spec.partition(":")
    _armed_name = name
    _armed_hits = int(count) if count else 1


_arm(os.environ.get("DEFERRAL_CRASH_AT"))


def crash_point(name: str) -> None:
    """Die here (SIGKILL, no cleanup, no flush) if this point is armed."""
    global _hits
    if _armed_name is None or name != _armed_name:
        return
    _hits += 1
    if _hits >= _armed_hits:
        os.kill(os.getpid(), signal.SIGKILL)
