"""Scheduling delay: N DAGs on one cron schedule, run by a scheduler process for a while.

For each scheduled run created while the benchmark measures: interval end -> run created
(the database clock at the insert), as p50 / p99 / max; and the CPU the scheduler process
spent per minute (also the worker's, which runs the runs' one task so they end). Airflow's
metric for the same delay is ``dagrun.schedule_delay``.
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.results import keep_db_option, out_option, write_result

__all__ = ["schedule"]


@click.command("schedule")
@click.option("--dags", "n", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option(
    "--schedule", "cron", default="* * * * *", show_default=True, help="Cron of every DAG."
)
@click.option(
    "--duration",
    "duration_s",
    type=click.FloatRange(min=1.0),
    default=180.0,
    show_default=True,
    help="Seconds measured, after every DAG is recorded.",
)
@click.option(
    "--tasks", type=click.IntRange(min=1), default=1, show_default=True, help="Tasks per DAG."
)
@out_option
@keep_db_option()
def schedule(**options: Any) -> None:
    """Scheduling delay (interval end -> run created) and scheduler CPU for many DAGs."""
    from benchmarks.schedule_run import print_table, run_schedule

    out = options.pop("out")
    result = run_schedule(**options)
    write_result(result, out)
    print_table(result)
