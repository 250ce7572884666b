"""Throughput beside a PostgreSQL job queue: how many no-op tasks, and how many
defer -> fire -> resume cycles, the engine takes through per second, and the same N no-op
jobs through pgqueuer on the same server, with the ratio.

The run, on the embedded server (or ``--dsn``, or ``DEFERRAL_DATABASE_URL``):

1. engine: a fresh database; a scheduler, W worker processes (S slots each) and a triggerer
   start and register; the N no-op tasks (runs of up to 1,000 independent tasks) are created
   behind a closed default pool, which then opens: claim -> run -> finish until all ended.
   Then the N cycles the same way: each task defers on a timer already due (it fires at
   once in the triggerer) and resumes to a no-op that journals when it started.
2. reference: pgqueuer (the ``bench`` extra) in a database of its own on the same server,
   its tables installed by its own installer: the same N no-op jobs queued, then W processes,
   each one queue manager in drain mode (at most S jobs at once, dequeue batch
   ``--pgq-batch``), until the queue is empty.

Reported: items per second (from the first claim to the last end, database clock), CPU
milliseconds per item of each kind of process (workers, scheduler, triggerer, PostgreSQL:
the backends of the benchmark's database and the server's background processes; not read
for an external server), latency percentiles, items lost or run twice, the load average, and
``ratio_deferral_to_pgqueuer`` (engine no-op tasks/s over pgqueuer jobs/s). ``--sweep``
repeats the run for several N (throughput against N; ``--plot`` draws it).
"""

from __future__ import annotations

from typing import Any

import asyncpg
import click

from benchmarks.plots import require_matplotlib
from benchmarks.results import keep_db_option, out_option, write_result

__all__ = ["BENCH_HINT", "throughput"]

#: What to run for the reference half.
BENCH_HINT = "pip install 'deferral[bench]'"


def _sizes(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        sizes = [int(part.replace("_", "")) for part in value.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(
            "a comma-separated list of task counts, e.g. 1000,5000,20000"
        ) from None
    if not sizes or any(size < 1 for size in sizes):
        raise click.BadParameter("every N must be a positive count")
    return sizes


def _has_pgqueuer() -> bool:
    try:
        import pgqueuer  # noqa: F401
    except ImportError:
        return False
    return True


@click.command("throughput")
@click.option(
    "--tasks",
    "n",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="N: no-op tasks through the engine, and the same N jobs through pgqueuer.",
)
@click.option(
    "--cycles",
    type=click.IntRange(min=0),
    help="Defer -> fire -> resume cycles (default: N; 0 skips them).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Worker processes (pgqueuer: as many processes, one queue manager each).",
)
@click.option(
    "--slots",
    type=click.IntRange(min=2),
    default=100,
    show_default=True,
    help="Tasks each worker runs at once (pgqueuer: max_concurrent_tasks).",
)
@click.option(
    "--pgq-batch",
    type=click.IntRange(min=1),
    help="pgqueuer's dequeue batch_size (default: SLOTS // 2, the most its rule "
    "max_concurrent_tasks >= 2 x batch_size allows: larger batches for short jobs, as its "
    "tuning guide advises).",
)
@click.option(
    "--no-pgqueuer",
    "no_pgqueuer",
    is_flag=True,
    help="Skip the pgqueuer reference (no ratio).",
)
@click.option(
    "--sweep",
    callback=_sizes,
    metavar="N1,N2,...",
    help="Run once for each N (throughput against N); replaces --tasks, and --cycles "
    "defaults to each N.",
)
@click.option(
    "--dsn",
    help="PostgreSQL server to run on (default: the setting database_url, else the embedded "
    "server); both engines use it, each in a database of its own.",
)
@out_option
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    help="Write a PNG of throughput against N here (needs the 'plot' extra).",
)
@keep_db_option("databases")
def throughput(**options: Any) -> None:
    """No-op tasks and defer/resume cycles per second, beside pgqueuer on the same server."""
    from benchmarks.throughput_run import CHUNK, plot_sweep, print_table, run_throughput

    sizes = options["sweep"] or [options["n"]]
    for size in [*sizes, *([options["cycles"]] if options["cycles"] else [])]:
        if size > CHUNK and size % CHUNK:
            raise click.UsageError(f"N above {CHUNK:,} must be a multiple of {CHUNK:,}: {size:,}")
    pgqueuer = not options["no_pgqueuer"]
    if pgqueuer and not _has_pgqueuer():
        raise click.UsageError(
            "the pgqueuer reference needs pgqueuer, which is not installed: "
            f"{BENCH_HINT} (or pass --no-pgqueuer)"
        )
    if options["plot"]:
        require_matplotlib()  # now, not after the run
    slots = options["slots"]
    batch = options["pgq_batch"] or max(1, slots // 2)
    if pgqueuer and 2 * batch > slots:
        raise click.UsageError(
            f"--pgq-batch {batch} is more than half of --slots {slots}: pgqueuer requires "
            "max_concurrent_tasks >= 2 x batch_size"
        )
    dsn = options["dsn"]
    if dsn is not None:
        from engine.config.urls import database_url_problem

        problem = database_url_problem(dsn)
        if problem:
            raise click.BadParameter(
                f"not a PostgreSQL URL (postgresql://USER:PASSWORD@HOST:PORT/DATABASE): {problem}",
                param_hint="--dsn",
            )
    try:
        result = run_throughput(
            sizes=sizes,
            cycles=options["cycles"],
            workers=options["workers"],
            slots=slots,
            pgq_batch=batch,
            pgqueuer=pgqueuer,
            keep_db=options["keep_db"],
            dsn=dsn,
        )
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        where = "the server of --dsn" if dsn else "the PostgreSQL server"
        raise click.ClickException(f"cannot use {where}: {exc}") from None
    write_result(result, options["out"])
    print_table(result)
    if options["plot"]:
        plot_sweep(result, options["plot"])
