"""XCom on the worker: the ``ti`` of a running task, its pushes and pulls, its return value.

``context["ti"]`` is a :class:`RuntimeTaskInstance`. ``xcom_push`` encodes the value at once
(a value that does not encode, or is larger than the setting ``xcom_max_bytes``, raises
:class:`XComError` there, which fails the task) and keeps it until the try's call ends: the
pushes of a call that returns, defers, reschedules or skips are written, in one statement,
just before its outcome (:func:`finish_try`); a call that fails writes none of them.
``xcom_pull`` reads the store: from a worker thread (a plain ``def`` task, templates that
read ``ti``) it waits for the worker's loop to run the query; an ``async def`` task awaits
``xcom_pull_async`` instead. The return value is encoded where the try's outcome is made
(``outcomes.py``, also in an isolated task's child), checked against ``xcom_max_bytes`` by
:func:`finish_try`, and stored as the task's result, with its outcome, in one statement.

References (:class:`operators.xcom.XComArg`) in a task's templated fields are replaced by
their values once the fields are rendered (:func:`resolve_refs`): one statement per key.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from engine.masking import redact
from engine.runtime.retry import with_db_retry
from engine.worker.mapping import ref_value
from engine.worker.outcomes import (
    Deferred,
    Raised,
    Rescheduled,
    Returned,
    Skipped,
    TryOutcome,
    xcom_size_error,
    xcom_type_error,
)
from engine.worker.templating import jsonable
from operators.xcom import RETURN_KEY, XComError, find_refs, replace_refs
from triggers.base import decode_value
from triggers.values import encode_data

if TYPE_CHECKING:
    from engine.store import ClaimedTask, Store
    from operators.base import BaseOperator

__all__ = [
    "RuntimeTaskInstance",
    "XComError",
    "encode_xcom",
    "finish_try",
    "resolve_refs",
    "write_pushes",
]


log = logging.getLogger(__name__)

#: The ``ti`` of the try this asyncio task (one per try on the worker) runs.
_bound: ContextVar[RuntimeTaskInstance | None] = ContextVar("deferral_xcom_ti", default=None)


def _task_name(dag_id: str, task_id: str) -> str:
    return f"{dag_id}.{task_id}"


def encode_xcom(task: str, key: str, value: Any, max_bytes: int) -> bytes:
    """``value`` encoded for the store; XComError naming the task, the key and the type (or
    the size and the setting) when it cannot be stored."""
    try:
        data = encode_data(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise XComError(xcom_type_error(task, key, exc)) from None
    if len(data) > max_bytes:
        what = f"the {type(value).__name__}"
        raise XComError(xcom_size_error(task, key, what, len(data), max_bytes))
    return data


async def finish_try(
    store: Store, ti: ClaimedTask, worker_id: int, outcome: TryOutcome, max_bytes: int
) -> TryOutcome:
    """The try's outcome once its XComs are settled: a return value larger than
    ``max_bytes`` fails it (no retry); a try that returned, deferred, rescheduled or skipped
    has what it pushed written first (one statement; none when it pushed nothing); a failed
    try writes none of it."""
    if isinstance(outcome, Returned) and outcome.result is not None:
        size = len(outcome.result)
        if size > max_bytes:
            name = _task_name(ti.dag_id, ti.task_id)
            why = xcom_size_error(name, RETURN_KEY, "the return value", size, max_bytes)
            return Raised(why, no_retry=True)
    if isinstance(outcome, Returned | Deferred | Rescheduled | Skipped):
        await write_pushes(store, ti, worker_id)
    return outcome


class RuntimeTaskInstance:
    """``ti`` in the context and in templates: the running task instance, with XCom."""

    def __init__(
        self,
        ti: ClaimedTask,
        store: Store,
        *,
        max_bytes: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.id = ti.id
        self.dag_id = ti.dag_id
        self.run_id = ti.run_id
        self.task_id = ti.task_id
        self.try_number = ti.try_number
        #: The instance of a mapped task (0..n-1); -1: not mapped.
        self.map_index = ti.map_index
        self._store = store
        self._max_bytes = max_bytes
        self._loop = loop
        self._pushed: dict[str, bytes] = {}

    def __repr__(self) -> str:
        return (
            f"<TaskInstance {self.dag_id}.{self.task_id} run {self.run_id} try {self.try_number}>"
        )

    # -- push ------------------------------------------------------------------------------

    def xcom_push(self, key: str, value: Any) -> None:
        """Store ``value`` under ``key`` for this try (written when the call ends; a later
        push of the same key replaces it). XComError, at once, for a value that cannot be
        stored."""
        if not isinstance(key, str) or not key:
            raise XComError(
                f"task {_task_name(self.dag_id, self.task_id)}: an XCom key must be a "
                f"non-empty str, got {key!r}"
            )
        self._pushed[key] = encode_xcom(
            _task_name(self.dag_id, self.task_id), key, value, self._max_bytes
        )

    def take_pushes(self) -> list[tuple[str, bytes]]:
        pushed, self._pushed = self._pushed, {}
        return list(pushed.items())

    # -- pull ------------------------------------------------------------------------------

    def xcom_pull(
        self,
        task_ids: str | Iterable[str] | None = None,
        key: str = RETURN_KEY,
        dag_id: str | None = None,
        run_id: str | None = None,
        map_indexes: int | Iterable[int] | None = None,
        default: Any = None,
        include_prior_dates: bool = False,
    ) -> Any:
        """The XCom ``key`` of ``task_ids`` in this run (or in run ``run_id`` of ``dag_id``):
        one task id (or None: whichever task has one, the latest) gives its value, or
        ``default`` when it has none; a list of task ids gives a list of the values found, in
        the order of ``task_ids``. A mapped task's value is the list of its instances' values
        in map index order; ``map_indexes`` picks instances (an int: that one's value; a list:
        a list). From a worker thread (a ``def`` task, templates); an ``async def`` task
        awaits :meth:`xcom_pull_async`."""
        call = self.xcom_pull_async(
            task_ids, key, dag_id, run_id, map_indexes, default, include_prior_dates
        )
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            call.close()
            raise RuntimeError(
                "ti.xcom_pull() cannot wait on the worker's event loop (an async def task): "
                "use `await ti.xcom_pull_async(...)`, which takes the same arguments"
            )
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    async def xcom_pull_async(
        self,
        task_ids: str | Iterable[str] | None = None,
        key: str = RETURN_KEY,
        dag_id: str | None = None,
        run_id: str | None = None,
        map_indexes: int | Iterable[int] | None = None,
        default: Any = None,
        include_prior_dates: bool = False,
    ) -> Any:
        """:meth:`xcom_pull` for an ``async def`` task."""
        del include_prior_dates  # (accepted as Airflow does; runs are addressed by run_id)
        if not isinstance(key, str) or not key:
            raise ValueError(f"an XCom key must be a non-empty str, got {key!r}")
        single = task_ids is None or isinstance(task_ids, str)
        if map_indexes is not None and not isinstance(map_indexes, int):
            single = False
        wanted: list[str] | None
        if task_ids is None:
            wanted = None
        elif isinstance(task_ids, str):
            wanted = [task_ids]
        else:
            wanted = list(task_ids)
            if not all(isinstance(t, str) for t in wanted):
                raise TypeError(f"task_ids must be a str or a list of str, got {task_ids!r}")
        indexes: list[int] | None = None
        if isinstance(map_indexes, int):
            indexes = [map_indexes]
        elif map_indexes is not None:
            indexes = list(map_indexes)
            if not all(isinstance(i, int) for i in indexes):
                raise TypeError(f"map_indexes must be an int or a list of int, got {map_indexes!r}")
        rows = await self._read(dag_id or self.dag_id, run_id or self.run_id, wanted, key)
        if indexes is not None:
            rows = [row for row in rows if row.map_index in indexes]
        if single:
            if not rows:
                return default
            first = rows[0]
            if map_indexes is not None or first.map_index < 0:
                return decode_value(first.value)
            # A mapped task: its instances' values, by map index (as Airflow gives them).
            return [decode_value(r.value) for r in rows if r.task_id == first.task_id]
        order = wanted if wanted is not None else sorted({row.task_id for row in rows})
        rank = {t: n for n, t in enumerate(order)}
        slot = {i: n for n, i in enumerate(indexes)} if indexes is not None else {}
        found = sorted(
            (row for row in rows if row.task_id in rank),
            key=lambda row: (rank[row.task_id], slot.get(row.map_index, row.map_index)),
        )
        return [decode_value(row.value) for row in found]

    async def _read(
        self, dag_id: str, run_id: str, task_ids: Sequence[str] | None, key: str
    ) -> list[Any]:
        store = self._store
        return await with_db_retry(
            "pull XComs", lambda: store.pull_xcom(dag_id, run_id, task_ids, key)
        )

    # -- other runs ------------------------------------------------------------------------

    async def trigger_dag_run(
        self,
        dag_id: str,
        *,
        run_id: str | None = None,
        conf: dict[str, Any] | None = None,
        logical_date: Any = None,
        reset: bool = False,
    ) -> dict[str, Any]:
        """Create a run of ``dag_id`` (what ``TriggerDagRunOperator`` does; see
        :func:`engine.worker.dagruns.trigger_dag_run`), from the worker's loop."""
        from engine.worker.dagruns import trigger_dag_run

        return await trigger_dag_run(
            self._store,
            f"task {_task_name(self.dag_id, self.task_id)} (run {self.run_id})",
            dag_id,
            run_id=run_id,
            conf=dict(conf or {}),
            logical_date=logical_date,
            reset=reset,
        )

    def info(self) -> dict[str, Any]:
        """The plain data of ``ti`` (for a child process, which has no store to ask)."""
        return {
            "id": self.id,
            "dag_id": self.dag_id,
            "run_id": self.run_id,
            "task_id": self.task_id,
            "try_number": self.try_number,
            "map_index": self.map_index,
        }


