"""``deferral tasks clear|mark-*`` and ``deferral runs clear|mark-*``: rerun and override.

Each is the store's clear or mark (engine/store/overrides.py), the one implementation the
status page's actions use too: audited (who: the user running the command, via: the command
line) and written to the log of each task's latest try. A clear lists what it would clear and
asks first, unless ``--yes``; with no terminal to ask on, it refuses and changes nothing.
"""

from __future__ import annotations

import getpass
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import click
import msgspec
from rich.markup import escape
from rich.table import Table

from engine.cli.common import TEXT, _json, _run, _settings, _usage_exit, console, err_console
from engine.cli.listing import cell, print_table

if TYPE_CHECKING:
    from engine.config import Settings
    from engine.store import Store
    from engine.store.models import Override, OverrideTarget, RunOverride

__all__ = ["VIA_CLI", "runs_commands", "tasks_commands"]

#: How the command line names itself in the audit rows and the log lines.
VIA_CLI = "the command line"

#: The exit code of a clear not confirmed (refused without a terminal, or answered no).
EXIT_NOT_CONFIRMED = 1


def _who() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # (no name for this uid, e.g. in a container)
        return "unknown user"


class _Selected(msgspec.Struct, frozen=True, kw_only=True):
    dag_id: str
    run_id: str
    targets: list[OverrideTarget]


async def _select(
    store: Store,
    dag_id: str,
    selector: str,
    task_ids: Sequence[str] | None,
    *,
    map_index: int | None = None,
    downstream: bool = False,
    upstream: bool = False,
    only_failed: bool = False,
) -> _Selected:
    """The run RUN names (a selector, as every command takes) and what the override reaches
    (``task_ids``: TASK, every instance of a mapped task, or TASK[i], that instance alone;
    ``map_index``: the instance of each bare TASK); LookupError naming an unknown DAG, run,
    task or instance."""
    from engine.client.mapaddr import check_instance, parse_task
    from engine.client.runsel import resolve_run
    from engine.store.overrides import NoSuchTarget

    if await store.get_dag(dag_id) is None:
        raise NoSuchTarget(f"no DAG {dag_id!r} (deferral dags list shows the DAGs)")
    if map_index is not None and not task_ids:
        raise NoSuchTarget("--map-index names an instance of the task(s) given: add a task")
    addresses = [parse_task(t, map_index) for t in task_ids or ()]
    run = await resolve_run(store, dag_id, selector)
    for task_id, index in addresses:
        if index >= 0:
            await check_instance(store, dag_id, run.run_id, task_id, index)
    targets = await store.override_targets(
        dag_id,
        run.run_id,
        [task_id for task_id, _ in addresses] if task_ids else None,
        map_indexes=[index for _, index in addresses] if task_ids else None,
        downstream=downstream,
        upstream=upstream,
        only_failed=only_failed,
    )
    return _Selected(dag_id=dag_id, run_id=run.run_id, targets=targets)


async def _with_store(settings: Settings, work: Any) -> Any:
    from engine.store import open_store

    store = await open_store(settings)
    try:
        return await work(store)
    finally:
        await store.close()


def _checked(settings: Settings, work: Any) -> Any:
    try:
        return _run(_with_store, settings, work)
    except LookupError as exc:  # (no such DAG, run or task: nothing changed)
        _usage_exit(str(exc.args[0] if exc.args else exc))


def _name(ti: Override | OverrideTarget) -> str:
    """A task instance as the commands address it: TASK, or TASK[i] for a mapped instance."""
    return ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"


def _targets_table(targets: Sequence[OverrideTarget]) -> Table:
    table = Table("task_id", "state", "try_number", "why")
    for t in targets:
        why = {"task": "named", "downstream": "downstream", "upstream": "upstream"}[t.relation]
        table.add_row(cell(_name(t)), cell(t.state), cell(t.try_number), cell(why))
    return table


