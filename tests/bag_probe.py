"""A probe for the DagBag swap test: a DAG file built by that test records, while the bag is
reloading it, what a reader of the bag sees at that moment (nothing when ``bag`` is None, as
in the child process that checks DAG files)."""

from __future__ import annotations

from typing import Any

bag: Any = None
seen: list[list[str]] = []
