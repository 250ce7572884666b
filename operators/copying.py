"""Copying an operator for one execution, faster than ``copy.deepcopy`` for the usual operator
(a worker copies one for every try and every resume). Imports nothing of the contract."""

from __future__ import annotations

import copy
import copyreg
import datetime as dt
import types
from typing import Any, TypeVar

__all__ = ["fresh_copy"]

T = TypeVar("T")

#: Types whose values deepcopy returns as they are.
_IMMUTABLE: frozenset[type] = frozenset(
    {
        type(None), bool, int, float, complex, str, bytes, range, type,
        dt.datetime, dt.date, dt.time, dt.timedelta, dt.timezone,
        types.FunctionType, types.BuiltinFunctionType,
    }
)  # fmt: skip


_BY_DICT: dict[type, bool] = {}


def _copies_by_dict(cls: type) -> bool:
    """Whether deepcopy would copy an instance of ``cls`` as a new object with a deep copy
    of its ``__dict__`` (no custom copy or pickle hooks, no ``__slots__``)."""
    known = _BY_DICT.get(cls)
    if known is None:
        known = _BY_DICT[cls] = _plain_copy_hooks(cls)
    return known


def _plain_copy_hooks(cls: type) -> bool:
    return (
        getattr(cls, "__deepcopy__", None) is None
        and cls not in copyreg.dispatch_table
        and getattr(cls, "__reduce_ex__", None) is object.__reduce_ex__
        and getattr(cls, "__reduce__", None) is object.__reduce__
        and getattr(cls, "__getstate__", None) is object.__getstate__
        and getattr(cls, "__setstate__", None) is None
        and getattr(cls, "__getnewargs__", None) is None
        and getattr(cls, "__getnewargs_ex__", None) is None
        # Either could answer __deepcopy__ for an instance.
        and getattr(cls, "__getattr__", None) is None
        and getattr(cls, "__getattribute__", None) is object.__getattribute__
        and not any("__slots__" in vars(k) for k in cls.__mro__ if k is not object)
    )


def fresh_copy(obj: T, shared: object = None) -> T:
    """What ``copy.deepcopy(obj)`` makes, with ``shared`` (an operator's DAG) shared, not
    copied. An object whose state is its ``__dict__`` is built directly: its immutable
    attribute values are shared, and its flat containers copied, not sent through deepcopy
    one by one."""
    memo: dict[int, Any] = {}
    if shared is not None:
        memo[id(shared)] = shared
    cls = type(obj)
    if not _copies_by_dict(cls) or "__deepcopy__" in obj.__dict__:
        return copy.deepcopy(obj, memo)
    new = cls.__new__(cls)
    memo[id(obj)] = new
    state = new.__dict__
    for key, value in obj.__dict__.items():
        state[key] = value if type(value) in _IMMUTABLE else _copy_value(value, memo)
    return new


def _copy_value(value: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy(value, memo)``, made directly for a list, set, dict, tuple or frozenset
    of immutable values (an operator's ``upstream_task_ids``, its empty ``inlets``): deepcopy
    copies a set or a frozenset through its pickle protocol, which looks up the slot names of
    its type on every copy."""
    found = memo.get(id(value), _MISSING)
    if found is not _MISSING:
        return found  # (the DAG; a value reached twice stays one value in the copy)
    cls = type(value)
    if cls in _FLAT:
        if cls is dict:
            flat = all(type(k) in _IMMUTABLE and type(v) in _IMMUTABLE for k, v in value.items())
        else:
            flat = all(type(v) in _IMMUTABLE for v in value)
        if flat:
            # (An immutable container of immutable values is its own copy.)
            made = value if cls is tuple or cls is frozenset else value.copy()
            memo[id(value)] = made
            # As deepcopy does: the original is kept alive (its id not reused) with the memo.
            memo.setdefault(id(memo), []).append(value)
            return made
    return copy.deepcopy(value, memo)


#: Containers :func:`_copy_value` copies itself when they hold only immutable values.
_FLAT: frozenset[type] = frozenset({list, set, dict, tuple, frozenset})

_MISSING = object()
