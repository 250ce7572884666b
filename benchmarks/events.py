"""Asset watchers: how long an outside event takes to become an asset event in the database,
with many watchers on one triggerer.

The run, against a fresh database (embedded server, or ``DEFERRAL_DATABASE_URL``): ``--watchers``
assets, each with one watcher, used by one DAG scheduled on any of them; one triggerer (in this
process, on the same loop as everything else) runs every watcher. Each watcher's
event trigger waits on an in-process queue: the driver puts outside events into random
watchers' queues at ``--rate`` events per second for ``--duration`` seconds, stamping each with
the time it was sent. A scheduler and a worker run too (the in-process engine of
``engine.testing.run_engine``): each event's run's first task notes when it started. Reported:
event -> asset event committed (p50 / p99 / max: seen by a reader polling the events table
every few ms, so the figures include up to that much), event -> first task started, the
database transactions per event (``pg_stat_database.xact_commit`` over the run, every process
of the database included, the reader's own left out), and whether every event was recorded
once. Not covered (left for later): the comparison with polling sensors.
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.results import keep_db_option, out_option, write_result

__all__ = ["events"]


@click.command("events")
@click.option(
    "--watchers",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Assets, each with one watcher, all on one triggerer.",
)
@click.option(
    "--rate",
    type=click.FloatRange(min=0.1),
    default=100.0,
    show_default=True,
    help="Outside events per second, each to a random watcher.",
)
@click.option(
    "--duration",
    type=click.FloatRange(min=1.0),
    default=20.0,
    show_default=True,
    help="Seconds of events.",
)
@out_option
@keep_db_option()
def events(**options: Any) -> None:
    """Event -> asset event latency with many watchers on one triggerer."""
    from benchmarks.events_run import print_table, run_events

    out = options.pop("out")
    result = run_events(**options)
    write_result(result, out)
    print_table(result)