def _refuse(problem: str) -> NoReturn:
    err_console.print(f"[red]error[/]: {escape(problem)}", highlight=False, soft_wrap=True)
    sys.exit(EXIT_NOT_CONFIRMED)


def _confirm(selected: _Selected, *, as_json: bool) -> None:
    """List what a clear would clear and ask; exit without a yes (nothing changed)."""
    out = err_console if as_json else console
    n = len(selected.targets)
    out.print(
        f"would clear {n} task instance{'s' if n != 1 else ''} of run "
        f"{escape(selected.run_id)} of DAG {escape(selected.dag_id)}:",
        highlight=False,
        soft_wrap=True,
    )
    print_table(_targets_table(selected.targets), wide=False, out=out)
    stdin = sys.stdin
    if stdin is None or stdin.closed or not stdin.isatty():
        _refuse("nothing cleared: no terminal to confirm on (stdin); pass --yes to clear")
    # (The question goes where it is seen: stderr when stdout is JSON or is not a terminal.)
    if not click.confirm("Clear them?", default=False, err=as_json or not console.is_terminal):
        _refuse("nothing cleared")


def _print_overrides(done: Sequence[Override], *, verb: str, empty: str) -> None:
    if not done:
        console.print(empty, markup=False, highlight=False, soft_wrap=True)
        return
    table = Table("dag_id", "run_id", "task_id", "was", "now", "note")
    for o in sorted(done, key=lambda o: (o.task_id, o.map_index, o.id)):
        notes = []
        if o.stopping_worker_id is not None:
            notes.append(f"worker {o.stopping_worker_id} told to stop try {o.try_number}")
        if o.left_trigger_id is not None:
            notes.append(f"left trigger {o.left_trigger_id}")
        if verb == "cleared":
            notes.append(f"next try: {o.try_number + 1}")
        table.add_row(
            cell(o.dag_id), cell(o.run_id), cell(_name(o)), cell(o.was), cell(o.state),
            cell("; ".join(notes)),
        )  # fmt: skip
    n = len(done)
    console.print(f"{verb} {n} task instance{'s' if n != 1 else ''}", highlight=False)
    print_table(table, wide=False)


def _clear(
    ctx: click.Context,
    dag_id: str,
    selector: str,
    task_ids: Sequence[str] | None,
    *,
    yes: bool,
    as_json: bool,
    **select: Any,
) -> None:
    """``tasks clear`` and ``runs clear`` (``select``: what :func:`_select` takes besides)."""
    settings = _settings(ctx)

    async def choose(store: Store) -> _Selected:
        return await _select(store, dag_id, selector, task_ids, **select)

    selected: _Selected = _checked(settings, choose)
    if not selected.targets:
        if as_json:
            _json([])
        else:
            what = "failed task instances" if select.get("only_failed") else "task instances"
            console.print(f"no {what} to clear", highlight=False)
        return
    if not yes:
        _confirm(selected, as_json=as_json)

    async def clear(store: Store) -> list[Override]:
        ids = [t.id for t in selected.targets]
        done: list[Override] = await store.clear_tasks(ids, who=_who(), via=VIA_CLI)
        return done

    done: list[Override] = _checked(settings, clear)
    if as_json:
        _json(done)
    else:
        _print_overrides(done, verb="cleared", empty="nothing cleared")


def _mark(
    ctx: click.Context,
    state: str,
    dag_id: str,
    selector: str,
    task_ids: Sequence[str],
    *,
    as_json: bool,
    **select: Any,
) -> None:
    """``tasks mark-*`` (``select``: what :func:`_select` takes besides)."""
    settings = _settings(ctx)

    async def mark(store: Store) -> list[Override]:
        selected = await _select(store, dag_id, selector, task_ids, **select)
        ids = [t.id for t in selected.targets]
        done: list[Override] = await store.mark_tasks(ids, state, who=_who(), via=VIA_CLI)
        return done

    done: list[Override] = _checked(settings, mark)
    if as_json:
        _json(done)
    else:
        _print_overrides(done, verb=f"marked {state}", empty=f"nothing to mark: already {state}")


