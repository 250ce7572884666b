"""``deferral dags list``: the DAGs the database knows and the DAG files that fail to import
(registered on ``dags``)."""

from __future__ import annotations

import datetime as dt
import sys

import click
import msgspec
from rich.markup import escape
from rich.table import Table

from engine.cli.common import (
    _parse_dags_option,
    _run,
    _settings,
    check_dags_folder,
    err_console,
)
from engine.cli.dags import _when, dags
from engine.cli.listing import cell, fmt_time, print_table, wide_option
from engine.dags.dagbag import DagBag
from engine.dags.importerrors import error_summary
from engine.masking import redact_text
from engine.store.importerrors import ImportErrorRow
from engine.store.models import DagSummary

__all__ = ["ListedDags", "ListedImportError", "dags_list"]


class ListedImportError(msgspec.Struct, frozen=True, kw_only=True):
    """A DAG file that failed to import, in ``dags list --json`` (``error``: its traceback,
    secrets masked)."""

    fileloc: str
    error: str
    since: dt.datetime


class ListedDags(msgspec.Struct, frozen=True, kw_only=True):
    """``dags list --json``: the DAGs, and the files that failed to import."""

    dags: list[DagSummary]
    import_errors: list[ListedImportError]


def _next_run(row: DagSummary) -> tuple[str, str]:
    """The next scheduled run's logical date, and when it will be created (the end of its
    data interval, for most schedules: the logical date is in the past while it runs)."""
    if not row.is_active:
        return "none: file gone", ""
    if row.next_dagrun is None:
        return "none", ""
    created = _when(row.next_dagrun_create_after)
    return _when(row.next_dagrun), created + (" (paused)" if row.is_paused else "")


@dags.command("list")
@_parse_dags_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object: dags, import_errors.")
@wide_option
@click.pass_context
def dags_list(ctx: click.Context, dags_folder: str | None, as_json: bool, wide: bool) -> None:
    """List the DAGs known to the database (parsing --dags first, if given), and the DAG files
    that failed to import as the scheduler's latest scan (or --dags) found them.

    "next run" is the logical date of the next scheduled run (the start of its data interval:
    in the past while the interval runs), "created at" when the scheduler will create it.

    --json: one object, {"dags": [...], "import_errors": [...]}; a DAG's keys: dag_id,
    fileloc, tasks, description, updated_at, last_run_id, last_run_state, is_paused, schedule,
    next_dagrun, next_dagrun_create_after, tags, is_active; an import error's: fileloc, error
    (the traceback, secrets masked), since.

    Exit codes: 0 listed, 1 some DAG file fails to import.
    """
    settings = _settings(ctx).replace(dags_folder=dags_folder)
    check_dags_folder(settings)

    async def main() -> tuple[list[DagSummary], list[ImportErrorRow]]:
        from engine.scheduler.dagsync import sync_dags
        from engine.store import open_store

        store = await open_store(settings)
        try:
            if settings.dags_folder:
                bag = DagBag(
                    settings.dags_folder,
                    processor_timeout_s=settings.dag_file_processor_timeout_s,
                )
                await sync_dags(store, bag)  # (which records its import errors too)
            return await store.list_dags(), await store.import_errors()
        finally:
            await store.close()

    rows, errors = _run(main)
    listed_errors = [
        ListedImportError(fileloc=e.fileloc, error=redact_text(e.error), since=e.since)
        for e in errors
    ]
    if as_json:
        click.echo(msgspec.json.encode(ListedDags(dags=rows, import_errors=listed_errors)).decode())
    else:
        table = Table(
            "dag_id", "paused", "schedule", "next run", "created at", "tasks", "last run",
            "state", "file",
        )  # fmt: skip
        for row in rows:
            table.add_row(
                cell(row.dag_id),
                "yes" if row.is_paused else "no",
                cell(row.schedule or "None"),
                *map(cell, _next_run(row)),
                str(row.tasks),
                cell(row.last_run_id or ""),
                cell(row.last_run_state or ""),
                cell(row.fileloc),
            )
        print_table(
            table,
            wide=wide,
            empty="no DAGs recorded yet: a scheduler records those of its DAGs folder "
            "(deferral dags list --dags FOLDER parses one here)"
            if not errors
            else "no DAGs recorded",
        )
    for error in listed_errors:
        err_console.print(
            f"[red]DAG file {escape(error.fileloc)} failed to import[/] (since "
            f"{escape(fmt_time(error.since))}): {escape(error_summary(error.error))}",
            highlight=False,
            soft_wrap=True,
        )
    if errors:
        sys.exit(1)
