"""``deferral tasks xcom``: the XComs of a task instance's current try, in full."""

from __future__ import annotations

from typing import Any

import click

from engine.cli.common import TEXT, _run, _settings, _usage_exit


@click.command("xcom")
@click.argument("dag_id", type=TEXT, metavar="DAG")
@click.argument("run_id", type=TEXT, metavar="RUN")
@click.argument("task_id", type=TEXT, metavar="TASK")
@click.option("--key", type=TEXT, help="Only this key (return_value: the return value).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object: key -> value.")
@click.option(
    "--map-index",
    "map_index",
    type=click.IntRange(min=0),
    help="Which instance of a mapped task (the same as writing TASK[N]).",
)
@click.pass_context
def tasks_xcom(
    ctx: click.Context,
    dag_id: str,
    run_id: str,
    task_id: str,
    key: str | None,
    as_json: bool,
    map_index: int | None,
) -> None:
    """Print the XComs of a task instance's current try in full: its return value (key
    return_value) and what it pushed, each key on a line of its own followed by the value as
    indented JSON (with --key, the value alone). Secrets are masked, as everywhere values are
    shown. --json: one object, key -> value (with --key, the value alone). RUN: a run id, a
    logical date, a unique prefix of a run id, or latest. TASK[3] (or --map-index 3): instance
    3 of a mapped task.

    Exit code 2: no such task instance, or no XCom under --key.
    """
    settings = _settings(ctx)
    from engine.client.mapaddr import BadAddress, check_instance, parse_task

    try:
        task_id, index = parse_task(task_id, map_index)
    except BadAddress as exc:
        _usage_exit(str(exc))
    name = task_id if index < 0 else f"{task_id}[{index}]"

    async def main() -> tuple[str, dict[str, bytes] | None]:
        from engine.client.runsel import resolve_run
        from engine.store import open_store

        store = await open_store(settings)
        try:
            run = (await resolve_run(store, dag_id, run_id)).run_id
            await check_instance(store, dag_id, run, task_id, index)
            return run, await store.xcom_of_task(dag_id, run, task_id, index)
        finally:
            await store.close()

    from engine.client.xcoms import full_json, shown

    try:
        run_id, found = _run(main)
    except LookupError as exc:  # (a RUN that names no run, or several; a bad map index)
        _usage_exit(str(exc))
    if found is None:
        _usage_exit(f"no task {name!r} in run {run_id!r} of DAG {dag_id!r}")
    task_id = name
    values: dict[str, Any] = {k: shown(k, v) for k, v in sorted(found.items())}
    if key is not None:
        if key not in values:
            have = ", ".join(values) or "none"
            _usage_exit(
                f"task {dag_id}.{task_id} (run {run_id}) has no XCom {key!r} (its keys: {have})"
            )
        click.echo(full_json(values[key], indent=None if as_json else 2))
        return
    if as_json:
        click.echo(full_json(values))
        return
    if not values:
        click.echo(f"task {dag_id}.{task_id} (run {run_id}) has no XCom")
        return
    for k, value in values.items():
        click.echo(f"{k}:")
        click.echo(full_json(value, indent=2))
