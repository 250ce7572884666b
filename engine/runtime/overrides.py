"""A process's config with some of its fields given as keyword arguments of the process's
constructor (``Worker(store, bag, slots=3)``): the one rule the worker, the triggerer and the
scheduler share for them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

__all__ = ["overridden"]

C = TypeVar("C", bound=msgspec.Struct)


def overridden(config: C, overrides: Mapping[str, Any], owner: str) -> C:
    """``config`` with the fields ``overrides`` names set to their values (its own checks
    run again). A name that is not a field of the config is a TypeError naming it, ``owner``
    (the constructor given it) and the fields there are."""
    if not overrides:
        return config
    fields = type(config).__struct_fields__
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(
            f"{owner}() got an unexpected keyword argument {unknown[0]!r}: not a field of "
            f"{type(config).__name__} ({', '.join(fields)})"
        )
    return msgspec.structs.replace(config, **overrides)
