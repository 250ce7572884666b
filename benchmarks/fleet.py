"""Sensor fleet: N sensors whose conditions come true at random times over a window, each
followed by a short compute task, on W worker slots, in each way a sensor can wait.

For each mode (poke, reschedule, deferrable) against a fresh database: makespan, worker
slot-seconds spent waiting, peak slots held by waiting sensors, queueing delay of the compute
tasks, database statements per sensor, and condition-true -> downstream-start latency.
The condition is real: a file that the benchmark creates at its due time; every mode checks
it every ``--poke-interval`` seconds (the deferrable mode's FileTrigger polls at the same
interval, off the loop). Scheduler, triggerer and worker run in this one process on uvloop,
as ``deferral standalone`` would run them in three.
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.plots import require_matplotlib
from benchmarks.results import keep_db_option, out_option, write_result

__all__ = ["fleet"]

MODES = ("poke", "reschedule", "deferrable")


@click.command("fleet")
@click.option("--sensors", "n", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--slots", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--mode", type=click.Choice([*MODES, "all"]), default="all", show_default=True)
@click.option(
    "--window",
    "window_s",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds over which the conditions come true (uniformly at random).",
)
@click.option("--poke-interval", "poke_interval_s", type=float, default=5.0, show_default=True)
@click.option(
    "--compute-ms",
    type=float,
    default=50.0,
    show_default=True,
    help="Duration of each downstream compute task.",
)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option(
    "--pools",
    is_flag=True,
    help="Put the sensors in a pool 'sensors' that counts deferred tasks (include_deferred) "
    "and the compute tasks in a pool 'compute', each with a slot for every task: admission "
    "at work, never holding one back.",
)
@click.option(
    "--mapped",
    is_flag=True,
    help="One run whose upstream task returns the N files and a deferrable FileSensor "
    "expanded over them (expand): reports the time from the upstream's end to all N "
    "instances deferred, the slot-seconds and the statements per sensor (--mode, --pools "
    "and --compute-ms do not apply).",
)
@out_option
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    help="Write a PNG of slots held over time (needs the 'plot' extra).",
)
@keep_db_option("databases")
def fleet(**options: Any) -> None:
    """A fleet of sensors on a few worker slots, in poke, reschedule and deferrable mode."""
    from benchmarks.fleet_run import print_table, run_fleet

    plot = options.pop("plot")
    out = options.pop("out")
    if options.pop("mapped"):
        if plot:
            raise click.UsageError("--plot is for the fleet's modes, not --mapped")
        from benchmarks.fleet_mapped import print_mapped, run_mapped_fleet

        result = run_mapped_fleet(
            n=options["n"],
            slots=options["slots"],
            window_s=options["window_s"],
            poke_interval_s=options["poke_interval_s"],
            seed=options["seed"],
            keep_db=options["keep_db"],
        )
        write_result(result, out)
        print_mapped(result)
        return
    if plot:
        require_matplotlib()  # now, not after the run
    mode = options.pop("mode")
    modes = list(MODES) if mode == "all" else [mode]
    result = run_fleet(modes=modes, **options)
    write_result(result, out)
    print_table(result)
    if plot:
        from benchmarks.fleet_run import plot_slots

        plot_slots(result, plot)