#: ``--map-index N``: the instance of each TASK given (the same as writing TASK[N]).
_map_index_option = click.option(
    "--map-index",
    "map_index",
    type=click.IntRange(min=0),
    help="Only this instance of each mapped TASK given (the same as writing TASK[N]).",
)

_JSON_HELP = "Print what changed as one JSON array of objects."
_JSON_KEYS = (
    "--json keys: id, dag_run_id, dag_id, run_id, task_id, state (now), was, try_number (the "
    "latest try then), is_leaf, stopping_worker_id (the worker told to stop a running try), "
    "left_trigger_id (the trigger a deferred task left), map_index (-1: not a mapped instance)."
)


def _clear_options(command: Any) -> Any:
    """The options both clears take: --only-failed, --yes, --json."""
    for option in (
        click.option("--json", "as_json", is_flag=True, help=_JSON_HELP),
        click.option("--yes", "-y", is_flag=True, help="Do not ask first."),
        click.option("--only-failed", is_flag=True, help="Only failed or upstream_failed ones."),
    ):
        command = option(command)
    return command


@click.command("clear")
@click.argument("dag_id", type=TEXT, metavar="DAG")
@click.option("--run", "run_id", type=TEXT, required=True, metavar="RUN", help="The run.")
@click.option(
    "--task",
    "task_ids",
    type=TEXT,
    multiple=True,
    metavar="T",
    help="Only this task (repeat); T[3]: instance 3 of a mapped task alone.",
)
@_map_index_option
@click.option("--downstream", is_flag=True, help="Also the tasks downstream, transitively.")
@click.option("--upstream", is_flag=True, help="Also the tasks upstream, transitively.")
@_clear_options
@click.pass_context
def tasks_clear(
    ctx: click.Context,
    /,
    dag_id: str,
    run_id: str,
    task_ids: tuple[str, ...],
    yes: bool,
    as_json: bool,
    **select: Any,
) -> None:
    """Clear task instances of run RUN of DAG: each runs again, on its next try (try number +
    1, its retries counted afresh), its XComs dropped. Without --task: every task of the run.
    A running try is told to stop first (the next try waits for it), a deferred task leaves
    its trigger (a trigger shared with other tasks keeps running for them) and its event, if
    it still comes, changes nothing. A cleared task whose upstreams have not succeeded waits
    for them (or is resolved by its trigger rule); a run that had ended runs again. A mapped
    task is cleared whole; --task T[3] (or --task T --map-index 3) clears instance 3 alone.

    Lists what it would clear and asks first, unless --yes; with no terminal on stdin it
    refuses (exit 1) and changes nothing. RUN is a run id, a unique prefix of one, a logical
    date or latest. Exit code 2: no such DAG, run or task (nothing changed).

    --json keys: id, dag_run_id, dag_id, run_id, task_id, state (now), was, try_number (the
    latest try then), is_leaf, stopping_worker_id (the worker told to stop a running try),
    left_trigger_id (the trigger a deferred task left), map_index (-1: not a mapped instance).
    """
    _clear(ctx, dag_id, run_id, task_ids or None, yes=yes, as_json=as_json, **select)


