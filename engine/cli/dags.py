"""``deferral dags``: list and trigger DAGs."""

from __future__ import annotations

import shlex
import sys
from typing import TYPE_CHECKING

import click
import msgspec
from rich.markup import escape
from rich.table import Table

from engine.cli.common import (
    SECONDS,
    TEXT,
    _json,
    _json_text_problem,
    _parse_dags_option,
    _run,
    _settings,
    check_dags_folder,
    err_console,
)
from engine.cli.listing import (
    WAIT_EXIT,
    cell,
    interrupted_wait,
    print_table,
    show_outcome,
    wide_option,
)
from engine.dagbag import DagBag, error_summary
from engine.store import DuplicateRun

if TYPE_CHECKING:
    from engine.client import RunOutcome
    from engine.store.models import DagSummary


@click.group()
def dags() -> None:
    """List and trigger DAGs."""


@dags.command("list")
@_parse_dags_option
@click.option("--json", "as_json", is_flag=True, help="One JSON array of objects.")
@wide_option
@click.pass_context
def dags_list(ctx: click.Context, dags_folder: str | None, as_json: bool, wide: bool) -> None:
    """List the DAGs known to the database (parsing --dags first, if given)."""
    settings = _settings(ctx).replace(dags_folder=dags_folder)
    check_dags_folder(settings)

    async def main() -> tuple[list[DagSummary], dict[str, str]]:
        from engine.scheduler import sync_dags
        from engine.store import open_store

        store = await open_store(settings)
        try:
            errors: dict[str, str] = {}
            if settings.dags_folder:
                bag = DagBag(
                    settings.dags_folder,
                    processor_timeout_s=settings.dag_file_processor_timeout_s,
                )
                await sync_dags(store, bag)
                errors = dict(bag.import_errors)
            return await store.list_dags(), errors
        finally:
            await store.close()

    rows, errors = _run(main)
    if as_json:
        _json(rows)
    else:
        table = Table("dag_id", "tasks", "last run", "state", "file")
        for row in rows:
            table.add_row(
                cell(row.dag_id),
                str(row.tasks),
                cell(row.last_run_id or ""),
                cell(row.last_run_state or ""),
                cell(row.fileloc),
            )
        print_table(table, wide=wide)
    for path, error in errors.items():
        err_console.print(
            f"[red]DAG file {escape(path)} failed to import[/]: {escape(error_summary(error))}",
            highlight=False,
            soft_wrap=True,
        )
    if errors:
        sys.exit(1)


@dags.command("trigger")
@click.argument("dag_id", type=TEXT)
@_parse_dags_option
@click.option("--run-id", type=TEXT, help="Default: manual__<time>.")
@click.option("--conf", type=TEXT, help="JSON object handed to tasks as context['conf'].")
@click.option(
    "--wait",
    is_flag=True,
    help="Wait for the run to end; exit 0 on success, 1 when it failed.",
)
@click.option(
    "--timeout", type=SECONDS, help="With --wait: give up after this many seconds (exit 3)."
)
@wide_option
@click.pass_context
def dags_trigger(
    ctx: click.Context,
    dag_id: str,
    dags_folder: str | None,
    run_id: str | None,
    conf: str | None,
    wait: bool,
    timeout: float | None,
    wide: bool,
) -> None:
    """Create a run of DAG_ID.

    With --dags (or DEFERRAL_DAGS_FOLDER) the folder is parsed here first, and a DAG missing
    from it is reported with the files that failed to import. Without one, a DAG the database
    does not know yet makes the running scheduler rescan its folder at once.

    With --wait, Ctrl-C stops only the wait: the run goes on, and `deferral runs wait DAG_ID
    RUN_ID` follows it again.

    Exit codes: 0 the run was created (with --wait: it succeeded), 1 it failed, 2 it could
    not be created (unknown DAG, duplicate run id, bad --conf), 3 --timeout passed first,
    130 interrupted while waiting.
    """
    settings = _settings(ctx).replace(dags_folder=dags_folder)
    check_dags_folder(settings)
    try:
        conf_obj = msgspec.json.decode(conf) if conf else {}
    except msgspec.DecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--conf") from None
    if not isinstance(conf_obj, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--conf")
    problem = _json_text_problem(conf_obj)
    if problem:
        raise click.BadParameter(f"a string in it {problem}", param_hint="--conf")
    from engine.client import trigger_dag, wait_run

    # Created first, then waited for: a Ctrl-C once the run exists names the run to follow.
    created: RunOutcome | None = None
    try:
        created = _run(trigger_dag, settings, dag_id, run_id, conf_obj)
        if not wait:
            show_outcome(dag_id, created)
            return
        outcome = _run(wait_run, settings, dag_id, created.run_id, timeout)
    except (LookupError, ValueError) as exc:
        # Not wrapped: the message names files, which must stay whole to be copied.
        message = str(exc.args[0] if exc.args else exc)
        if isinstance(exc, DuplicateRun) and run_id:
            message += (
                f"; to wait for it: deferral runs wait {shlex.quote(dag_id)} {shlex.quote(run_id)}"
            )
        err_console.print(f"[red]error[/]: {escape(message)}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        if created is None or not wait:
            raise
        interrupted_wait(dag_id, created.run_id)
    show_outcome(dag_id, outcome, wide=wide)
    sys.exit(WAIT_EXIT.get(outcome.state, 3))
