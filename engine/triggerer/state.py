"""The triggerer loop's state: what its parts read and change, all of it owned by the loop.

Other threads (the lease keeper's, the watchdog's) never touch it: they hop to the loop
with ``call_soon_threadsafe`` first. The outcomes' writer is not here but in
engine/triggerer/outcomes.py, handed to the parts that produce outcomes.
"""

from __future__ import annotations

import asyncio
import gc

from engine.runtime.metrics import Metrics
from engine.runtime.wakeup import Wakeup
from engine.store import Store
from engine.triggerer.held import HeldSet
from engine.usercode.loglimits import LogLimits
from engine.usercode.logsink import LogSink

__all__ = ["LoopState"]


class LoopState:
    """The triggerer's registration, its held set, the triggers' log sink, the claim loop's
    wake-up and the stop flag."""

    def __init__(self, store: Store, metrics: Metrics, log_limits: LogLimits | None = None) -> None:
        self.store = store
        self.metrics = metrics
        #: This triggerer's registration (None until the lease thread registered it).
        self.id: int | None = None
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.claim_wake = Wakeup()
        self.held = HeldSet(on_room=self.claim_wake.set)
        self._frozen_at = 0
        #: The triggers' log lines (engine/usercode/logsink.py), written in batches, within the
        #: bounds of the settings log_* (``log_limits``).
        self.logs = LogSink(store, "trigger", limits=log_limits)

    def freeze(self) -> None:
        """Take what is allocated so far out of the collector's generations.

        A full collection walks every tracked object: at 100,000 waiting triggers (a dozen
        objects each) that is a pause of a second or more on the loop, in whichever trigger
        happened to allocate. Frozen objects are skipped by the collector and still freed by
        reference counting when their trigger ends; the collector gets them back (and any
        cycles among them) once the triggerer holds less than half of what it froze."""
        gc.freeze()
        self._frozen_at = max(self._frozen_at, len(self.held))

    def thaw_if_shrunk(self) -> None:
        if self._frozen_at and len(self.held) < self._frozen_at // 2:
            gc.unfreeze()
            self._frozen_at = 0