def bind(
    ti: ClaimedTask, store: Store, *, max_bytes: int, loop: asyncio.AbstractEventLoop
) -> RuntimeTaskInstance:
    """The ``ti`` of a call of the try ``ti``, bound to the running asyncio task (the worker
    runs each try in one) so that :func:`write_pushes` finds what it pushed."""
    rti = RuntimeTaskInstance(ti, store, max_bytes=max_bytes, loop=loop)
    _bound.set(rti)
    return rti


async def write_pushes(store: Store, ti: ClaimedTask, worker_id: int) -> None:
    """Write the values the try's call pushed (nothing when it pushed none), before its
    outcome: one statement, only while this worker holds the try."""
    rti = _bound.get()
    if rti is None or rti.id != ti.id or rti.try_number != ti.try_number:
        return
    values = rti.take_pushes()
    if values:
        await with_db_retry(
            "store pushed XComs",
            lambda: store.push_xcom(ti.id, worker_id, ti.try_number, values),
        )


async def resolve_refs(
    op: BaseOperator, rti: RuntimeTaskInstance, rendered: dict[str, Any] | None = None
) -> None:
    """Replace the references in ``op``'s templated fields by their values (in ``rendered``,
    what the fields rendered to, too): one read per key. Done after rendering, so a value is
    never taken for a template. A task without a return value gives None; a reference to
    another key a task does not have is an XComError."""
    fields = {
        name: value
        for name in getattr(op, "template_fields", ())
        if find_refs(value := getattr(op, name, None))
    }
    if not fields:
        return
    by_key: dict[str, set[str]] = collections.defaultdict(set)
    # A missing return value is None (a task that returned None stores none), as is a missing
    # key of a multiple_outputs task; any other missing key is an error (Airflow's rules).
    may_lack: set[tuple[str, str]] = set()
    for value in fields.values():
        for ref in find_refs(value):
            by_key[ref.key].add(ref.task_id)
            if ref.key == RETURN_KEY or getattr(ref.operator, "multiple_outputs", False):
                may_lack.add((ref.task_id, ref.key))
    values: dict[tuple[str, str], Any] = dict.fromkeys(may_lack)
    refs = {(ref.task_id, ref.key): ref for v in fields.values() for ref in find_refs(v)}
    for key, task_ids in by_key.items():
        rows = await rti._read(rti.dag_id, rti.run_id, sorted(task_ids), key)
        for task_id in task_ids:
            # (a mapped task's value: the list of its instances' values, by map index)
            found = ref_value(refs[(task_id, key)], rows, default=_NONE)
            if found is not _NONE:
                values[(task_id, key)] = found
        missing = sorted(t for t in task_ids if (t, key) not in values)
        if missing:
            raise XComError(
                f"task {_task_name(rti.dag_id, rti.task_id)}: no XCom {key!r} of "
                f"{', '.join(missing)} in this run (did it push one?)"
            )
    for name, value in fields.items():
        setattr(op, name, replace_refs(value, values))
        if rendered is not None and name in rendered:
            rendered[name] = redact(jsonable(getattr(op, name)))


_NONE = object()


def plain_context(context: Any) -> Any:
    """The context with ``ti`` as plain data (for a child process, which has no store)."""
    rti = context.get("ti")
    if isinstance(rti, RuntimeTaskInstance):
        return {**context, "ti": rti.info(), "task_instance": rti.info()}
    return context
