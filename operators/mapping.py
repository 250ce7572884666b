"""The arithmetic of dynamic task mapping (``expand``), on plain values.

A mapped task's instances come from the values it is expanded over, once they are known:
``expand(a=[1, 2], b=["x", "y", "z"])`` makes one instance per combination (2 x 3 = 6, the
last argument varying fastest: map index 0 is ``a=1, b="x"``, 1 is ``a=1, b="y"``, ...);
``expand_kwargs([{...}, {...}])`` one instance per dict. A value expanded over is a list or a
tuple (each item an instance), or a dict (each ``(key, value)`` pair an instance). This module
imports nothing of the contract: ``operators.base`` declares mapped tasks with it and the
worker expands them with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MapInputError",
    "check_literal",
    "kwargs_at",
    "kwargs_length",
    "lengths",
    "product_length",
    "values_at",
]


class MapInputError(ValueError):
    """A value a task is expanded over cannot be mapped (its type, or the shape of an
    ``expand_kwargs`` item)."""


def _kind(value: Any) -> str:
    return type(value).__name__


def check_literal(task_id: str, name: str, value: Any) -> None:
    """A value given to ``expand`` as it is declared: a list, a tuple or a dict."""
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple | dict):
        raise MapInputError(
            f"task {task_id}: expand({name}=...) needs a list, a tuple, a dict or a reference "
            f"to an upstream task's value (XComArg), got {_kind(value)}"
        )


def _sequence(task_id: str, name: str, value: Any) -> list[Any] | tuple[Any, ...]:
    if isinstance(value, list | tuple):
        return value
    if isinstance(value, dict):
        return [(k, v) for k, v in value.items()]
    raise MapInputError(
        f"task {task_id}: cannot map over {name}: it is a {_kind(value)}, not a list, a tuple "
        "or a dict"
    )


def lengths(task_id: str, values: Mapping[str, Any]) -> dict[str, int]:
    """How many items each expanded argument has (MapInputError for one that is no list)."""
    return {name: len(_sequence(task_id, name, value)) for name, value in values.items()}


def product_length(task_id: str, values: Mapping[str, Any]) -> int:
    """How many instances ``expand(**values)`` makes: the product of the lengths."""
    return math.prod(lengths(task_id, values).values())


def values_at(task_id: str, values: Mapping[str, Any], map_index: int) -> dict[str, Any]:
    """The arguments of instance ``map_index`` of ``expand(**values)`` (the last argument
    varying fastest, as ``itertools.product``)."""
    sizes = lengths(task_id, values)
    total = math.prod(sizes.values())
    if not 0 <= map_index < total:
        raise IndexError(
            f"task {task_id}: map index {map_index} is out of range: it expands into {total} "
            "instance(s)"
        )
    found: dict[str, Any] = {}
    index = map_index
    for name in reversed(list(values)):
        size = sizes[name]
        found[name] = _sequence(task_id, name, values[name])[index % size]
        index //= size
    return {name: found[name] for name in values}


def _kwargs_items(task_id: str, value: Any) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise MapInputError(
            f"task {task_id}: expand_kwargs needs a list of dicts, got {_kind(value)}"
        )
    return value


def kwargs_length(task_id: str, value: Any) -> int:
    """How many instances ``expand_kwargs(value)`` makes."""
    return len(_kwargs_items(task_id, value))


def kwargs_at(task_id: str, value: Any, map_index: int) -> dict[str, Any]:
    """The arguments of instance ``map_index`` of ``expand_kwargs(value)``."""
    items = _kwargs_items(task_id, value)
    if not 0 <= map_index < len(items):
        raise IndexError(
            f"task {task_id}: map index {map_index} is out of range: it expands into "
            f"{len(items)} instance(s)"
        )
    item = items[map_index]
    if not isinstance(item, dict) or not all(isinstance(k, str) for k in item):
        raise MapInputError(
            f"task {task_id}: expand_kwargs item {map_index} must be a dict with str keys, got "
            f"{_kind(item)}"
        )
    return dict(item)
