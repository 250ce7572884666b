"""The lease, seen from the triggerer's loop.

The lease itself (registration, renewal, the session advisory lock, reaping gone triggerers)
is kept by a thread with a connection of its own (engine/triggerer/lease.py), so that a blocked loop
does not lose it. This part is what the loop does with it: it takes a new registration (a
new id after the first means the old one was lost: everything held is dropped), and every
third of a lease it checks the held set against what the database says this triggerer owns
(the invariant in engine/triggerer/held.py), releasing triggers owned but unheld and
dropping triggers held but no longer owned.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence

import anyio

from engine.runtime.retry import Backoff
from engine.store import Listener
from engine.store.models import TriggererHealth
from engine.triggerer.held import Verdict
from engine.triggerer.lease import LeaseKeeper
from engine.triggerer.outcomes import TriggerOutbox
from engine.triggerer.state import LoopState
from operators.base import DEFAULT_QUEUE

__all__ = ["Ownership", "ensure_listening"]

log = logging.getLogger("engine.triggerer")


async def ensure_listening(listener: Listener) -> None:
    try:
        await listener.ensure_connected()
    except Exception as exc:  # notifications only wake loops up; polling goes on
        log.warning("cannot LISTEN (%s: %s); polling only for now", type(exc).__name__, exc)


class Ownership:
    def __init__(
        self,
        state: LoopState,
        outcomes: TriggerOutbox,
        *,
        capacity: int,
        lease_s: float,
        max_block_s: float,
        claiming: Callable[[], bool],
        queues: Sequence[str] = (DEFAULT_QUEUE,),
    ) -> None:
        self._state = state
        self._outcomes = outcomes
        self.queues = tuple(queues)
        self.capacity = capacity
        self.lease_s = lease_s
        self.max_block_s = max_block_s
        self._claiming = claiming

    def keeper(
        self,
        loop_lag_s: Callable[[], float],
        health: Callable[[], TriggererHealth] | None = None,
    ) -> LeaseKeeper:
        """The lease thread for this triggerer (not started)."""
        loop = self._state.loop
        assert loop is not None
        return LeaseKeeper(
            self._state.store.url,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            capacity=self.capacity,
            lease_s=self.lease_s,
            queues=self.queues,
            loop=loop,
            on_registered=self.registered,
            on_reaped=self._state.claim_wake.set,
            loop_lag_s=loop_lag_s,
            # The blocker is failed at max_block_s; the lease is renewed for two leases
            # more, then lapses, letting the triggers go to others if the loop is blocked
            # for good.
            max_unresponsive_s=self.max_block_s + 2 * self.lease_s,
            health=health,
        )

    def registered(self, triggerer_id: int) -> None:
        """On the loop: the lease thread registered this triggerer (again)."""
        state = self._state
        previous, state.id = state.id, triggerer_id
        if previous is not None and previous != triggerer_id:
            log.error(
                "triggerer %s lost its registration (its lease connection dropped, or the "
                "loop was blocked for over %.1fs) and its triggers were freed for adoption; "
                "dropping the %d it ran and going on as triggerer %s",
                previous,
                self.max_block_s + 2 * self.lease_s,
                len(state.held),
                triggerer_id,
            )
            state.held.drop_all()
            self._outcomes.clear()
        else:
            log.info("triggerer %s started with capacity %d", triggerer_id, self.capacity)
        state.claim_wake.set()

    async def run(self, listener: Listener) -> None:
        backoff = Backoff()
        while True:
            await anyio.sleep(self.lease_s / 3)
            try:
                await self.check()
            except Exception as exc:
                await backoff.wait("check the triggers this triggerer owns", exc)
                continue
            backoff.reset()
            await ensure_listening(listener)

    async def check(self) -> None:
        """Compare what the database says this triggerer owns with what runs here."""
        state = self._state
        triggerer_id = state.id
        if triggerer_id is None:
            return
        mark = state.held.mark()
        owned = await state.store.count_owned_triggers(triggerer_id)
        if state.id != triggerer_id:
            return  # registered again meanwhile: everything held was dropped
        verdict = state.held.verdict(
            owned, mark, in_flight=self._outcomes.in_flight, claiming=self._claiming()
        )
        if verdict is Verdict.UNHELD:
            await self._release_unheld(triggerer_id)
        elif verdict is Verdict.LOST:
            await self._drop_lost(triggerer_id)

    async def _drop_lost(self, triggerer_id: int) -> None:
        state = self._state
        still = await state.store.owned_triggers(triggerer_id)
        if state.id != triggerer_id:
            return
        for trigger_id, held in list(state.held.triggers.items()):
            if still.get(trigger_id) != held.fence:
                if held.task is not None and not held.task.done():
                    # (A finished trigger here is one whose event was just written.)
                    log.warning(
                        "trigger %s is no longer this triggerer's in the database "
                        "(removed or taken over); stopping it without writing an event",
                        trigger_id,
                    )
                state.held.drop(trigger_id)

    async def _release_unheld(self, triggerer_id: int) -> None:
        """Give back triggers the database says are ours but that run nowhere here.

        No path is meant to leave such triggers; if one does, they would wait unseen for as
        long as this triggerer lives. Releasing them lets any triggerer claim them again."""
        state = self._state
        still = await state.store.owned_triggers(triggerer_id)
        if self._claiming() or state.id != triggerer_id:
            return  # a claim started meanwhile: its rows may not be held yet
        unheld = [trigger_id for trigger_id in still if trigger_id not in state.held]
        released = await state.store.release_triggers(triggerer_id, unheld) if unheld else set()
        # (An event written meanwhile deletes its trigger: such ids are not released.)
        if released:
            log.warning(
                "%d trigger(s) were owned by triggerer %s in the database but not running "
                "here (first: %s); released them to be claimed again",
                len(released),
                triggerer_id,
                sorted(released)[:5],
            )
