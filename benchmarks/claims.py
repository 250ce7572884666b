"""Admission: how many task instances W workers claim per second when pools hold them back,
and how long one claim statement (the admission decision and the claim) takes.

The run, against a fresh database (embedded server, or ``DEFERRAL_DATABASE_URL``): N runnable
task instances (runs of up to 1,000 independent tasks), spread evenly over P pools of
``--slots`` slots each, so that the pools hold back part of what the workers ask for; then W
workers, coroutines of this process each with a connection of its own, claim batches of
``--batch`` with the engine's claim (``Store.claim_tasks``) and end what they claimed at once
in one statement (``Store.finish_tasks``), so slots free up and the next claims find room.
No task runs: what is measured is admission, not execution. Reported: admissions per second
(tasks claimed over the time from the first claim to the last), the latency of one claim
statement (p50 / p99 / max, ms, as the worker sees it: round trip, the admission lock's wait
included), the mean time of the claim function inside the database (the lock's wait
included; with ``--workers 1``, the decision alone), how many claims came back short of their
batch while more tasks were waiting (the limits at work) and how many came back empty.
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.results import keep_db_option, out_option, write_result

__all__ = ["claims"]


@click.command("claims")
@click.option(
    "--tasks",
    "n",
    type=click.IntRange(min=1),
    default=20_000,
    show_default=True,
    help="Runnable task instances (runs of up to 1,000 independent tasks).",
)
@click.option(
    "--pools",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Pools the tasks are spread over, evenly.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Workers claiming at once (coroutines of this process, a connection each).",
)
@click.option(
    "--slots",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Slots of each pool (the defaults hold back part of what the workers ask for: "
    "10 pools x 4 slots < 4 workers x 16).",
)
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Most task instances one claim statement takes (the claim's limit).",
)
@click.option(
    "--parallelism",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Global limit on running tasks passed to each claim (0: none).",
)
@out_option
@keep_db_option()
def claims(**options: Any) -> None:
    """Admissions per second and claim latency, with pools holding tasks back."""
    from benchmarks.claims_run import CHUNK, print_table, run_claims

    if options["n"] > CHUNK and options["n"] % CHUNK:
        raise click.UsageError(f"--tasks above {CHUNK:,} must be a multiple of {CHUNK:,}")
    out = options.pop("out")
    result = run_claims(**options)
    write_result(result, out)
    print_table(result)
