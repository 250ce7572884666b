"""``deferral status``: the engine's processes running on this database, where they listen,
and what waits for them, from the database (every process registers there)."""

from __future__ import annotations

import datetime as dt

import click
import msgspec
from rich.table import Table

from engine.cli.common import _run, _settings, console
from engine.cli.listing import cell, fmt_duration, fmt_time, print_table, wide_option
from engine.config import Settings
from engine.store.endpoints import EndpointRow
from engine.store.models import Backlog, Fleet

__all__ = ["status"]

#: The order processes are listed in.
KINDS = ("scheduler", "worker", "triggerer", "webserver")


class ListedProcess(msgspec.Struct, frozen=True, kw_only=True):
    """A running process in ``status --json``. ``id``: its registration's (None for a
    webserver); ``url``: where it listens (a scheduler's, worker's or triggerer's /metrics,
    a webserver's status page; None: nowhere); ``silent``: its heartbeat is older than a live
    process's would be (it is probably gone, and is reaped soon)."""

    kind: str
    id: int | None
    hostname: str
    pid: int
    version: str | None
    started_at: dt.datetime
    heartbeat_at: dt.datetime
    heartbeat_age_s: float
    silent: bool
    url: str | None
    #: A worker's slots and the ones in use; a triggerer's capacity and the triggers it holds.
    slots: int | None = None
    running: int | None = None
    capacity: int | None = None
    held: int | None = None


class Status(msgspec.Struct, frozen=True, kw_only=True):
    """``status --json``: the processes, the backlog and how many DAG files fail to import."""

    processes: list[ListedProcess]
    backlog: Backlog
    import_errors: int


def _processes(
    fleet: Fleet, endpoints: list[EndpointRow], settings: Settings
) -> list[ListedProcess]:
    metrics = {(e.hostname, e.pid): e.url for e in endpoints if e.kind == "metrics"}
    # A process is silent once its heartbeat is older than the scheduler would wait before
    # declaring it dead (zombie_threshold_s; a triggerer: its lease).
    stale_s = settings.zombie_threshold_s
    listed = [
        ListedProcess(
            kind="scheduler",
            id=s.id,
            hostname=s.hostname,
            pid=s.pid,
            version=s.version,
            started_at=s.started_at,
            heartbeat_at=s.heartbeat_at,
            heartbeat_age_s=s.heartbeat_age_s,
            silent=s.heartbeat_age_s > stale_s,
            url=metrics.get((s.hostname, s.pid)),
        )
        for s in fleet.schedulers
    ]
    listed += [
        ListedProcess(
            kind="worker",
            id=w.id,
            hostname=w.hostname,
            pid=w.pid,
            version=w.version,
            started_at=w.started_at,
            heartbeat_at=w.heartbeat_at,
            heartbeat_age_s=w.heartbeat_age_s,
            silent=w.heartbeat_age_s > stale_s,
            url=metrics.get((w.hostname, w.pid)),
            slots=w.slots,
            running=w.running,
        )
        for w in fleet.workers
    ]
    listed += [
        ListedProcess(
            kind="triggerer",
            id=t.id,
            hostname=t.hostname,
            pid=t.pid,
            version=t.version,
            started_at=t.started_at,
            heartbeat_at=t.heartbeat_at,
            heartbeat_age_s=t.heartbeat_age_s,
            silent=t.expired,
            url=metrics.get((t.hostname, t.pid)),
            capacity=t.capacity,
            held=t.held,
        )
        for t in fleet.triggerers
    ]
    listed += [
        ListedProcess(
            kind="webserver",
            id=None,
            hostname=e.hostname,
            pid=e.pid,
            version=e.version,
            started_at=e.started_at,
            heartbeat_at=e.heartbeat_at,
            heartbeat_age_s=e.heartbeat_age_s,
            silent=False,  # (rows of silent ones are left out)
            url=e.url,
        )
        for e in endpoints
        if e.kind == "webserver"
    ]
    return listed


def _load(p: ListedProcess) -> str:
    if p.kind == "worker":
        return f"{p.running}/{p.slots} slots used"
    if p.kind == "triggerer":
        return f"{p.held}/{p.capacity} triggers held"
    return ""


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@wide_option
@click.pass_context
def status(ctx: click.Context, as_json: bool, wide: bool) -> None:
    """List the engine's processes running on this database (schedulers, workers,
    triggerers, webservers) with their host, pid, version, when they started, their last
    heartbeat and where they listen (a process's /metrics, a webserver's status page); then
    the backlog (runnable tasks no worker claimed: held by a pool, by a limit, or waiting for
    a worker; triggers no triggerer holds) and the DAG files that fail to import.

    --json: one object: processes (kind, id, hostname, pid, version, started_at,
    heartbeat_at, heartbeat_age_s, silent, url, slots, running, capacity, held), backlog
    (runnable, held_by_pool, held_by_limit, waiting_for_worker, unowned_triggers),
    import_errors (how many files).
    """
    settings = _settings(ctx)

    async def main() -> Status:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            fleet = await store.fleet()
            endpoints = await store.endpoints()
            errors = await store.import_errors()
        finally:
            await store.close()
        return Status(
            processes=_processes(fleet, endpoints, settings),
            backlog=fleet.backlog,
            import_errors=len(errors),
        )

    found = _run(main)
    if as_json:
        click.echo(msgspec.json.encode(found).decode())
        return
    table = Table("process", "id", "host", "pid", "version", "started", "heartbeat", "address",
                  "load")  # fmt: skip
    for p in found.processes:
        beat = f"{fmt_duration(p.heartbeat_age_s)} ago" + (" (silent)" if p.silent else "")
        table.add_row(
            cell(p.kind),
            cell("" if p.id is None else p.id),
            cell(p.hostname),
            cell(p.pid),
            cell(p.version or ""),
            cell(fmt_time(p.started_at)),
            cell(beat),
            cell(p.url or ""),
            cell(_load(p)),
        )
    print_table(
        table, wide=wide, empty="no engine process is running on this database (none registered)"
    )
    b = found.backlog
    console.print(
        f"backlog: {b.runnable} runnable task(s) not claimed ({b.held_by_pool} held by a pool, "
        f"{b.held_by_limit} by a limit, {b.waiting_for_worker} waiting for a worker), "
        f"{b.unowned_triggers} trigger(s) not held",
        highlight=False,
        soft_wrap=True,
    )
    if found.import_errors:
        console.print(
            f"{found.import_errors} DAG file(s) failed to import: deferral dags list shows them",
            highlight=False,
            soft_wrap=True,
        )
