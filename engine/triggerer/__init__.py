"""The triggerer: one event loop that runs up to ``capacity`` trigger coroutines at once.

It claims unowned triggers in large batches (woken by ``NOTIFY``, polling as the
backstop), rebuilds each from its ``(classpath, kwargs)`` and runs its ``run()`` as
an asyncio task named after the trigger. The first event is queued; a writer
(engine/runtime/outbox.py) writes queued outcomes in batches, each batch one transaction in which
every waiting task instance moves by a conditional update, and only while this triggerer
still owns the trigger with the fencing token it claimed. Deferral deadlines are loop
timers. A lease, renewed on the database clock by a thread with a connection of its own
(engine/triggerer/lease.py), says the triggerer is alive; that connection's session holds the
triggerer's advisory lock, so its death is seen at once and other triggerers adopt its
triggers within a fraction of a second (or when the lease lapses).

Trigger code is untrusted: whatever it raises (SystemExit, KeyboardInterrupt, a
CancelledError of its own, ...) fails that trigger's tasks and nothing else. Every loop
here survives any database error, backing off (jittered) and carrying on.

One module per part: ``triggerer`` (``Triggerer``: wiring, ``run``/``stop``), ``config``
(``TriggererConfig``, built from the settings), ``state`` (the loop's state the parts share:
registration, held set, log sink, stop flag), ``held`` (the set of held triggers and the
invariant that ties it to the database), ``claims``, ``classes`` (trigger classes by
classpath, imported again when their file in the DAGs folder changes), ``running`` (one
trigger's task and outcome), ``outcomes`` (the outcomes' writer), ``deadlines``,
``ownership`` (the lease, as the loop sees it) and ``blocking`` (the blocked-loop policy);
and its two threads, ``lease`` (the lease keeper) and ``watchdog`` (the blocked-loop
watchdog).
"""

from engine.triggerer.triggerer import Triggerer

__all__ = ["Triggerer"]
