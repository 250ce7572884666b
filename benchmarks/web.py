"""The status page over a large history: how long each page takes to answer when the
database holds ``--runs`` runs of a DAG of ``--tasks`` tasks (10,000 x 10 = 100,000 task
instances by default).

The run, against a fresh database (embedded server, or ``DEFERRAL_DATABASE_URL``): one DAG
of independent tasks, ``--runs`` runs of it an hour apart (scheduled, manual and backfill
mixed), their task instances given the states a busy history has (mostly success, some
failed, up_for_retry, running, deferred, queued), a second try archived for a share of them;
then the status page (the aiohttp application the webserver serves) on a local port, and each
page requested ``--repeat`` times in turn: the fleet, the DAGs list and a search, a DAG's grid
(its newest runs and its oldest page), the runs list and a filter of it, a run, its Gantt
view, a task and its first try, the triggers, the pools and a pool's tasks. Reported per
page: p50 / p99 / max of the response time in ms (request to last byte, as a client on the
same machine sees it) and the page's size. Nothing is timed in the tests: the figures are
quoted in docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Any

import click

from benchmarks.results import keep_db_option, out_option, write_result

__all__ = ["web"]


@click.command("web")
@click.option(
    "--runs",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="Runs of the DAG in the database.",
)
@click.option(
    "--tasks",
    type=click.IntRange(min=1, max=1000),
    default=10,
    show_default=True,
    help="Tasks of the DAG (task instances: runs x tasks).",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Requests of each page.",
)
@out_option
@keep_db_option()
def web(**options: Any) -> None:
    """Response times of the status page's views over a large history."""
    from benchmarks.web_run import print_table, run_web

    out = options.pop("out")
    result = run_web(**options)
    write_result(result, out)
    print_table(result)
