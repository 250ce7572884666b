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
once.

``--compare-sensors 5,60`` then runs the same fleet as deferrable sensors polling every 5 s and
every 60 s (:mod:`benchmarks.events_sensors`, each on a fresh database): as many sensors as
watchers, one event to each sensor at the same rate, the same source kind; reported side by
side: event -> the sensor's task resumed, and transactions per event counted the same way
(``xact_commit`` over the run), arming the sensors (their run created, each one's first check
and deferral) included, since a sensor serves one event and must be armed again for the next.
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.results import keep_db_option, out_option, write_result

__all__ = ["events"]


def _poke_intervals(ctx: click.Context, param: click.Parameter, value: str) -> list[float]:
    """``5,60`` -> ``[5.0, 60.0]``: poll intervals in seconds, each above 0."""
    intervals: list[float] = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        try:
            interval = float(part)
        except ValueError:
            raise click.BadParameter(
                f"{part!r} is not a number of seconds (expected e.g. 5,60)"
            ) from None
        if not interval > 0 or interval == float("inf"):
            raise click.BadParameter(f"poll interval {part} must be a positive number of seconds")
        intervals.append(interval)
    return intervals


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
@click.option(
    "--compare-sensors",
    "compare_sensors",
    callback=_poke_intervals,
    default="",
    metavar="S[,S...]",
    help="Also run the fleet as deferrable sensors polling every S seconds (e.g. 5,60).",
)
@out_option
@keep_db_option()
def events(**options: Any) -> None:
    """Event latency with many watchers on one triggerer, and with polling sensors.

    With --compare-sensors the same fleet runs as deferrable sensors polling every S seconds,
    reported beside the watchers (latency and transactions per event)."""
    from benchmarks.events_run import print_table, run_events

    out = options.pop("out")
    intervals: list[float] = options.pop("compare_sensors")
    result = run_events(**options)
    if intervals:
        from benchmarks.events_sensors import run_sensors

        result["sensors"] = [
            run_sensors(
                sources=options["watchers"],
                rate=options["rate"],
                poke_interval=interval,
                keep_db=options["keep_db"],
            )
            for interval in intervals
        ]
    write_result(result, out)
    print_table(result)
