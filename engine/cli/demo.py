"""``deferral demo``: the bundled demo on the embedded database."""

from __future__ import annotations

import sys

import click

from engine.cli.common import SECONDS, _settings


@click.command()
@click.option(
    "--sensors",
    type=click.IntRange(min=1),
    default=300,
    show_default=True,
    help="Deferrable timer sensors in the demo DAG.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="Submit-and-wait tasks on a local job API.",
)
@click.option(
    "--slots", type=click.IntRange(min=1), default=4, show_default=True, help="Worker slots."
)
@click.option(
    "--window",
    type=SECONDS,
    default=10.0,
    show_default=True,
    help="Timers fire between WINDOW and 2*WINDOW seconds after the start.",
)
@click.pass_context
def demo(ctx: click.Context, sensors: int, jobs: int, slots: int, window: float) -> None:
    """Run the bundled demo DAG on the embedded database and print a summary."""
    from engine.demo.run import run_demo

    ok = run_demo(_settings(ctx), sensors=sensors, jobs=jobs, slots=slots, window_s=window)
    sys.exit(0 if ok else 1)
