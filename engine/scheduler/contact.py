"""The scheduler's record of when it could reach the database, in database time.

A worker's silence (no heartbeat for ``zombie_threshold_s``) means it died only if the worker
could have written a heartbeat meanwhile. A database that restarts is covered by its start
time (``pg_postmaster_start_time()``), but one that *hangs* (stopped, paused, its storage
frozen, a network partition) answers nothing and fails nothing: the statements block, and
when it comes back every heartbeat is as old as the hang. The scheduler counts silence only
over time it could itself reach the database:

* a probe (``SELECT now()``) runs every :func:`probe_interval_s`; each answer is a *contact*,
  at the database time the statement started (not when its answer arrived: a statement sent
  before a freeze and answered after it proves nothing about the freeze);
* contacts closer than ``max_gap_s`` to each other are one unbroken stretch; a longer gap
  (the database hung, the network was cut, or the scheduler itself was paused or starved: it
  cannot tell, and it need not) starts a new stretch, and so does the first pass of the
  scheduler's own that succeeds after one failed. ``since`` is the start of the current
  stretch; heartbeats are counted as missed only after it;
* the reap itself is guarded too: its statement carries the last contact and reaps nothing
  when it starts more than ``max_gap_s`` after it (the reap may be the first statement that
  the database answers after a freeze, before the probe has seen the gap).

``max_gap_s`` is half the zombie threshold: a hang shorter than that may go unseen, and a
healthy worker's heartbeat is then at most that plus its own interval old (well under the
threshold while ``worker_heartbeat_s`` stays well under half of it). A worker that really
died is reaped within ``zombie_threshold_s`` plus one pass after contact is back.
"""

from __future__ import annotations

import datetime as dt
import logging

__all__ = ["Contact", "max_gap_s", "probe_interval_s"]

log = logging.getLogger(__name__)

#: The longest wait between two probes.
MAX_PROBE_INTERVAL_S = 1.0


def max_gap_s(zombie_threshold_s: float) -> float:
    """The longest gap between two contacts that still counts as unbroken contact."""
    return zombie_threshold_s / 2


def probe_interval_s(zombie_threshold_s: float) -> float:
    """How often the scheduler probes: several times within ``max_gap_s``."""
    return min(MAX_PROBE_INTERVAL_S, max_gap_s(zombie_threshold_s) / 4)


class Contact:
    """Unbroken stretches of contact with the database, from the database times of answered
    statements (:meth:`seen`) and the failures in between (:meth:`lost`)."""

    def __init__(self) -> None:
        #: Database time of the latest contact (None: none yet).
        self.last: dt.datetime | None = None
        #: Database time at which the current unbroken stretch began (None: none yet).
        self.since: dt.datetime | None = None
        self._broken = True
        #: Gaps seen (stretches begun after the first): for tests and introspection.
        self.gaps = 0

    @property
    def broken(self) -> bool:
        """No contact yet, or a statement failed since the last one."""
        return self._broken

    def seen(self, at: dt.datetime, max_gap_s: float) -> None:
        """A statement that started at database time ``at`` was answered."""
        last = self.last
        if last is not None and at <= last:
            return  # older news than what is known (answers may arrive out of order)
        gap = None if last is None else (at - last).total_seconds()
        if gap is not None and gap > max_gap_s:
            self.gaps += 1
            log.warning(
                "no contact with the database for %.1f s (or this scheduler was paused): "
                "heartbeats missed before now are not counted as a worker's silence",
                gap,
            )
        if self._broken or gap is None or gap > max_gap_s:
            self.since = at
        self.last = at
        self._broken = False

    def lost(self) -> None:
        """A statement failed: the next contact begins a new stretch."""
        self._broken = True

    def restart(self, at: dt.datetime) -> None:
        """Begin a new stretch at ``at``, the database time of the first statement of the
        caller's own work answered after it failed, even if a probe reached the database
        earlier: the scheduler's passes (and the workers, whose heartbeats retry as its passes
        do) may have waited out a backoff after the database came back."""
        if self.since is None or at > self.since:
            self.since = at
        if self.last is None or at > self.last:
            self.last = at
        self._broken = False
