"""The DAGs folder in the store: a scan records the DAGs of the folder, and anyone may ask the
running schedulers for one now.

* :func:`sync_dags` scans a DAG bag's folder once and records what it found: the DAGs (only
  those that changed are written, engine/scheduler/dagrecord.py), the DAGs the folder no longer
  holds marked inactive. The files that failed to import are known there
  (``dagbag.import_errors``: file -> error), right after the bag collected them.
* :class:`DagScan` is the scheduler's scan task, beside its scheduling loop: a scan every
  ``dag_rescan_interval_s``, and at once when asked. A file that takes a minute to import
  holds up the recording of the DAGs, never a pass of the loop.
* :func:`request_rescan` asks for a scan from outside (``dags trigger`` does, for a DAG it does
  not know yet) and waits until it is recorded.

Rescan requests go over two channels: a requester LISTENs on ``deferral_dag_rescanned``, then
NOTIFYs ``deferral_dag_rescan`` with a token of its own (and the id of the DAG it looks for,
``<token> <dag_id>``); a scheduler answers ``scanning <token>`` when it starts the rescan and
``done <token>`` when the DAGs are recorded. A DAG file whose import is slow is waited for by
that rescan only if the DAG asked for was not found without it (or no DAG was named).

The client, the command line and the demo import this module, not the scheduler's process
module: recording DAGs writes the store, so it cannot live in ``engine/dags/`` (which sits
beside the store, not above it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

from engine.dags.dagbag import DagBag
from engine.runtime.retry import TRANSIENT_ERRORS, Backoff
from engine.runtime.wakeup import Wakeup
from engine.scheduler.dagrecord import DagRecorder, sync_watchers
from engine.store import Store

__all__ = [
    "CHANNEL_DAG_RESCAN",
    "CHANNEL_DAG_RESCANNED",
    "RESCAN_ANSWER_S",
    "RESCAN_DONE_S",
    "DagScan",
    "in_daemon_thread",
    "request_rescan",
    "sync_dags",
]

log = logging.getLogger("engine.scheduler")  # the scheduler process's logger
T = TypeVar("T")

#: Asks running schedulers to rescan their DAGs folder now (payload: the requester's token, and
#: after a space the DAG id it looks for, if any).
CHANNEL_DAG_RESCAN = "deferral_dag_rescan"
#: Their answers: ``scanning <token>``, then ``done <token>``.
CHANNEL_DAG_RESCANNED = "deferral_dag_rescanned"
#: How long a requester waits for a scheduler to start the rescan before deciding none runs.
RESCAN_ANSWER_S = 3.0
#: How long it then waits for the rescan to end.
RESCAN_DONE_S = 120.0


async def sync_dags(
    store: Store,
    dagbag: DagBag,
    recorder: DagRecorder | None = None,
    *,
    wait_slow: bool = True,
) -> int:
    """Parse the DAGs folder and record every DAG's structure and schedule; returns how many.
    The DAGs recorded from this folder that it no longer holds (file removed, or DAG removed
    from its file) are marked inactive: no more scheduled runs of them. ``recorder``: the one
    that recorded this bag's DAGs before (it remembers what it serialized). ``wait_slow``:
    wait for files whose import is slow (else they are recorded by a later call)."""
    dags = await in_daemon_thread(lambda: dagbag.collect(wait_slow=wait_slow), name="dag-scan")
    count = await (recorder or DagRecorder(store)).record(dags.values())
    if dagbag.folder is not None:
        # The files that failed to import (dagbag.import_errors) and those still importing
        # keep their DAGs as they were.
        kept = [*dagbag.import_errors.keys(), *map(str, dagbag.slow_imports)]
        # (Shown by `dags list` and the status page until the file imports again or is gone.)
        await store.record_import_errors(
            str(dagbag.folder), dagbag.import_errors, map(str, dagbag.slow_imports)
        )
        gone = await store.deactivate_missing_dags(str(dagbag.folder), dags.keys(), kept)
        for dag_id in gone:
            log.warning(
                "DAG %s is no longer in %s: no more scheduled runs of it (its runs stay; it "
                "is active again once its file defines it)",
                dag_id,
                dagbag.folder,
            )
    # The asset watchers the DAGs declare now run (or stop) on the triggerers.
    await sync_watchers(store)
    return count


async def in_daemon_thread(func: Callable[[], T], *, name: str) -> T:
    """``func()`` in a daemon thread of its own. Unlike a worker thread of anyio, a cancelled
    caller does not wait for it, and it does not hold up the process's exit: a DAG file that
    takes minutes to import must not delay a stopping scheduler (its import child notices
    that its parent is gone and ends, engine/dags/dagparse.py)."""
    done = anyio.Event()
    token = anyio.lowlevel.current_token()
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append((True, func()))
        except BaseException as exc:  # handed to the caller
            outcome.append((False, exc))
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
            anyio.from_thread.run_sync(done.set, token=token)

    threading.Thread(target=target, name=name, daemon=True).start()
    await done.wait()
    ok, value = outcome[0]
    if not ok:
        raise value
    result: T = value
    return result


async def request_rescan(
    store: Store,
    dag_id: str | None = None,
    *,
    answer_s: float = RESCAN_ANSWER_S,
    done_s: float = RESCAN_DONE_S,
) -> bool:
    """Ask the running schedulers to rescan their DAGs folders now and wait until one has
    recorded what it found (``dag_id``: the DAG looked for; a slow file is waited for only if
    that DAG is not found without it); False when no scheduler answered within ``answer_s``
    (none is running, or it is busy) or the rescan did not end within ``done_s``."""
    token = uuid.uuid4().hex
    started, done = anyio.Event(), anyio.Event()

    def on_answer(_channel: str, payload: str) -> None:
        state, _, of = payload.partition(" ")
        if of == token:
            (done if state == "done" else started).set()

    listener = store.listener(CHANNEL_DAG_RESCANNED)
    listener.on_notify(on_answer)
    await listener.ensure_connected()
    try:
        if not listener.connected:
            return False
        await store.notify(CHANNEL_DAG_RESCAN, token if dag_id is None else f"{token} {dag_id}")
        with anyio.move_on_after(answer_s):
            await started.wait()
        if not started.is_set():
            return False
        with anyio.move_on_after(done_s):
            await done.wait()
        return done.is_set()
    finally:
        with anyio.move_on_after(5, shield=True):
            await listener.close()


class DagScan:
    """The scheduler's scan of its DAGs folder: :meth:`run` scans every ``interval_s`` and
    when asked (:meth:`request`), until :meth:`stop`. A scan imports only the files whose
    content changed and writes only the DAGs whose record changed (engine/dags/dagbag.py,
    engine/scheduler/dagrecord.py): a scan of an unchanged folder costs a ``stat`` per file and
    two statements. Any error of a scan is logged and the scan tried again: it must not end
    the scheduler."""

    def __init__(
        self, store: Store, dagbag: DagBag, recorder: DagRecorder, *, interval_s: float
    ) -> None:
        self.store = store
        self.dagbag = dagbag
        #: Records the DAGs of the folder, remembering what it serialized.
        self.recorder = recorder
        #: Seconds between two scans (setting ``dag_rescan_interval_s``).
        self.interval_s = interval_s
        #: Scans completed (for tests and introspection).
        self.scans = 0
        #: The rescan requests not yet served: their token, and the DAG each looks for.
        self._tokens: list[tuple[str, str | None]] = []
        self._dag_ids: frozenset[str] | None = None
        #: Wakes the scan (a rescan request, a stop).
        self._wake = Wakeup()
        self._stopping = False

    def request(self, payload: str) -> None:
        """A rescan request arrived (the payload of ``deferral_dag_rescan``)."""
        token, _, dag_id = payload.partition(" ")
        self._tokens.append((token, dag_id or None))
        self._wake.set()

    def stop(self) -> None:
        """Safe before ``run`` (which then returns at once) and more than once. The imports
        of a scan in flight are stopped: their children end now, and that is no import error
        of their files (the scheduler stops; the scan's thread, which nobody waits for any
        more, took their end for a failure of the file)."""
        self._stopping = True
        self._wake.set()
        self.dagbag.interrupt_imports()

    async def run(self) -> None:
        backoff = Backoff()
        while not self._stopping:
            try:
                await self.scan()
            except TRANSIENT_ERRORS as exc:
                await backoff.wait("recording DAGs", exc)
                continue
            except Exception:  # not the scheduler's end: logged, tried again
                log.exception("recording the DAGs of %s failed", self.dagbag.folder)
                await self._wake.wait(self.interval_s)
                continue
            backoff.reset()
            self.scans += 1
            if not self._tokens:
                await self._wake.wait(self.interval_s)

    async def scan(self) -> None:
        """Scan the folder and record its DAGs, answering the rescan requests it serves. Logs
        a line when the DAGs or the import errors changed (the errors themselves are logged by
        the bag, once per change of their file), saying when the next scan is."""
        dagbag, recorder = self.dagbag, self.recorder
        tokens, self._tokens = self._tokens, []
        for token, _ in tokens:
            await self.store.notify(CHANNEL_DAG_RESCANNED, f"scanning {token}")
        imports, written = dagbag.imports, recorder.written
        try:
            await sync_dags(self.store, dagbag, recorder, wait_slow=False)
            wanted = {dag_id for _, dag_id in tokens}
            if tokens and dagbag.slow_imports and not wanted <= set(dagbag.dags):
                # A DAG asked for (or any, when none was named) may be in a slow file.
                await sync_dags(self.store, dagbag, recorder, wait_slow=True)
        except BaseException:
            self._tokens[:0] = tokens  # served by the next try
            raise
        for token, _ in tokens:
            await self.store.notify(CHANNEL_DAG_RESCANNED, f"done {token}")
        dag_ids = frozenset(dagbag.dags)
        imported, wrote = dagbag.imports - imports, recorder.written - written
        if dag_ids != self._dag_ids or dagbag.newly_reported or imported or wrote:
            errors = len(dagbag.import_errors)
            log.info(
                "recorded %d DAG(s) from %s (%d file(s) imported, %d DAG(s) written)%s; next "
                "scan in %g s (setting dag_rescan_interval_s)",
                len(dag_ids),
                dagbag.folder,
                imported,
                wrote,
                f", {errors} file(s) failed to import" if errors else "",
                self.interval_s,
            )
        else:
            log.debug("rescanned %s: nothing changed", dagbag.folder)
        self._dag_ids = dag_ids
