"""Waits per triggerer: how many timer waits one triggerer holds, what each costs, how late
they fire and resume, and how fast a killed triggerer's waits move on.

The run, against a fresh database (embedded server, or ``DEFERRAL_DATABASE_URL``):

1. floor: a separate process on the same loop holds N bare ``asyncio.sleep`` coroutines
   spread over the same window; RSS per wait and fire lateness;
2. defer: N task instances (one DAG run per chunk of 1,000) run ``execute`` on real worker
   processes, and each defers on a timer whose due time lies in the window;
3. claim: K triggerer processes start and claim the backlog; ``claim_all_s`` runs from the
   moment they registered to all N held;
4. idle: CPU of every engine process while the N waits sit;
5. window: timers fire in the triggerers (the event carries the fire time), tasks resume on
   the workers (the resumed method journals its start time); ``--kill-one`` SIGKILLs one
   triggerer half way;
6. drain: every task ended; the journals give lost and double resumes.
"""

from __future__ import annotations

import os
from typing import Any

import click

from benchmarks.plots import require_matplotlib
from benchmarks.results import keep_db_option, out_option, write_result

__all__ = ["waits"]


@click.command("waits")
@click.option("--triggers", "n", type=click.IntRange(min=1), default=10_000, show_default=True)
@click.option("--triggerers", "k", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--capacity",
    type=click.IntRange(min=1),
    help="Capacity of each triggerer (default: enough for all triggers).",
)
@click.option("--window", type=float, default=10.0, show_default=True, help="Seconds.")
@click.option("--loop", type=click.Choice(["uvloop", "asyncio"]), default="uvloop")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--slots", type=click.IntRange(min=1), default=200, show_default=True)
@click.option(
    "--distinct",
    type=click.IntRange(min=1),
    help="Distinct timers (default N); fewer makes tasks share triggers (deduplication).",
)
@click.option("--idle-s", type=float, default=5.0, show_default=True)
@click.option("--lease-s", type=float, help="Triggerer lease (default: the setting).")
@click.option("--kill-one", is_flag=True, help="SIGKILL one triggerer half way through.")
@click.option(
    "--pools",
    is_flag=True,
    help="Put the waiting tasks in a pool 'sensors' that counts deferred tasks "
    "(include_deferred), with a slot for each: admission at work, never holding one back.",
)
@click.option(
    "--default-pool-slots",
    type=click.IntRange(min=1),
    help="Slots of default_pool, the pool of the waiting tasks without --pools (default: "
    "the workers' slots, at least the engine's 128: the pool never holds back what the "
    "workers could run).",
)
@out_option
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    help="Write a PNG here (needs the 'plot' extra; `bench plot` draws a saved --out JSON).",
)
@keep_db_option()
@click.option(
    "--synchronous-commit/--no-synchronous-commit",
    default=True,
    show_default=True,
    help="PostgreSQL synchronous_commit for the benchmark's database (off: a commit does not "
    "wait for the WAL flush; an OS crash may lose the last commits, a process crash loses none).",
)
@click.option(
    "--pg-setting",
    "pg_settings",
    multiple=True,
    type=(str, str),
    metavar="NAME VALUE",
    help="A PostgreSQL setting for the benchmark's database (ALTER DATABASE ... SET).",
)
def waits(**options: Any) -> None:
    """Timer waits held by K triggerers: memory, claim time, lateness, failover."""
    from benchmarks.waits_run import run_waits

    if options["kill_one"] and options["k"] < 2:
        raise click.UsageError("--kill-one needs --triggerers 2 or more")
    if options["plot"]:
        require_matplotlib()  # now, not after a run of minutes
    result = run_waits(**options)
    write_result(result, options["out"])
    if os.environ.get("DEFERRAL_BENCH_STRICT") and (
        result["events_lost"] or result["resumed_twice"]
    ):
        raise SystemExit(1)
