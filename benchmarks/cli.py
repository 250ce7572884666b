"""The ``bench`` command group, and the one place its commands are registered.

A scenario is a module of ``benchmarks/`` that defines its command with
``@click.command("<name>")`` and imports nothing of this module (its run sits in
``<name>_run.py``, imported when the command runs). To add one, import its command below and
add it with ``bench.add_command(<command>)``: one line each. The scenarios never import this
module (import-linter: "Benchmark scenarios do not import the bench group", and no cycle
among benchmarks' modules), so the group is built in this one place.
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.claims import claims
from benchmarks.events import events
from benchmarks.fleet import fleet
from benchmarks.plots import plot
from benchmarks.processes import ended_with_children
from benchmarks.schedule import schedule
from benchmarks.throughput import throughput
from benchmarks.waits import waits
from benchmarks.web import web

__all__ = ["bench"]


class _Bench(click.Group):
    """Every scenario runs under ``ended_with_children`` (benchmarks/processes.py): stopped by
    SIGTERM or Ctrl-C, or failing, a benchmark ends every process it started."""

    def invoke(self, ctx: click.Context) -> Any:
        with ended_with_children():
            return super().invoke(ctx)


@click.group(cls=_Bench, context_settings={"help_option_names": ["-h", "--help"]})
def bench() -> None:
    """Benchmarks of the engine (results as JSON; figures in docs/benchmarks.md)."""


bench.add_command(waits)
bench.add_command(fleet)
bench.add_command(schedule)
bench.add_command(claims)
bench.add_command(web)
bench.add_command(throughput)
bench.add_command(events)
bench.add_command(plot)