def _mark_command(state: str) -> click.Command:
    @click.command(f"mark-{state}")
    @click.argument("dag_id", type=TEXT, metavar="DAG")
    @click.argument("run_id", type=TEXT, metavar="RUN")
    @click.argument("task_ids", type=TEXT, nargs=-1, required=True, metavar="TASK...")
    @_map_index_option
    @click.option("--downstream", is_flag=True, help=f"Also mark the downstream tasks {state}.")
    @click.option("--upstream", is_flag=True, help=f"Also mark the upstream tasks {state}.")
    @click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
    @click.pass_context
    def command(
        ctx: click.Context,
        /,
        dag_id: str,
        run_id: str,
        task_ids: tuple[str, ...],
        as_json: bool,
        **select: Any,
    ) -> None:
        _mark(ctx, state, dag_id, run_id, task_ids, as_json=as_json, **select)

    command.help = (
        f"Mark task TASK of run RUN of DAG {state}, whatever it is doing: a running try is "
        "told to stop (its worker cancels it; what it reports later is ignored), a deferred "
        "task leaves its trigger (a trigger shared with other tasks keeps running for them). "
        "The tasks downstream then follow their trigger rules as if it had ended so; a run "
        "that had ended ends anew. A mapped TASK is marked whole; TASK[3] (or --map-index 3) "
        f"marks instance 3 alone. Task instances already {state} are left as they are.\n\n"
        "RUN is a run id, a unique prefix of one, a logical "
        "date or latest. Exit code 2: no such DAG, run or task (nothing changed).\n\n" + _JSON_KEYS
    )
    return command


@click.command("clear")
@click.argument("dag_id", type=TEXT, metavar="DAG")
@click.argument("run_id", type=TEXT, metavar="RUN")
@_clear_options
@click.pass_context
def runs_clear(
    ctx: click.Context, dag_id: str, run_id: str, only_failed: bool, yes: bool, as_json: bool
) -> None:
    """Clear every task instance of run RUN of DAG (with --only-failed: the failed and
    upstream_failed ones): the run runs again, each cleared task on its next try, as `tasks
    clear` does. Lists what it would clear and asks first, unless --yes; with no terminal on
    stdin it refuses (exit 1) and changes nothing. Exit code 2: no such DAG or run.

    --json keys: as `tasks clear` prints them.
    """
    _clear(ctx, dag_id, run_id, None, yes=yes, as_json=as_json, only_failed=only_failed)


def _run_mark_command(state: str) -> click.Command:
    @click.command(f"mark-{state}")
    @click.argument("dag_id", type=TEXT, metavar="DAG")
    @click.argument("run_id", type=TEXT, metavar="RUN")
    @click.option("--json", "as_json", is_flag=True, help="Print what changed as one object.")
    @click.pass_context
    def command(ctx: click.Context, dag_id: str, run_id: str, as_json: bool) -> None:
        settings = _settings(ctx)

        async def mark(store: Store) -> RunOverride:
            selected = await _select(store, dag_id, run_id, [])
            done: RunOverride = await store.mark_run(
                selected.dag_id, selected.run_id, state, who=_who(), via=VIA_CLI
            )
            return done

        done: RunOverride = _checked(settings, mark)
        if as_json:
            click.echo(msgspec.json.encode(done).decode())
            return
        console.print(
            f"run {escape(done.run_id)} of DAG {escape(done.dag_id)}: {done.was} -> {done.state}",
            highlight=False,
            soft_wrap=True,
        )
        _print_overrides(done.tasks, verb="marked", empty="no task instance changed")

    what = (
        "every task instance not a success is marked success"
        if state == "success"
        else "the tries under way (queued, running, deferred, up_for_reschedule) are marked "
        "failed and the task instances not started yet (or waiting for a retry) skipped; "
        "ended ones are kept"
    )
    command.help = (
        f"Mark run RUN of DAG {state}: {what}, as `tasks mark-{state}` marks them (a running "
        "try told to stop, a deferred task leaving its trigger), and the run ends "
        f"{state}.\n\nRUN is a run id, a unique prefix of one, a logical date or latest. Exit "
        "code 2: no such DAG or run (nothing changed).\n\n--json keys: dag_id, run_id, was "
        "(the run's state before), state, tasks (the task instances changed, as `tasks "
        "mark-*` --json prints them)."
    )
    return command


def tasks_commands() -> list[click.Command]:
    """The commands added to ``deferral tasks``."""
    return [tasks_clear, *(_mark_command(s) for s in ("success", "failed", "skipped"))]


def runs_commands() -> list[click.Command]:
    """The commands added to ``deferral runs``."""
    return [runs_clear, *(_run_mark_command(s) for s in ("success", "failed"))]
