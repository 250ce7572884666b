"""``deferral tasks logs``: what a task try logged and printed (registered on ``tasks``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import click

from engine.cli.common import TEXT, _settings, _usage_exit, err_console
from engine.cli.logview import POLL_S, follow_pages, run_following
from engine.cli.tasks import tasks
from engine.client.runsel import resolve_run

if TYPE_CHECKING:
    from engine.store import Store, TaskLogs

__all__ = ["tasks_logs"]


@tasks.command("logs")
@click.argument("dag_id", type=TEXT, metavar="DAG")
@click.argument("run_id", type=TEXT, metavar="RUN")
@click.argument("task_id", type=TEXT, metavar="TASK")
@click.option(
    "--try",
    "try_number",
    type=click.IntRange(min=1, max=2**31 - 1),
    help="The try to show (default: the latest).",
)
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="Keep printing new lines until the try ended and its last lines are read; Ctrl-C "
    "stops. Before the first try starts, waits for it.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line.")
@click.option(
    "--map-index",
    "map_index",
    type=click.IntRange(min=0),
    help="Which instance of a mapped task (the same as writing TASK[N]).",
)
@click.pass_context
def tasks_logs(
    ctx: click.Context,
    dag_id: str,
    run_id: str,
    task_id: str,
    try_number: int | None,
    follow: bool,
    as_json: bool,
    map_index: int | None,
) -> None:
    """Print what a task try logged and printed (its execute and resumed methods, on the
    workers), and the ids of the logging triggers it waited on (see: triggers logs ID).

    RUN is a run id, a unique prefix of one, a logical date (2026-11-20, 2026-11-20T06:00) or
    `latest`. TASK[3] (or --map-index 3): instance 3 of a mapped task."""
    settings = _settings(ctx)
    from engine.client.mapaddr import BadAddress, check_instance, parse_task

    try:
        bare, index = parse_task(task_id, map_index)
    except BadAddress as exc:
        _usage_exit(str(exc))
    # (A mapped instance's lines are kept under its name, TASK[i].)
    name = bare if index < 0 else f"{bare}[{index}]"

    async def main() -> TaskLogs | str:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            try:
                run = (await resolve_run(store, dag_id, run_id)).run_id
                await check_instance(store, dag_id, run, bare, index)
            except LookupError as exc:
                return str(exc)
            return await _show(store, dag_id, run, name, try_number, follow, as_json)
        finally:
            with anyio.move_on_after(5, shield=True):
                await store.close()

    last = run_following(main)
    if isinstance(last, str):
        _usage_exit(last)
    if last is not None and last.trigger_ids and not as_json:
        ids = " ".join(map(str, last.trigger_ids))
        err_console.print(
            f"try {last.try_number} waited on logging trigger(s) {ids}: "
            "deferral triggers logs ID shows their lines",
            highlight=False,
        )


async def _show(
    store: Store,
    dag_id: str,
    run_id: str,
    task_id: str,
    try_number: int | None,
    follow: bool,
    as_json: bool,
) -> TaskLogs | str:
    """Print the try's lines; a problem with the arguments as a message instead."""
    first = await store.task_logs(dag_id, run_id, task_id, try_number, limit=0)
    if first.latest_try is None and first.next_seq == 0:
        probe = await store.task_logs(dag_id, run_id, task_id, try_number, limit=1)
        if not probe.lines:
            return (
                f"no task instance {task_id!r} (TASK) in run {run_id!r} (RUN) of DAG "
                f"{dag_id!r} (DAG), and no stored lines"
            )
    if try_number is not None and first.latest_try is not None and try_number > first.latest_try:
        return (
            f"--try {try_number}: task {task_id!r} has had {first.latest_try} "
            f"tr{'y' if first.latest_try == 1 else 'ies'} so far"
        )
    number = first.try_number
    while follow and number == 0:  # not started yet: its first try is the one to follow
        await anyio.sleep(POLL_S)
        number = (await store.task_logs(dag_id, run_id, task_id, None, limit=0)).try_number
    return await follow_pages(
        lambda after: store.task_logs(dag_id, run_id, task_id, number, after),
        lambda page: page.lines,
        lambda page: page.next_seq,
        lambda page: page.ended,
        follow=follow,
        as_json=as_json,
    )
