"""The worker's cycle collector (engine/runtime/heap.py): what the start made is frozen out of
the collector's passes, and what is made afterwards is still collected."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import gc, weakref
    from engine.runtime.heap import YOUNG_THRESHOLD, settle_heap

    class Node:
        pass

    assert gc.get_freeze_count() == 0
    settle_heap()
    assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
    assert gc.get_threshold()[0] == YOUNG_THRESHOLD
    # A cycle made afterwards is garbage the collector still finds.
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
    print("ok")
    """
)


def test_settle_heap_freezes_the_start_and_still_collects_what_comes_after() -> None:
    # (In a process of its own: freezing this one would change the test run's collector.)
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
