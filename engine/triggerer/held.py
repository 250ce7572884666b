"""The set of triggers one triggerer runs, and the invariant that ties it to the database.

A trigger is *held* from the moment its claimed row is taken in (``take``) until it is let go
of: its outcome was written (``settle``), or it is stopped without writing anything
(``drop``: nobody waits on it any more, another triggerer owns it now, the triggerer lost its
registration). Every change goes through these three methods, which count what they did:
that is what lets the lease check compare the database with this set although both change
while it asks.

The invariant (``HeldSet.verdict``). Let ``owned`` be the number of trigger rows the database
says this triggerer owns, read by one statement, and ``mark`` the set's counts taken just
before that statement was sent. When the statement ran, the rows owned were the triggers
then held, plus rows claimed but not yet taken in (only while a claim is in progress), less
the rows whose outcome was committed but not yet settled (only the write in flight,
``in_flight``). Since the mark, ``taken`` triggers came in and ``let_go`` went out. So, with
nothing wrong:

    len(held) - taken - in_flight  <=  owned  <=  len(held) + let_go   (when not claiming)

* ``owned`` above the upper bound: the database says this triggerer owns triggers that run
  nowhere here (no path should leave such triggers; they would wait unseen for the life of
  the triggerer): **release the unheld ones**.
* ``owned`` below the lower bound: triggers run here that the database no longer gives to this
  triggerer (removed, or adopted by another after a lapse): **look up which and drop them**.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Held", "HeldSet", "Mark", "Verdict"]


class Held:
    """One trigger this triggerer runs: the fence it was claimed with, its task and timer."""

    __slots__ = ("classpath", "fence", "task", "timer")

    def __init__(self, fence: int, classpath: str) -> None:
        self.fence = fence
        self.classpath = classpath
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None

    def stop(self, *, cancel_task: bool) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if cancel_task and self.task is not None:
            self.task.cancel()


class Mark(NamedTuple):
    """The set's counts at one moment (see ``HeldSet.verdict``)."""

    taken: int
    let_go: int


class Verdict(enum.Enum):
    CONSISTENT = "consistent"
    UNHELD = "the database gives this triggerer triggers that run nowhere here"
    LOST = "triggers run here that the database no longer gives this triggerer"


class HeldSet:
    """The triggers held, by id; owned by the triggerer's event loop.

    ``on_room()`` runs when a trigger is let go of while the last claim stopped at capacity
    (``full``): the claim loop may take more."""

    def __init__(self, on_room: Callable[[], None] | None = None) -> None:
        self.triggers: dict[int, Held] = {}
        self._on_room = on_room
        #: Triggers ever taken in and let go of.
        self.taken = 0
        self.let_go = 0
        self.peak = 0
        #: The last claim stopped at capacity: unowned triggers may wait for room here.
        self.full = False

    def __len__(self) -> int:
        return len(self.triggers)

    def __contains__(self, trigger_id: object) -> bool:
        return trigger_id in self.triggers

    def get(self, trigger_id: int) -> Held | None:
        return self.triggers.get(trigger_id)

    def take(self, trigger_id: int, fence: int, classpath: str) -> Held:
        """Hold a claimed trigger (a trigger claimed again replaces its older run)."""
        held = Held(fence, classpath)
        self.triggers[trigger_id] = held
        self.taken += 1
        self.peak = max(self.peak, len(self.triggers))
        return held

    def settle(self, trigger_id: int, fence: int) -> bool:
        """The outcome of the run claimed with ``fence`` was written: let go of it. A trigger
        claimed again meanwhile, under a new fence, is a new run: not this outcome's to end."""
        held = self.triggers.get(trigger_id)
        if held is None or held.fence != fence:
            return False
        self._let_go(trigger_id, held, cancel_task=False)
        return True

    def drop(self, trigger_id: int) -> Held | None:
        """Stop running a trigger without writing anything (nobody waits, or not ours)."""
        held = self.triggers.get(trigger_id)
        if held is not None:
            self._let_go(trigger_id, held, cancel_task=True)
        return held

    def drop_all(self) -> list[asyncio.Task[None]]:
        """Stop every trigger; returns their tasks (to wait for their cleanup)."""
        tasks = [h.task for h in self.triggers.values() if h.task is not None]
        for trigger_id in list(self.triggers):
            self.drop(trigger_id)
        return tasks

    def _let_go(self, trigger_id: int, held: Held, *, cancel_task: bool) -> None:
        del self.triggers[trigger_id]
        self.let_go += 1
        held.stop(cancel_task=cancel_task)
        if self.full and self._on_room is not None:
            self._on_room()

    def mark(self) -> Mark:
        return Mark(self.taken, self.let_go)

    def verdict(self, owned: int, mark: Mark, *, in_flight: int, claiming: bool) -> Verdict:
        """Compare the database's count of owned triggers, read after ``mark``, with this set
        now (see the module docstring for the invariant)."""
        taken, let_go = self.taken - mark.taken, self.let_go - mark.let_go
        if owned > len(self.triggers) + let_go and not claiming:
            return Verdict.UNHELD
        if owned + in_flight + taken < len(self.triggers):
            return Verdict.LOST
        return Verdict.CONSISTENT
