"""The store: the only code that talks to PostgreSQL. Every statement is a named query."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import asyncpg
import msgspec

from engine.runtime.crashpoints import crash_point
from engine.runtime.retry import with_db_retry
from engine.security.keys import Keyring, UnreadableValue
from engine.store.downstream import settle
from engine.store.logstore import LogStore
from engine.store.models import (
    ClaimedTask,
    ClaimedTrigger,
    Dag,
    DagRun,
    DagRunSummary,
    DagSummary,
    Deferral,
    EndedRun,
    FinishedTask,
    FiredTriggers,
    Heartbeat,
    MovedTask,
    PoolRow,
    StopRequest,
    TaskInstance,
    TaskOutcome,
    TimedOutTask,
    TriggererRow,
    TriggerOutcome,
    TriggerRow,
    TriggerWaiters,
    WorkLeft,
)
from engine.store.overrides import TaskOverrides
from engine.store.queries import load_queries, migrations
from engine.store.schedules import DuplicateRun, ScheduleStore
from engine.store.status import StatusReads
from engine.store.variables import VariableStore
from engine.store.why import WhyReads
from engine.store.xcom import XComStore
from engine.version import __version__
from operators.base import DEFAULT_POOL, DEFAULT_QUEUE

__all__ = [
    "CHANNEL_DEADLINES",
    "CHANNEL_FINISHED",
    "CHANNEL_RUNS",
    "CHANNEL_STOP",
    "CHANNEL_TASKS",
    "CHANNEL_TRIGGERS",
    "DagRunNotFound",
    "DuplicateRun",
    "Listener",
    "Store",
    "UnknownDag",
]

log = logging.getLogger(__name__)

#: A task instance became runnable: workers claim.
CHANNEL_TASKS = "deferral_tasks"
#: A trigger is unowned: triggerers claim.
CHANNEL_TRIGGERS = "deferral_triggers"
#: A task joined a running trigger with an earlier deadline; the payload is the trigger id.
CHANNEL_DEADLINES = "deferral_deadlines"
#: A run has no unfinished task instance left: the scheduler ends it (payload: its id).
CHANNEL_FINISHED = "deferral_finished"
#: A DAG run ended; the payload is "<dag_id> <run_id> <state>".
CHANNEL_RUNS = "deferral_runs"
#: A mark or a clear told a worker to stop a running try; the payload is the worker's id.
CHANNEL_STOP = "deferral_stop"

#: How many times a process tries to connect and migrate at start before giving up.
CONNECT_ATTEMPTS = 6

Conn = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy
T = TypeVar("T")

#: Batches with fewer values than this are encrypted or decrypted on the event loop; larger
#: ones in a thread (a Fernet token costs some 10-20 us: 5,000 would hold the loop ~0.1 s).
_INLINE_CRYPTO = 256


def _storable_text(text: str | None) -> str | None:
    """PostgreSQL text holds neither NUL characters nor lone surrogates (a filename decoded
    with surrogateescape); an error message can carry both (a task or trigger may raise
    anything). Escaped, it is stored instead of failing the whole batch."""
    if not text:
        return text
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def _structs(records: Sequence[asyncpg.Record], type_: type[T]) -> list[T]:
    """Database rows as structs (the columns a struct does not name are ignored). Each record
    is copied into a dict first: msgspec reads a dict several times faster than a record
    (about 1 against 3-5 us a row, measured on claim and moved rows)."""
    return _from_dicts(list(map(dict, records)), type_)


def _from_dicts(rows: list[dict[str, Any]], type_: type[T]) -> list[T]:
    """Rows already copied into dicts (and decrypted) as structs, in one msgspec call."""
    converted: list[T] = msgspec.convert(rows, list[type_])  # type: ignore[valid-type]
    return converted


def _missing_pools(rows: list[dict[str, Any]], worker_id: int) -> list[TaskOutcome]:
    """The claimed tries whose pool does not exist, as failed outcomes (no retry: another
    try would not find the pool either) naming the pool and how to make it."""
    return [
        TaskOutcome(
            ti_id=row["id"],
            worker_id=worker_id,
            try_number=row["try_number"],
            kind="failed",
            no_retry=True,
            error=(
                f"pool {row['pool']!r} does not exist: create it (deferral pools set "
                f"{row['pool']} --slots N) or set the task's pool to one `deferral pools list` "
                "shows"
            ),
        )
        for row in rows
        if row.get("missing_pool")
    ]


def _struct(record: asyncpg.Record, type_: type[T]) -> T:
    return msgspec.convert(dict(record), type_)


class UnknownDag(LookupError):
    """No DAG with that id has been recorded (its file was never parsed)."""


class PoolNotFound(LookupError):
    """No pool of that name."""


class PoolInUse(ValueError):
    """A pool that unfinished task instances name cannot be deleted."""


class DagRunNotFound(LookupError):
    """No run with that id exists."""


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec(
        "jsonb",
        encoder=lambda value: msgspec.json.encode(value).decode(),
        decoder=msgspec.json.decode,
        schema="pg_catalog",
        format="text",
    )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Pooled connections keep no session state (no LISTEN, no session locks, no SET), so the
    reset round trip asyncpg makes on every release is skipped."""


