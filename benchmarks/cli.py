"""The ``bench`` command group; scenario modules register their commands on it."""

from __future__ import annotations

import importlib
import importlib.util

import click

__all__ = ["SCENARIOS", "bench"]

#: Scenario modules, imported to register their commands (then ``plots``: ``bench plot``).
SCENARIOS = ("waits", "fleet", "schedule", "claims")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks of the engine (results as JSON; figures in docs/benchmarks.md)."""


for _name in SCENARIOS:
    if importlib.util.find_spec(f"benchmarks.{_name}") is not None:
        importlib.import_module(f"benchmarks.{_name}")

importlib.import_module("benchmarks.plots")
