"""The cycle collector of a long-running engine process, set for its heap's shape.

A worker's heap is mostly what its start made: the engine's and the libraries' modules,
classes and functions, a few hundred thousand objects that live as long as the process. The
cycle collector's full passes walk all of them again and again, and each try and resume
allocates enough containers that live across awaits (up to a few hundred tries at once) to
trigger passes often: in ``bench waits`` py-spy saw ``gc_collect_main`` in 9 % of a worker's
samples. :func:`settle_heap` moves what the start made out of the collector's sight
(``gc.freeze``: still freed by reference counting, never walked again) and lets more young
objects gather before a pass, so that the tries' short-lived objects die before they are
promoted.
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "settle_heap"]

#: Allocations (net of deallocations) of tracked objects between two young-generation passes
#: (CPython's default: 700).
YOUNG_THRESHOLD = 10_000


def settle_heap() -> None:
    """Collect once, then freeze every object alive now (call it once the process's imports
    are done, before its work's objects exist: what is frozen and later becomes cyclic
    garbage is never collected) and raise the young generation's threshold."""
    gc.collect()
    gc.freeze()
    _young, middle, old = gc.get_threshold()
    gc.set_threshold(max(_young, YOUNG_THRESHOLD), middle, old)