class Store(
    ScheduleStore, StatusReads, TaskOverrides, LogStore, WhyReads, VariableStore, XComStore
):
    """A pool of connections and one method per named query (or per transaction of them).
    The statements of schedules and run admission are in :mod:`engine.store.schedules`; the
    status page's reads and actions in engine/store/status.py; marks and clears in
    engine/store/overrides.py; the log lines' in
    engine/store/logs.py; the reads of "why is this task not running" in engine/store/why.py."""

    def __init__(self, pool: asyncpg.Pool, url: str, keyring: Keyring | None = None) -> None:
        self._pool = pool
        self.url = url
        self._q = load_queries()
        #: Seals trigger kwargs, resume kwargs, events and results; no keys: plaintext.
        self.keyring = keyring or Keyring()
        #: The worker's heartbeats go on a connection of their own (heartbeat_worker).
        self._heartbeat_conn: asyncpg.Connection | None = None
        self._heartbeat_lock = asyncio.Lock()

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        pool_size: int = 8,
        migrate: bool = True,
        on_connect: Callable[[asyncpg.Connection], Any] | None = None,
        keyring: Keyring | None = None,
    ) -> Store:
        """``on_connect`` also runs for each new pooled connection (benchmarks attach a query
        logger with it). ``keyring``: the encryption keys (none: values stored in plaintext,
        and encrypted ones cannot be read); processes get theirs from ``open_store``."""

        async def init(conn: asyncpg.Connection) -> None:
            await _init_connection(conn)
            if on_connect is not None:
                on_connect(conn)

        # A connection lost while starting (a killed backend, a restarting server) is tried
        # again a few times; a database that cannot be reached at all still fails soon, with
        # its own error.
        pool = await with_db_retry(
            "connect to the database",
            lambda: asyncpg.create_pool(
                url,
                min_size=1,
                max_size=pool_size,
                init=init,
                reset=_keep_session,
                command_timeout=60,
            ),
            attempts=CONNECT_ATTEMPTS,
        )
        store = cls(pool, url, keyring)
        if migrate:
            try:
                await with_db_retry("migrate", store.migrate, attempts=CONNECT_ATTEMPTS)
            except BaseException:
                await store.close()
                raise
        return store

    async def close(self) -> None:
        self._drop_heartbeat_connection()
        await self._pool.close()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @staticmethod
    async def _one(conn: Conn | asyncpg.Pool, sql: str, *args: Any) -> asyncpg.Record:
        """A statement that always returns exactly one row."""
        row = await conn.fetchrow(sql, *args)
        assert row is not None, sql
        return row

    @contextlib.asynccontextmanager
    async def _tx(self) -> AsyncIterator[Conn]:
        async with self._pool.acquire() as conn, conn.transaction():
            yield conn

    # -- schema ------------------------------------------------------------------------

    async def migrate(self) -> list[int]:
        """Apply the migrations not applied yet, in order; returns their versions."""
        applied: list[int] = []
        async with self._tx() as conn:
            await conn.execute(self._q["lock_migrations"])
            await conn.execute(self._q["ensure_migrations_table"])
            done = {r["version"] for r in await conn.fetch(self._q["applied_migrations"])}
            for version, name, sql in migrations():
                if version in done:
                    continue
                await conn.execute(sql)
                await conn.execute(self._q["record_migration"], version, name)
                applied.append(version)
        if applied:
            log.info("applied migrations %s", applied)
        return applied

    async def now(self) -> dt.datetime:
        value: dt.datetime = await self._pool.fetchval(self._q["db_now"])
        return value

    async def notify(self, channel: str, payload: str = "") -> None:
        await self._pool.execute(self._q["notify"], channel, payload)

    # -- moving downstream work on (engine/store/downstream.py runs these) ----------------

    async def resolve_pending(
        self, run_ids: Sequence[int], finished_task_ids: Sequence[str] | None
    ) -> list[MovedTask]:
        """Move on the pending task instances of these runs whose upstreams allow it (of the
        downstreams of ``finished_task_ids``; None: every pending one); returns what moved."""
        rows = await self._pool.fetch(
            self._q["resolve_pending"],
            list(run_ids),
            None if finished_task_ids is None else list(finished_task_ids),
        )
        return _structs(rows, MovedTask)

    async def wake_workers(self) -> None:
        """A task instance became runnable."""
        await self.notify(CHANNEL_TASKS)

    async def notify_finished_runs(self, run_ids: Sequence[int]) -> None:
        """Wake the scheduler for those of these runs with no unfinished task left."""
        await self._pool.execute(self._q["notify_finished_runs"], list(run_ids))

    # -- DAGs and runs -------------------------------------------------------------------

    async def upsert_dag(
        self,
        dag_id: str,
        fileloc: str,
        tasks: list[dict[str, Any]],
        description: str | None,
        schedule: dict[str, Any] | None = None,
        *,
        fingerprint: str | None = None,
    ) -> bool:
        """Record a DAG (``schedule``: :meth:`engine.dags.dag.DAG.serialize_schedule`; None: no
        schedule; ``fingerprint``: the hash of it all, :mod:`engine.scheduler.dagrecord`). Returns
        whether its next scheduled run must be computed again (a new DAG or a changed
        schedule)."""
        sched = schedule or {}
        row = await self._one(
            self._pool,
            self._q["upsert_dag"],
            dag_id,
            fileloc,
            tasks,
            description,
            sched.get("timetable") or {"kind": "none"},
            sched.get("schedule"),
            sched.get("start_date"),
            sched.get("end_date"),
            bool(sched.get("catchup", False)),
            int(sched.get("max_active_runs", 16)),
            bool(sched.get("is_paused_upon_creation", False)),
            sched.get("params") or {},
            list(sched.get("tags") or ()),
            sched.get("max_active_tasks"),
            fingerprint,
        )
        return bool(row["reschedule"])

    async def dags_to_record(self, fingerprints: Mapping[str, str]) -> set[str]:
        """Of these DAGs (id: hash of what a scan found), the ids whose row is missing,
        inactive or records something else."""
        rows = await self._pool.fetch(
            self._q["dags_to_record"], list(fingerprints), list(fingerprints.values())
        )
        return {r["dag_id"] for r in rows}

    async def deactivate_missing_dags(
        self, folder: str, found: Iterable[str], failed_files: Iterable[str]
    ) -> list[str]:
        """Mark inactive (no more scheduled runs) the DAGs recorded from files under
        ``folder`` that a scan did not find, except the DAGs of ``failed_files`` (files that
        failed to import keep their DAGs as they were). Returns their ids."""
        prefix = folder.rstrip("/") + "/"
        rows = await self._pool.fetch(
            self._q["deactivate_missing_dags"], prefix, list(found), list(failed_files)
        )
        return [r["dag_id"] for r in rows]

    async def list_dags(self) -> list[DagSummary]:
        return _structs(await self._pool.fetch(self._q["list_dags"]), DagSummary)

    async def get_dag(self, dag_id: str) -> Dag | None:
        row = await self._pool.fetchrow(self._q["get_dag"], dag_id)
        return None if row is None else _struct(row, Dag)

    async def create_dag_run(
        self,
        dag_id: str,
        run_id: str,
        *,
        logical_date: dt.datetime,
        conf: dict[str, Any] | None = None,
        run_type: str = "manual",
        data_interval: tuple[dt.datetime, dt.datetime] | None = None,
    ) -> int:
        """Create a run and its task instances, running at once whatever the DAG's
        max_active_runs (:meth:`create_queued_run` is held back by it); returns the run's id.
        ``data_interval`` defaults to ``[logical_date, logical_date]``."""
        start, end = data_interval or (None, None)
        try:
            row = await self._pool.fetchrow(
                self._q["create_dag_run"],
                dag_id,
                run_id,
                logical_date,
                conf or {},
                run_type,
                start,
                end,
            )
        except asyncpg.UniqueViolationError:
            raise DuplicateRun(f"DAG {dag_id} already has a run {run_id!r}") from None
        if row is None:
            raise UnknownDag(
                f"unknown DAG {dag_id!r}: no DAG file with that dag_id has been parsed "
                "(pass --dags, or start a scheduler on the DAGs folder)"
            )
        await self.notify(CHANNEL_TASKS)
        run_pk: int = row["id"]
        return run_pk

    async def get_dag_run(self, dag_id: str, run_id: str) -> DagRun | None:
        row = await self._pool.fetchrow(self._q["get_dag_run"], dag_id, run_id)
        return None if row is None else _struct(row, DagRun)

    async def finish_dag_runs(self, run_ids: Sequence[int] | None = None) -> list[EndedRun]:
        """End the runs whose tasks are all finished; announces each on ``deferral_runs``."""
        async with self._tx() as conn:
            locked = await conn.fetch(
                self._q["lock_runs_to_finish"], None if run_ids is None else list(run_ids)
            )
            if not locked:
                return []
            rows = await conn.fetch(self._q["finish_dag_runs"], [r["id"] for r in locked])
            for row in rows:
                await conn.execute(
                    self._q["notify"],
                    CHANNEL_RUNS,
                    f"{row['dag_id']} {row['run_id']} {row['state']}",
                )
        return _structs(rows, EndedRun)

    async def runs_with_pending(self) -> list[int]:
        """The running runs that still have pending task instances."""
        return [r["id"] for r in await self._pool.fetch(self._q["runs_with_pending"])]

    async def list_task_instances(
        self,
        *,
        dag_id: str | None = None,
        run_id: str | None = None,
        state: str | None = None,
        limit: int = 10_000,
    ) -> list[TaskInstance]:
        rows = await self._pool.fetch(self._q["list_task_instances"], dag_id, run_id, state, limit)
        listed = [dict(r) for r in rows]
        for row in listed:
            try:
                row["result"] = self.keyring.decrypt_opt(row["result"])
            except UnreadableValue as exc:
                # One unreadable result must not hide the others: listed without it.
                log.warning("task instance %s: result not shown: %s", row["id"], exc)
                row["result"] = None
        return _from_dicts(listed, TaskInstance)

    async def list_dag_runs(
        self, *, dag_id: str | None = None, state: str | None = None, limit: int = 10_000
    ) -> list[DagRunSummary]:
        """Runs, newest first, with how many task instances are in each state."""
        rows = await self._pool.fetch(self._q["list_dag_runs"], dag_id, state, limit)
        return _structs(rows, DagRunSummary)

    async def set_rendered_fields(
        self, ti_id: int, worker_id: int, try_number: int, rendered: dict[str, Any]
    ) -> bool:
        """Keep what the templated fields of a running try rendered to (JSON-ready values);
        False if the worker no longer holds that try (nothing is written)."""
        row = await self._pool.fetchrow(
            self._q["set_rendered_fields"], ti_id, worker_id, try_number, rendered
        )
        return row is not None

    async def prev_success_interval_start(
        self, dag_id: str, logical_date: dt.datetime
    ) -> dt.datetime | None:
        """The data interval start of the latest successful run of ``dag_id`` before
        ``logical_date``; None when there is none."""
        start: dt.datetime | None = await self._pool.fetchval(
            self._q["prev_success_interval_start"], dag_id, logical_date
        )
        return start

    async def dags_of_run_id(self, run_id: str) -> list[str]:
        """The DAG ids that have a run called ``run_id`` (usually one, or none)."""
        rows = await self._pool.fetch(self._q["dags_of_run_id"], run_id)
        return [r["dag_id"] for r in rows]

    async def count_task_states(self, dag_run_pk: int | None = None) -> dict[str, int]:
        rows = await self._pool.fetch(self._q["count_task_states"], dag_run_pk)
        return {r["state"]: r["n"] for r in rows}

    async def work_left(self) -> WorkLeft:
        """Counts of what is left to do now: ``runnable`` (runnable now, queued or running),
        ``deferred_due`` (deadline due, or trigger not claimed yet), ``runs_to_end``."""
        return _struct(await self._one(self._pool, self._q["work_left"]), WorkLeft)

    # -- pools ---------------------------------------------------------------------------

    async def list_pools(self, name: str | None = None) -> list[PoolRow]:
        """Every pool (or the one named) with what it holds."""
        return _structs(await self._pool.fetch(self._q["list_pools"], name), PoolRow)

    async def set_pool(
        self,
        name: str,
        slots: int,
        *,
        include_deferred: bool | None = None,
        description: str | None = None,
    ) -> bool:
        """Create or change a pool (``None``: keep that field; a new pool: no deferred tasks
        counted, no description); wakes the workers. Returns whether it was created."""
        if not name or not name.strip():
            raise ValueError("a pool needs a non-empty name")
        if slots < 0:
            raise ValueError(f"pool {name}: slots must be >= 0, got {slots}")
        row = await self._one(
            self._pool, self._q["set_pool"], name, slots, include_deferred, description
        )
        return bool(row["created"])

    async def ensure_pool(self, name: str, slots: int) -> None:
        await self._pool.execute(self._q["ensure_pool"], name, slots)

    async def delete_pool(self, name: str) -> None:
        """Delete a pool; raises PoolNotFound, or PoolInUse while unfinished task instances or
        tasks of active DAGs name it (the default pool is never deleted)."""
        if name == DEFAULT_POOL:
            raise PoolInUse(
                f"pool {name} is the pool of every task that names none: it cannot be "
                "deleted (resize it with deferral pools set)"
            )
        row = await self._one(self._pool, self._q["delete_pool"], name)
        if not row["found"]:
            raise PoolNotFound(f"no pool named {name!r} (deferral pools list shows them)")
        if row["deleted"]:
            return
        if row["in_use"]:
            raise PoolInUse(
                f"pool {name} is used by {row['in_use']} task instance(s) not finished yet: "
                "delete it once they end (or clear them), or resize it instead"
            )
        dags = list(row["dag_ids"])
        shown = ", ".join(dags[:10]) + (f" and {len(dags) - 10} more" if len(dags) > 10 else "")
        raise PoolInUse(
            f"pool {name} is named by tasks of active DAG(s) {shown}: their next runs would fail "
            "for want of it; change those tasks' pool (or remove the DAG files) first, or resize "
            "the pool instead"
        )

    # -- workers -------------------------------------------------------------------------

    async def register_worker(
        self, hostname: str, pid: int, slots: int, queues: Sequence[str] = (DEFAULT_QUEUE,)
    ) -> int:
        worker_id: int = await self._pool.fetchval(
            self._q["register_worker"], hostname, pid, slots, __version__, list(queues)
        )
        return worker_id

    async def unregister_worker(self, worker_id: int) -> None:
        await self._pool.execute(self._q["unregister_worker"], worker_id)

    async def heartbeat_worker(
        self,
        worker_id: int,
        running: Sequence[tuple[int, int]],
        *,
        timeout_s: float | None = None,
    ) -> Heartbeat:
        """Keep the worker and the tries it runs (``running``: (task instance id, try number)
        pairs, tries told to stop that still run included) alive; the tries it was told to
        stop that it no longer runs are settled (their slots free), and those it still runs
        come back for it to stop. ``alive`` is False if the worker was reaped.

        With ``timeout_s``, the heartbeat goes on a connection of its own, and the call
        (connecting included) is bounded: past it, TimeoutError, and that connection is dropped
        (the next call makes a new one). A connection that hangs (a half-open socket, a stuck
        backend), or a pool whose connections all wait on hung statements, must not keep the
        worker silent while the scheduler, which reaches the database, counts the silence."""
        args = (
            worker_id,
            [ti_id for ti_id, _ in running],
            [try_number for _, try_number in running],
        )
        if timeout_s is None:
            row = await self._one(self._pool, self._q["heartbeat_worker"], *args)
        else:
            async with self._heartbeat_lock:
                deadline = time.monotonic() + timeout_s
                try:
                    conn = self._heartbeat_conn
                    if conn is None or conn.is_closed():
                        conn = await asyncpg.connect(self.url, timeout=timeout_s)
                        self._heartbeat_conn = conn
                    found = await conn.fetchrow(
                        self._q["heartbeat_worker"],
                        *args,
                        timeout=max(deadline - time.monotonic(), 0.001),
                    )
                except BaseException:
                    self._drop_heartbeat_connection()
                    raise
            assert found is not None
            row = found
        return Heartbeat(
            alive=row["alive"],
            stopped=row["stopped"],
            stop=[
                StopRequest(ti_id=i, try_number=n, reason=r)
                for i, n, r in zip(
                    row["stop_ids"], row["stop_tries"], row["stop_reasons"], strict=True
                )
            ],
        )

    def _drop_heartbeat_connection(self) -> None:
        conn, self._heartbeat_conn = self._heartbeat_conn, None
        if conn is not None:
            conn.terminate()

    async def claim_tasks(
        self,
        worker_id: int,
        limit: int,
        *,
        queues: Sequence[str] = (DEFAULT_QUEUE,),
        parallelism: int = 0,
    ) -> tuple[list[ClaimedTask], float | None]:
        """Claim up to ``limit`` runnable task instances of ``queues`` that every limit admits
        (pools, the DAG's max_active_tasks, the task's max_active_tis_per_dag, and
        ``parallelism`` running tasks across all workers; 0: no limit). With none claimed,
        also says in how many seconds the next waiting one becomes runnable (None: none waits
        for a time). A task naming a pool that does not exist fails, naming it."""
        records = await self._pool.fetch(
            self._q["claim_tasks"], worker_id, limit, list(queues), parallelism
        )
        rows, unreadable = self._open_resumes(records, worker_id)
        unreadable += _missing_pools(rows, worker_id)
        rows = [r for r in rows if not r.get("missing_pool")]
        claimed = _from_dicts([r for r in rows if r["id"] is not None], ClaimedTask)
        next_in: float | None = rows[0]["next_in"] if not claimed and rows else None
        if unreadable:
            # Claimed but not runnable here: the try fails (retries apply), naming the setting.
            await self._fail_unreadable(unreadable)
            if not claimed:
                next_in = 0.0
        return claimed, next_in

    async def _fail_unreadable(self, outcomes: list[TaskOutcome]) -> None:
        """Fail claimed tries no configured key opens. Part of a claim, whose reply has no
        room for what moved: settled here, as the worker settles what it writes."""
        await settle(self, await self.finish_tasks(outcomes))

    def _open_resumes(
        self, rows: list[asyncpg.Record], worker_id: int
    ) -> tuple[list[dict[str, Any]], list[TaskOutcome]]:
        """Decrypt the resume kwargs and events of claimed rows; the ones no configured key
        opens come back as failed outcomes instead."""
        opened: list[dict[str, Any]] = []
        failed: list[TaskOutcome] = []
        for r in rows:
            row = dict(r)
            if row["id"] is not None:
                try:
                    row["next_kwargs"] = self.keyring.decrypt_opt(row["next_kwargs"])
                    row["next_event"] = self.keyring.decrypt_opt(row["next_event"])
                except UnreadableValue as exc:
                    failed.append(
                        TaskOutcome(
                            ti_id=row["id"],
                            worker_id=worker_id,
                            try_number=row["try_number"],
                            kind="failed",
                            error=f"cannot resume: {exc}",
                        )
                    )
                    continue
            opened.append(row)
        return opened, failed

    async def unacknowledged_claims(
        self, worker_id: int, running: Sequence[int]
    ) -> list[ClaimedTask]:
        """The task instances the database says worker ``worker_id`` runs, other than the ones
        it knows it runs (``running``): claims whose reply it never received (the connection
        was lost after the claim committed). Read only; the same try continues."""
        records = await self._pool.fetch(self._q["unacknowledged_claims"], worker_id, list(running))
        rows, unreadable = self._open_resumes(records, worker_id)
        # (A claim fails a task whose pool does not exist in a second statement: when that
        # write was lost too, the task must not run here without its pool.)
        unreadable += _missing_pools(rows, worker_id)
        rows = [r for r in rows if not r.get("missing_pool")]
        if unreadable:
            await self._fail_unreadable(unreadable)
        return _from_dicts(rows, ClaimedTask)

    async def finish_tasks(self, outcomes: Sequence[TaskOutcome]) -> list[FinishedTask]:
        """End running tries in one statement; returns the tries that changed, with their new
        state (a missing one: its worker no longer held it). The caller settles them
        (engine/store/downstream.py)."""
        rows = await self._pool.fetch(
            self._q["finish_tasks"],
            [o.ti_id for o in outcomes],
            [o.worker_id for o in outcomes],
            [o.kind for o in outcomes],
            [self.keyring.encrypt_opt(o.result) for o in outcomes],
            [_storable_text(o.error) for o in outcomes],
            [o.no_retry for o in outcomes],
            [o.try_number for o in outcomes],
        )
        return _structs(rows, FinishedTask)

    async def reschedule_task(
        self, ti_id: int, worker_id: int, at: dt.datetime, *, try_number: int
    ) -> bool:
        """Give try ``try_number``'s slot back until ``at``; False if the worker no longer
        holds that try (nothing is written)."""
        row = await self._pool.fetchrow(
            self._q["reschedule_task"], ti_id, worker_id, at, try_number
        )
        return row is not None

    async def defer_task(self, ti_id: int, worker_id: int, deferral: Deferral) -> bool:
        """Store the trigger (or join an identical waiting one) and park the task on it, in one
        statement. False if the worker no longer holds the task (nothing is written)."""
        keyring = self.keyring
        row = await self._pool.fetchrow(
            self._q["defer_task"],
            ti_id,
            worker_id,
            deferral.classpath,
            keyring.encrypt(deferral.kwargs),
            keyring.dedup_key(deferral.classpath, deferral.kwargs, deferral.dedup_key),
            deferral.timeout_s,
            deferral.method_name,
            keyring.encrypt(deferral.method_kwargs),
            deferral.try_number,
        )
        return row is not None

    # -- triggerers ----------------------------------------------------------------------

    async def register_triggerer(
        self,
        hostname: str,
        pid: int,
        capacity: int,
        lease_s: float,
        queues: Sequence[str] = (DEFAULT_QUEUE,),
    ) -> int:
        triggerer_id: int = await self._pool.fetchval(
            self._q["register_triggerer"],
            hostname,
            pid,
            capacity,
            lease_s,
            __version__,
            list(queues),
        )
        return triggerer_id

    async def renew_triggerer_lease(self, triggerer_id: int, lease_s: float) -> int | None:
        """Extend the lease; returns how many triggers it owns, or None if the lease was lost."""
        row = await self._pool.fetchrow(
            self._q["renew_triggerer_lease"], triggerer_id, lease_s, None, None, None, None
        )
        return None if row is None else int(row["owned"])

    async def owned_triggers(self, triggerer_id: int) -> dict[int, int]:
        rows = await self._pool.fetch(self._q["owned_trigger_ids"], triggerer_id)
        return {r["id"]: r["fence"] for r in rows}

    async def count_owned_triggers(self, triggerer_id: int) -> int:
        n: int = await self._pool.fetchval(self._q["count_owned_triggers"], triggerer_id)
        return n

    async def release_triggers(self, triggerer_id: int, trigger_ids: Sequence[int]) -> set[int]:
        """Unown the given triggers of a triggerer, so any triggerer claims them again."""
        rows = await self._pool.fetch(self._q["release_triggers"], triggerer_id, list(trigger_ids))
        return {r["id"] for r in rows}

    async def release_triggerer(self, triggerer_id: int) -> int:
        """Give up every trigger at once (graceful stop) and remove the triggerer."""
        released: int = await self._pool.fetchval(self._q["release_triggerer"], triggerer_id)
        return released

    async def reap_triggerers(self) -> int:
        """Unown the triggers of triggerers that are gone (lease expired, or session lock
        free); returns how many were freed."""
        gone = [r["id"] for r in await self._pool.fetch(self._q["reap_triggerers"])]
        if not gone:
            return 0
        row = await self._one(self._pool, self._q["release_reaped_triggers"], gone)
        log.warning(
            "%d triggerer(s) gone (session ended or lease lapsed); %d trigger(s) freed for "
            "adoption",
            len(gone),
            row["triggers"],
        )
        return int(row["triggers"])

    async def release_ownerless_triggers(self) -> int:
        """Free triggers owned by no registered triggerer (the scheduler's backstop)."""
        row = await self._one(self._pool, self._q["release_ownerless_triggers"])
        return int(row["triggers"])

    async def claim_triggers(self, triggerer_id: int, limit: int) -> list[ClaimedTrigger]:
        rows = await self._pool.fetch(self._q["claim_triggers"], triggerer_id, limit)
        claimed, unreadable = await self._off_loop(self._open_triggers, rows)
        if unreadable:
            # A trigger no configured key opens cannot run here or anywhere with these keys:
            # its tasks fail (retries apply) with an error naming the setting. Part of a
            # claim, whose reply has no room for what moved: settled here.
            fired = await self.fire_triggers(triggerer_id, unreadable)
            await settle(self, fired.moved, woke=fired.woke)
        return claimed

    def _open_triggers(
        self, rows: list[asyncpg.Record]
    ) -> tuple[list[ClaimedTrigger], list[TriggerOutcome]]:
        """Decrypt the kwargs of claimed triggers; the ones no configured key opens come back
        as failed outcomes instead."""
        opened: list[dict[str, Any]] = []
        failed: list[TriggerOutcome] = []
        for r in rows:
            try:
                kwargs = self.keyring.decrypt(r["kwargs"])
            except UnreadableValue as exc:
                log.error("trigger %s (%s) cannot run: %s", r["id"], r["classpath"], exc)
                failed.append(
                    TriggerOutcome(
                        trigger_id=r["id"],
                        fence=r["fence"],
                        kind="failed",
                        error=f"trigger {r['classpath']} cannot run: {exc}",
                    )
                )
                continue
            row = dict(r)
            row["kwargs"] = kwargs
            opened.append(row)
        return _from_dicts(opened, ClaimedTrigger), failed

    async def _off_loop(self, fn: Callable[[list[Any]], T], items: list[Any]) -> T:
        """Run a (de|en)cryption pass over a large batch in a thread, so the event loop's
        other coroutines are not held for its duration; small batches run inline."""
        if len(items) < _INLINE_CRYPTO or not self.keyring.encrypts:
            return fn(items)
        return await anyio.to_thread.run_sync(fn, items)

    async def count_unowned_triggers(self) -> int:
        n: int = await self._pool.fetchval(self._q["count_unowned_triggers"])
        return n

    async def fire_triggers(
        self, triggerer_id: int, outcomes: Sequence[TriggerOutcome]
    ) -> FiredTriggers:
        """Write a batch of trigger outcomes in one transaction: lock the triggers, then write
        every outcome in one statement (see lock_owned_triggers for why not one statement).

        Returns the ids of the triggers whose outcome was accepted (the others were refused by
        the fencing check: this triggerer no longer owns them) and the task instances that
        moved, which the caller settles (engine/store/downstream.py).
        """
        payloads = await self._off_loop(
            lambda batch: [self.keyring.encrypt_opt(o.payload) for o in batch], list(outcomes)
        )
        ids = [o.trigger_id for o in outcomes]
        async with self._tx() as conn:
            await conn.execute(self._q["lock_owned_triggers"], triggerer_id, ids)
            rows = await conn.fetch(
                self._q["fire_triggers"],
                triggerer_id,
                ids,
                [o.fence for o in outcomes],
                [o.kind for o in outcomes],
                payloads,
                [_storable_text(o.error) for o in outcomes],
            )
        accepted = frozenset([r["fired_id"] for r in rows])
        woke = any(r["woke"] for r in rows)
        moved = _structs([r for r in rows if r["id"] is not None], MovedTask)
        return FiredTriggers(accepted=accepted, moved=moved, woke=woke)

    async def timeout_deferrals(
        self, trigger_ids: Sequence[int] | None, *, grace_s: float = 0.0
    ) -> list[TimedOutTask]:
        """End deferrals past their deadline (of these triggers, or all when None); returns
        what moved, which the caller settles (engine/store/downstream.py)."""
        rows = await self._pool.fetch(
            self._q["timeout_deferrals"],
            None if trigger_ids is None else list(trigger_ids),
            grace_s,
        )
        return _structs(rows, TimedOutTask)

    async def trigger_waiters(self, trigger_ids: Sequence[int]) -> list[TriggerWaiters]:
        """How many task instances wait on each trigger, and the earliest deadline."""
        rows = await self._pool.fetch(self._q["trigger_waiters"], list(trigger_ids))
        return _structs(rows, TriggerWaiters)

    async def delete_owned_triggers(
        self, triggerer_id: int, trigger_ids: Sequence[int]
    ) -> set[int]:
        ids = list(trigger_ids)
        async with self._tx() as conn:
            await conn.execute(self._q["lock_owned_triggers"], triggerer_id, ids)
            rows = await conn.fetch(self._q["delete_owned_triggers"], triggerer_id, ids)
        return {r["id"] for r in rows}

    async def list_triggers(
        self, limit: int = 10_000, *, tasks_per_trigger: int = 5
    ) -> list[TriggerRow]:
        """Triggers with their kwargs (decrypted) and the first ``tasks_per_trigger`` task
        instances waiting on each (``waiting`` counts them all)."""
        rows = await self._pool.fetch(self._q["list_triggers"], limit, tasks_per_trigger)
        return _from_dicts(self._open_listed(rows), TriggerRow)

    async def get_trigger(self, trigger_id: int) -> TriggerRow | None:
        """One trigger with its kwargs (decrypted) and every task instance waiting on it;
        None when there is no such trigger (it fired, or nobody waits on it any more)."""
        row = await self._pool.fetchrow(self._q["get_trigger"], trigger_id)
        return None if row is None else _from_dicts(self._open_listed([row]), TriggerRow)[0]

    def _open_listed(self, rows: Sequence[asyncpg.Record]) -> list[dict[str, Any]]:
        """Rows of triggers with their kwargs decrypted (None where no configured key opens
        them: one unreadable trigger must not hide the others)."""
        listed = [dict(r) for r in rows]
        for row in listed:
            try:
                row["kwargs"] = self.keyring.decrypt(row["kwargs"])
            except UnreadableValue as exc:
                log.warning("trigger %s: kwargs not shown: %s", row["id"], exc)
                row["kwargs"] = None
        return listed

    async def list_triggerers(self) -> list[TriggererRow]:
        return _structs(await self._pool.fetch(self._q["list_triggerers"]), TriggererRow)

    # -- key rotation --------------------------------------------------------------------

    async def rotate_keys(self, *, batch_size: int = 500) -> dict[str, int]:
        """Re-encrypt every stored value with the primary key, in batches of short
        transactions, while the engine runs: each write is conditional on the ciphertext that
        was read, so a value a process changed meanwhile is left alone (it was written with
        that process's primary key). Returns counts: ``rewritten``, ``current`` (already
        under the primary key), ``changed`` (skipped: changed meanwhile) and ``unreadable``
        (no configured key opens them; left as they are)."""
        counts = {"rewritten": 0, "current": 0, "changed": 0, "unreadable": 0}
        last = 0
        while True:
            rows = await self._pool.fetch(self._q["rotation_triggers"], last, batch_size)
            if not rows:
                break
            last = rows[-1]["id"]
            ids, olds, news = [], [], []
            for r in rows:
                new = self._rotated(r["kwargs"], counts)
                if new is not None:
                    ids.append(r["id"])
                    olds.append(r["kwargs"])
                    news.append(new)
            if ids:
                done = await self._pool.fetch(self._q["rotate_trigger_kwargs"], ids, olds, news)
                counts["rewritten"] += len(done)
                counts["changed"] += len(ids) - len(done)
                crash_point("keys.rotate.after_batch")
        last = 0
        while True:
            rows = await self._pool.fetch(self._q["rotation_task_instances"], last, batch_size)
            if not rows:
                break
            last = rows[-1]["id"]
            columns: list[list[Any]] = [[] for _ in range(7)]
            for r in rows:
                pairs = []
                for name in ("next_kwargs", "next_event", "result"):
                    old = r[name]
                    new = None if old is None else self._rotated(old, counts)
                    pairs.append((old, new) if new is not None else (None, None))
                if any(new is not None for _, new in pairs):
                    columns[0].append(r["id"])
                    for i, (old, new) in enumerate(pairs):
                        columns[1 + 2 * i].append(old)
                        columns[2 + 2 * i].append(new)
            if columns[0]:
                wanted = sum(v is not None for col in columns[2::2] for v in col)
                done = await self._pool.fetch(self._q["rotate_task_values"], *columns)
                rewritten = sum(r["rewritten"] for r in done)
                counts["rewritten"] += rewritten
                counts["changed"] += wanted - rewritten
                crash_point("keys.rotate.after_batch")
        await self.rotate_xcom_keys(counts, batch_size=batch_size)
        return counts

    def _rotated(self, value: bytes, counts: dict[str, int]) -> bytes | None:
        """``value`` under the primary key, or None when it needs no rewrite (counted)."""
        if self.keyring.is_current(value):
            counts["current"] += 1
            return None
        try:
            return self.keyring.reencrypt(value)
        except UnreadableValue:
            counts["unreadable"] += 1
            return None

    # -- scheduler housekeeping ----------------------------------------------------------

    async def reap_zombie_tasks(
        self,
        threshold_s: float,
        *,
        contact_since: dt.datetime | None = None,
        last_contact: dt.datetime | None = None,
        max_gap_s: float = 0.0,
    ) -> list[MovedTask]:
        """Fail the running tries whose worker missed heartbeats for ``threshold_s`` seconds.
        Only heartbeats the database could have received count as missed: none before the
        server last started, nor before ``contact_since`` (when the caller's unbroken contact
        with the database began; engine/scheduler/contact.py). With ``last_contact`` (the database
        time of the caller's latest contact), nothing is reaped if this statement starts more
        than ``max_gap_s`` after it. Returns what moved, which the caller settles
        (engine/store/downstream.py)."""
        rows = await self._pool.fetch(
            self._q["reap_zombie_tasks"], threshold_s, contact_since, last_contact, max_gap_s
        )
        return _structs(rows, MovedTask)

    async def delete_orphan_triggers(self, min_age_s: float) -> int:
        async with self._tx() as conn:
            locked = [r["id"] for r in await conn.fetch(self._q["lock_orphan_triggers"], min_age_s)]
            if not locked:
                return 0
            rows = await conn.fetch(self._q["delete_orphan_triggers"], locked)
        return len(rows)

    # -- notifications -------------------------------------------------------------------

    def listener(self, *channels: str) -> Listener:
        return Listener(self.url, channels)


