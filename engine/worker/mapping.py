"""Mapped tasks on the worker: expanding one, and building the operator of one instance.

A mapped task's run starts with one task instance, map index -1. Once its upstream tasks are
done it is claimed like any task, and the worker, instead of running it, reads the values it
is expanded over (the upstream values it refers to; literal lists are in the DAG) and ends
the claim with an :class:`~engine.worker.outcomes.Expanded` outcome: the store turns the
instance into instances 0..n-1, scheduled (``expand_task``, one statement). An empty list
skips the task; more values than the setting ``max_map_length`` fail it, without retries.
Each instance, claimed in turn, reads the same values and runs the operator built from the
task's shared arguments and its own (:meth:`operators.base.MappedOperator.unmap`).

A reference to a mapped task's value is the list of its instances' values, in map index
order (:func:`ref_value`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.runtime.retry import with_db_retry
from engine.worker.outcomes import Expanded, Raised, Skipped, TryOutcome
from operators.base import BaseOperator, MappedOperator
from operators.mapping import (
    MapInputError,
    kwargs_at,
    kwargs_length,
    product_length,
    values_at,
)
from operators.xcom import XComArg, replace_refs
from triggers.base import decode_value
from triggers.values import encode_data

if TYPE_CHECKING:
    from engine.store import ClaimedTask, Store
    from engine.store.xcom import XComRow

__all__ = ["prepare", "ref_value"]


def ref_value(ref: XComArg, rows: Sequence[XComRow], default: Any = None) -> Any:
    """The value ``ref`` stands for among the XCom rows of its task: the list of a mapped
    task's values by map index (empty when it has no instance with one), else the one
    value (``default`` without one)."""
    own = [r for r in rows if r.task_id == ref.task_id]
    if isinstance(ref.operator, MappedOperator) or any(r.map_index >= 0 for r in own):
        return [decode_value(r.value) for r in sorted(own, key=lambda r: r.map_index)]
    return decode_value(own[0].value) if own else default


async def _resolve(op: MappedOperator, ti: ClaimedTask, store: Store) -> Any:
    """The values ``op`` is expanded over, references replaced by their values (one read
    per reference)."""
    spec = op.expand_input if op.expand_input is not None else op.expand_kwargs_input
    values: dict[tuple[str, str], Any] = {}
    for ref in op.references():
        if (ref.task_id, ref.key) in values:
            continue
        rows = await with_db_retry("pull XComs", functools.partial(_pull, store, ti, ref))
        found = ref_value(ref, rows, default=_MISSING)
        if found is _MISSING:
            raise MapInputError(
                f"task {ti.dag_id}.{ti.task_id} is mapped over the XCom {ref.key!r} of task "
                f"{ref.task_id}, which has none in this run (did it return a value?)"
            )
        values[(ref.task_id, ref.key)] = found
    return replace_refs(spec, values)


_MISSING = object()


async def _pull(store: Store, ti: ClaimedTask, ref: XComArg) -> list[XComRow]:
    return await store.pull_xcom(ti.dag_id, ti.run_id, [ref.task_id], ref.key)


def _own_values(op: MappedOperator, name: str, values: Any, count: int) -> list[bytes] | None:
    """Each instance's own arguments, encoded (the store keeps them with the instance, so
    that it need not read the upstream values again); None when one does not encode (a
    literal of the DAG that is no data: each instance then takes its own from the DAG)."""
    try:
        if op.expand_input is not None:
            return [encode_data(values_at(name, values, i)) for i in range(count)]
        return [encode_data(kwargs_at(name, values, i)) for i in range(count)]
    except (TypeError, ValueError, OverflowError):
        return None


async def prepare(
    op: MappedOperator, ti: ClaimedTask, store: Store, max_map_length: int
) -> BaseOperator | TryOutcome:
    """For the unexpanded instance (map index -1): how many instances it becomes (an
    :class:`Expanded` outcome), or why it does not (skipped: no values; failed: too many or
    not a list). For instance ``i``: its operator."""
    name = f"{ti.dag_id}.{ti.task_id}"
    if ti.map_index >= 0 and ti.map_value is not None:
        # (its own arguments, as the expansion read them)
        own = decode_value(ti.map_value)
        return op.unmap(own, op.resolved_names(own, ti.map_index))
    try:
        values = await _resolve(op, ti, store)
        if op.expand_input is not None:
            count = product_length(name, values)
        else:
            count = kwargs_length(name, values)
        if ti.map_index < 0:
            if count == 0:
                return Skipped(f"task {name} is mapped over no values: skipped")
            if count > max_map_length:
                return Raised(
                    f"task {name} is mapped over {count} values, more than the limit of "
                    f"{max_map_length} instances (setting max_map_length)",
                    no_retry=True,
                )
            return Expanded(count, _own_values(op, name, values, count))
        if op.expand_input is not None:
            own = values_at(name, values, ti.map_index)
        else:
            own = kwargs_at(name, values, ti.map_index)
    except (MapInputError, IndexError) as exc:
        return Raised(str(exc), no_retry=True)
    return op.unmap(own, op.resolved_names(own, ti.map_index))
