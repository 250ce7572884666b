"""Addressing a mapped task's instance: ``TASK[3]``, or ``TASK`` with ``--map-index 3``, in
the CLI and on the status page; bad addresses get errors that say what exists.
"""

from __future__ import annotations

import re

from engine.store import Store

__all__ = ["BadAddress", "check_instance", "parse_task"]

_ADDRESS = re.compile(r"^(?P<task>[^\[\]]+)(?:\[(?P<index>[^\]]*)\])?$")


class BadAddress(LookupError):
    """A task address that names no task instance (its text, or an index that is not)."""


def parse_task(text: str, map_index: int | None = None) -> tuple[str, int]:
    """``(task_id, map_index)`` of ``TASK`` or ``TASK[i]`` (``map_index``: a ``--map-index``
    given too; -1: not a mapped instance)."""
    match = _ADDRESS.match(text)
    if match is None:
        raise BadAddress(
            f"{text!r} is no task address: write TASK, or TASK[i] for instance i of a mapped task"
        )
    task_id, index_text = match.group("task"), match.group("index")
    if index_text is None:
        return task_id, -1 if map_index is None else map_index
    if not index_text.isdigit():
        raise BadAddress(
            f"{text!r}: the map index in brackets must be a number >= 0, as {task_id}[3]; "
            f"got {index_text!r}"
        )
    index = int(index_text)
    if map_index is not None and map_index != index:
        raise BadAddress(f"{text!r} and --map-index {map_index} name different instances")
    return task_id, index


def _span(indexes: list[int]) -> str:
    return f"{len(indexes)} mapped instance(s), [{indexes[0]}] to [{indexes[-1]}]"


async def check_instance(
    store: Store, dag_id: str, run_id: str, task_id: str, map_index: int
) -> None:
    """Raise :class:`BadAddress` when the task has instances in the run but not this one (a
    mapped task addressed without an index, an index out of range, an index for a task that
    is not mapped). A task with no instance at all is left to the caller's own message."""
    indexes = await store.task_map_indexes(dag_id, run_id, task_id)
    if not indexes or map_index in indexes:
        return
    where = f"in run {run_id!r} of DAG {dag_id!r}"
    if indexes == [-1]:
        raise BadAddress(
            f"task {task_id!r} {where} has no instance [{map_index}]: it is not mapped, or "
            "not expanded yet (its upstream values are not known); address it as "
            f"{task_id!r} alone"
        )
    if map_index < 0:
        raise BadAddress(
            f"task {task_id!r} {where} is mapped into {_span(indexes)}: address one as "
            f"{task_id}[{indexes[0]}] or with --map-index {indexes[0]}"
        )
    raise BadAddress(
        f"{task_id}[{map_index}]: the map index is out of range: task {task_id!r} {where} "
        f"has {_span(indexes)}"
    )