class Listener:
    """A dedicated connection that LISTENs on channels and reconnects when it drops.

    Notifications only wake loops up; every loop still polls as a backstop, so a lost
    notification (or a lost connection) delays work but never loses it.
    """

    def __init__(self, url: str, channels: Iterable[str]) -> None:
        self._url = url
        self._channels = tuple(channels)
        self._conn: asyncpg.Connection | None = None
        self._callbacks: list[Callable[[str, str], None]] = []
        self._closing = False

    def on_notify(self, callback: Callable[[str, str], None]) -> None:
        self._callbacks.append(callback)

    def _dispatch(self, _conn: Any, _pid: int, channel: str, payload: object) -> None:
        for callback in self._callbacks:
            callback(channel, str(payload))

    async def connect(self) -> None:
        conn = await asyncpg.connect(self._url)
        try:
            for channel in self._channels:
                await conn.add_listener(channel, self._dispatch)
            conn.add_termination_listener(self._on_lost)
        except BaseException:
            conn.terminate()  # half made (killed while listening): not kept
            raise
        self._conn = conn

    def _on_lost(self, _conn: object) -> None:
        if not self._closing:
            log.warning("notification connection lost; polling until it is back")
        self._conn = None

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    async def ensure_connected(self) -> None:
        if not self.connected:
            try:
                await self.connect()
            except (
                OSError,
                TimeoutError,
                asyncpg.PostgresError,
                asyncpg.InterfaceError,
                asyncpg.InternalClientError,
            ) as exc:
                log.warning("cannot LISTEN (%s: %s); polling only for now", type(exc).__name__, exc)

    async def close(self) -> None:
        self._closing = True
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            try:
                await conn.close()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.debug("closing the notification connection: %s", exc)
                conn.terminate()
