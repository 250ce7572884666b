"""The state machine is checked, not only documented.

* The SQL names the same sets as ``engine/states.py``: the domains of the outcome kinds, the
  CHECK constraints of the states and of the deadline kinds (read back from the database), and
  the literals ``queries.sql`` compares the kinds with.
* A stateful property test drives the real store, in random orders, through every operation
  that moves a task instance (claim, finish, stale finish, defer, reschedule, fire, duplicate
  and stale fire, deferral timeout, zombie reap, retry, triggerer lease loss, and an
  operator's mark and clear, with the worker's heartbeats reporting which tries still run)
  while a test-only audit trigger records every change of state in the database. After each
  step: every move is in ``TRANSITIONS`` (or is the mark or clear just made), no try of a task
  instance got two outcomes of its own, try numbers only count up on a claim, no task waits on
  a trigger that is gone, a write of a try that no longer holds its task (a late outcome after
  a mark or a clear included) moves nothing, and no new try starts while an earlier one told
  to stop still runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, ClassVar

import anyio.from_thread
import asyncpg
import msgspec
import pytest
from anyio.from_thread import BlockingPortal
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from engine import DAG
from engine.security.keys import Keyring
from engine.states import (
    DEADLINE_KINDS,
    RUN_STATES,
    STATES,
    TASK_OUTCOME_KINDS,
    TRANSITIONS,
    TRIGGER_OUTCOME_KINDS,
    TRY_OUTCOME_STATES,
)
from engine.store import Deferral, FiredTriggers, Store, TaskOutcome, TriggerOutcome
from engine.store.downstream import resolve_all_pending, settle
from engine.store.queries import load_queries
from operators.base import BaseOperator, Context
from operators.python import PythonOperator
from operators.sensors import BaseSensorOperator
from tests.conftest import REPO, TEST_FERNET_KEY
from tests.plans import fire_statement
from tests.triggers_for_tests import NeverTrigger
from triggers.base import TaskEndState, encode_value, validate_trigger

QUERIES = (REPO / "engine/store/queries.sql").read_text()

# -- the SQL names the Python sets ------------------------------------------------------------


def _case_literals(sql: str, subject: str) -> set[str]:
    """The literals of every ``CASE <subject> WHEN 'x' ...`` (to its END) and of every
    ``<subject> = 'x'`` / ``<subject> <> 'x'`` / ``<subject> IN ('x', ...)`` in ``sql``."""
    found: set[str] = set()
    name = rf"(?:\b\w+\.)?{subject}\b"
    for m in re.finditer(rf"{name}\s*(?:=|<>)\s*'([a-z_]+)'", sql):
        found.add(m.group(1))
    for m in re.finditer(rf"{name}\s+IN\s*\(([^)]*)\)", sql):
        found.update(re.findall(r"'([a-z_]+)'", m.group(1)))
    for m in re.finditer(rf"\bCASE\s+{name}", sql):
        depth, pos = 1, m.end()
        for token in re.finditer(r"\bCASE\b|\bEND\b|\bWHEN\s+'([a-z_]+)'", sql[pos:]):
            if token.group(0) == "CASE":
                depth += 1
            elif token.group(0) == "END":
                depth -= 1
                if depth == 0:
                    break
            elif depth == 1:
                found.add(token.group(1))
    return found


def test_each_outcome_kind_is_handled_by_name_in_the_sql() -> None:
    q = load_queries()
    # Every kind is matched by name (no kind falls into a CASE's ELSE), and no other.
    assert _case_literals(q["finish_tasks"], "kind") == TASK_OUTCOME_KINDS
    # (The fire itself runs in deferral_fire_triggers, which fire_triggers calls.)
    assert _case_literals(fire_statement(), "kind") == TRIGGER_OUTCOME_KINDS
    assert "deferral_task_outcome[]" in q["finish_tasks"]
    assert "deferral_trigger_outcome[]" in fire_statement()
    # The deadline kinds: the ones defer_tasks stores are the ones timeout_deferrals names.
    stored = set(re.findall(r"'([a-z]+_timeout)'", q["defer_tasks"]))
    assert stored == DEADLINE_KINDS
    assert _case_literals(q["timeout_deferrals"], "deadline_kind") <= DEADLINE_KINDS
    # A task end event's state is a trigger outcome kind.
    assert set(TaskEndState.__args__) <= TRIGGER_OUTCOME_KINDS


def test_every_state_the_queries_name_is_a_state() -> None:
    named: set[str] = set()
    for sql in [*load_queries().values(), fire_statement()]:
        if "deferral_task_instances" in sql:
            named |= _case_literals(sql, "state") | _case_literals(sql, "new_state")
    # (Runs are 'running' / 'success' / 'failed': states of task instances too.)
    assert named, "no state literal found: the parser is broken"
    assert named <= STATES, named - STATES
    assert {s for pair in TRANSITIONS for s in pair} <= STATES


def _check_values(definition: str) -> set[str]:
    return set(re.findall(r"'([a-z_]+)'::text", definition))


@pytest.mark.anyio
async def test_the_database_checks_the_same_sets(store: Store, db_url: str) -> None:
    conn = await asyncpg.connect(db_url)
    try:
        domains = {
            r["typname"]: _check_values(r["def"])
            for r in await conn.fetch(
                "SELECT t.typname, pg_get_constraintdef(c.oid) AS def FROM pg_constraint c "
                "JOIN pg_type t ON t.oid = c.contypid WHERE t.typname LIKE 'deferral_%'"
            )
        }
        checks = {
            r["conname"]: _check_values(r["def"])
            for r in await conn.fetch(
                "SELECT conname, pg_get_constraintdef(oid) AS def FROM pg_constraint "
                "WHERE conrelid IN ('deferral_task_instances'::regclass, "
                "'deferral_dag_runs'::regclass) AND contype = 'c'"
            )
        }
    finally:
        await conn.close()
    assert domains == {
        "deferral_task_outcome": TASK_OUTCOME_KINDS,
        "deferral_trigger_outcome": TRIGGER_OUTCOME_KINDS,
    }
    assert checks["deferral_task_instances_state_check"] == STATES
    assert checks["deferral_task_instances_deadline_kind_check"] == DEADLINE_KINDS
    assert checks["deferral_dag_runs_state_check"] == RUN_STATES


@pytest.mark.anyio
async def test_an_unknown_outcome_kind_is_refused_not_taken_for_a_failure(
    store: Store, db_url: str
) -> None:
    dag = _dag()
    await store.upsert_dag("sm", "sm.py", dag.serialize_tasks(), None)
    await store.create_dag_run("sm", "r1", logical_date=await store.now())
    worker = await store.register_worker("test", 1, 10)
    first, second, *_ = (await store.claim_tasks(worker, 10)).claimed
    assert await store.defer_task(second.id, worker, _deferral("unknown", None))
    triggerer = await store.register_triggerer("test", 1, 10, 60.0)
    (trigger,) = (await store.claim_triggers(triggerer, 10)).claimed
    # (Built in Python, a bad kind is a type error; as data that slipped through, the
    # database refuses it and changes nothing.)
    with pytest.raises(asyncpg.CheckViolationError):
        await store.finish_tasks(
            [TaskOutcome(ti_id=first.id, worker_id=worker, try_number=1, kind="done")]  # type: ignore[arg-type]
        )
    with pytest.raises(asyncpg.CheckViolationError):
        await store.fire_triggers(
            triggerer,
            [TriggerOutcome(trigger_id=trigger.id, fence=trigger.fence, kind="fired")],  # type: ignore[arg-type]
        )
    states = {ti.id: ti.state for ti in await store.list_task_instances(dag_id="sm")}
    assert (states[first.id], states[second.id]) == ("running", "deferred")


# -- the stateful test ---------------------------------------------------------------------

#: Test-only: record every task instance's state (and try number) change in the database.
AUDIT_SQL = """
CREATE TABLE sm_audit (
    id bigserial PRIMARY KEY, ti_id bigint NOT NULL, old_state text, new_state text NOT NULL,
    old_try integer, new_try integer NOT NULL);
CREATE FUNCTION sm_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO sm_audit (ti_id, new_state, new_try) VALUES (NEW.id, NEW.state, NEW.try_number);
    ELSIF (OLD.state, OLD.try_number) IS DISTINCT FROM (NEW.state, NEW.try_number) THEN
        INSERT INTO sm_audit (ti_id, old_state, new_state, old_try, new_try)
        VALUES (NEW.id, OLD.state, NEW.state, OLD.try_number, NEW.try_number);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER sm_audit AFTER INSERT OR UPDATE ON deferral_task_instances
    FOR EACH ROW EXECUTE FUNCTION sm_audit();
"""
RESET_SQL = """
TRUNCATE deferral_dag_runs, deferral_task_instances, deferral_triggers, deferral_workers,
         deferral_triggerers, deferral_stopping_tries, deferral_audit, deferral_task_logs,
         sm_audit RESTART IDENTITY CASCADE
"""


class _Sensor(BaseSensorOperator):
    def poke(self, context: Context) -> bool:
        return False  # pragma: no cover - driven through the store, never run


def _noop() -> None:
    return None


def _dag() -> DAG:
    with DAG(dag_id="sm") as dag:
        a = PythonOperator(task_id="a", python_callable=_noop, retries=1, retry_delay=0)
        b = PythonOperator(task_id="b", python_callable=_noop, retries=2, execution_timeout=3600)
        s: BaseOperator = _Sensor(task_id="s", timeout=600, retries=2, retry_delay=0)
        k: BaseOperator = _Sensor(task_id="k", timeout=600, soft_fail=True)
        d = PythonOperator(task_id="d", python_callable=_noop, retries=1, retry_delay=0)
        e = PythonOperator(task_id="e", python_callable=_noop, trigger_rule="all_done")
        [a, b] >> d >> e
        s >> k
    return dag


def _deferral(tag: str, timeout_s: float | None) -> Deferral:
    trigger = validate_trigger(NeverTrigger(f"sm-{tag}"))
    return Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name="resume",
        method_kwargs=encode_value({"tag": tag}),
        timeout_s=timeout_s,
    )


def _pick(data: st.DataObject, items: list[Any], *, recent: bool = True) -> Any:
    """One of the last few items (likely still current) or any (likely stale); None if there
    are none. The draws are the same whatever the list holds: its length follows the
    database's answers (what a claim found due), which a replayed example may not repeat, and
    hypothesis refuses draws whose range changes between replays."""
    last = data.draw(st.booleans()) if recent else False
    n = data.draw(st.integers(min_value=0, max_value=63))
    if not items:
        return None
    pool = items[-3:] if last else items
    return pool[n % len(pool)]


class StoreMachine(RuleBasedStateMachine):
    """Random orders of store operations; the database's audit trail is checked after each."""

    portal: ClassVar[BlockingPortal]
    store: ClassVar[Store]
    conn: ClassVar[asyncpg.Connection]

    def __init__(self) -> None:
        super().__init__()
        self.worker = 0
        self.triggerer = 0
        #: Every claim ever made, (ti id, worker id, try): stale ones stay, to be replayed.
        self.claims: list[tuple[int, int, int]] = []
        #: Every trigger claim ever made, (triggerer id, trigger id, fence).
        self.trigger_claims: list[tuple[int, int, int]] = []
        self.seen = 0
        self.last_step = "reset"
        #: The tries whose code still runs on the current worker (it heartbeats them).
        self.here: set[tuple[int, int]] = set()
        #: Audit ids of the moves an operator made (a mark, a clear): not a try's own outcome.
        self.overrides: list[int] = []
        #: What the last mark or clear may move a task to.
        self.override_to: frozenset[str] = frozenset()
        #: Claims of tries told to stop (by a mark or a clear) that their worker stopped.
        self.stopped: list[tuple[int, int, int]] = []

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        async def call() -> Any:
            return await fn(*args, **kwargs)

        return self.portal.call(call)

    def _write(self, fn: Any, *args: Any) -> Any:
        """A store write, then settling what it moved, as the processes do."""

        async def call() -> Any:
            written = await fn(*args)
            if isinstance(written, FiredTriggers):
                await settle(self.store, written.moved, woke=written.woke)
            else:
                await settle(self.store, written)
            return written

        return self.portal.call(call)

    def _sql(self, method: str, sql: str, *args: Any) -> Any:
        return self.portal.call(getattr(self.conn, method), sql, *args)

    def _last_audit(self) -> int:
        return int(self._sql("fetchval", "SELECT COALESCE(max(id), 0) FROM sm_audit"))

    def _holds(self, ti_id: int, worker: int, try_number: int) -> bool:
        """Whether this claim still holds its task instance (the database's view)."""
        row = self._sql(
            "fetchrow",
            "SELECT state, worker_id, try_number FROM deferral_task_instances WHERE id = $1",
            ti_id,
        )
        return bool(row and (row["state"], row["worker_id"], row["try_number"])
                    == ("running", worker, try_number))  # fmt: skip

    def _moved(self, since: int, ti_id: int | None = None) -> list[Any]:
        rows = self._sql("fetch", "SELECT * FROM sm_audit WHERE id > $1 ORDER BY id", since)
        return [r for r in rows if ti_id is None or r["ti_id"] == ti_id]

    def _as_claim(self, claim: tuple[int, int, int], write: Any, *, any_try: bool = False) -> None:
        """Runs a worker's write for a claim: it moves the task iff the claim still holds it
        (``any_try``: iff its worker holds the task, whichever try)."""
        ti_id, worker, try_number = claim
        if any_try:
            held = self._sql("fetchval", "SELECT try_number FROM deferral_task_instances "
                             "WHERE id = $1 AND worker_id = $2", ti_id, worker)  # fmt: skip
            try_number = try_number if held is None else held
        holds, since = self._holds(ti_id, worker, try_number), self._last_audit()
        write()
        moved = self._moved(since, ti_id)
        if holds:
            assert moved, f"{self.last_step}: the holder's write changed nothing"
        else:
            assert not moved, f"{self.last_step}: a stale claim moved the task: {moved}"

    def _left(self, claim: tuple[int, int, int]) -> None:
        """The try's code has ended on its worker (after writing its outcome, or not)."""
        ti_id, worker, try_number = claim
        if worker == self.worker:
            self.here.discard((ti_id, try_number))

    @initialize()
    def reset(self) -> None:
        self._sql("execute", RESET_SQL)
        now = self._call(self.store.now)
        self._call(self.store.create_dag_run, "sm", "r1", logical_date=now)
        self.worker = self._call(self.store.register_worker, "sm", 1, 10)
        self.triggerer = self._call(self.store.register_triggerer, "sm", 1, 100, 3600.0)

    # -- workers ----------------------------------------------------------------------------

    @rule(n=st.integers(min_value=1, max_value=3))
    def claim(self, n: int) -> None:
        self.last_step = f"claim({n})"
        claimed = self._call(self.store.claim_tasks, self.worker, n).claimed
        self.claims += [(ti.id, self.worker, ti.try_number) for ti in claimed]
        self.here |= {(ti.id, ti.try_number) for ti in claimed}

    @rule(data=st.data(), kind=st.sampled_from(sorted(TASK_OUTCOME_KINDS)), no_retry=st.booleans())
    def finish(self, data: st.DataObject, kind: Any, no_retry: bool) -> None:
        """Ends a try; a claim that is no longer current replays a stale or duplicate outcome."""
        claim = _pick(data, self.claims)
        if claim is None:
            return
        ti_id, worker, try_number = claim
        self.last_step = f"finish({ti_id}, try {try_number}, {kind})"
        error = "x" if kind == "failed" else None
        outcome = TaskOutcome(ti_id=ti_id, worker_id=worker, try_number=try_number, kind=kind,
                              error=error, no_retry=no_retry)  # fmt: skip
        self._as_claim(claim, lambda: self._write(self.store.finish_tasks, [outcome]))
        self._left(claim)

    @rule(
        data=st.data(),
        tag=st.sampled_from(["x", "y", "z"]),
        timeout_s=st.sampled_from([None, 0.0, 3600.0]),
    )
    def defer(self, data: st.DataObject, tag: str, timeout_s: float | None) -> None:
        claim = _pick(data, self.claims)
        if claim is None:
            return
        ti_id, worker, try_number = claim
        self.last_step = f"defer({ti_id}, try {try_number}, {tag}, {timeout_s})"
        deferral = msgspec.structs.replace(_deferral(tag, timeout_s), try_number=try_number)
        self._as_claim(claim, lambda: self._call(self.store.defer_task, ti_id, worker, deferral))
        self._left(claim)

    @rule(data=st.data())
    def reschedule(self, data: st.DataObject) -> None:
        claim = _pick(data, self.claims)
        if claim is None:
            return
        ti_id, worker, try_number = claim
        self.last_step = f"reschedule({ti_id}, try {try_number})"
        at = self._call(self.store.now)
        self._as_claim(
            claim,
            lambda: self._call(
                self.store.reschedule_task, ti_id, worker, at, try_number=try_number
            ),
        )
        self._left(claim)

    @rule()
    def reap_zombies(self) -> None:
        """Every running try whose heartbeat is older than now is reaped (retries apply); its
        worker's row goes, so work continues with a new registration."""
        self.last_step = "reap_zombies"
        self._write(self.store.reap_zombie_tasks, 0.0)
        if not self._call(self.store.heartbeat_worker, self.worker, sorted(self.here)).alive:
            self.worker = self._call(self.store.register_worker, "sm", 1, 10)
            self.here = set()

    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        """A try's code ends without writing anything (it was cancelled after a stop)."""
        claim = _pick(data, self.claims)
        if claim is None:
            return
        self.last_step = f"leave({claim})"
        self._left(claim)

    @rule()
    def heartbeat(self) -> None:
        """The worker reports the tries whose code still runs: the ones told to stop that no
        longer run are settled, the others come back to be stopped."""
        self.last_step = f"heartbeat({sorted(self.here)})"
        beat = self._call(self.store.heartbeat_worker, self.worker, sorted(self.here))
        assert beat.alive, self.last_step
        stopping = self._sql(
            "fetch",
            "SELECT ti_id, try_number FROM deferral_stopping_tries WHERE worker_id = $1",
            self.worker,
        )
        left = {(r["ti_id"], r["try_number"]) for r in stopping}
        assert left <= self.here, f"{self.last_step}: stopped tries kept: {left - self.here}"
        assert {(r.ti_id, r.try_number) for r in beat.stop} == left, self.last_step

    # -- an operator ------------------------------------------------------------------------

    def _override(self, ti_id: int, step: str, moves_to: frozenset[str], call: Any) -> None:
        """The operator's own move of the task instance (its first); what it sets off after
        (the task's resolution, its downstream tasks') moves by the table."""
        self.last_step = step
        self.override_to = moves_to
        since = self._last_audit()
        call()
        self.overrides += [r["id"] for r in self._moved(since, ti_id)[:1]]

    @rule(
        data=st.data(),
        state=st.sampled_from(["success", "failed", "skipped"]),
        rerun=st.booleans(),
    )
    def mark(self, data: st.DataObject, state: str, rerun: bool) -> None:
        ti_id = self._a_task(data)
        self._override(
            ti_id,
            f"mark({ti_id}, {state}, rerun={rerun})",
            frozenset({state}),
            lambda: self._call(self.store.mark_task, ti_id, state, who="sm"),
        )
        if rerun:
            self._stop_and_claim()

    @rule(data=st.data(), rerun=st.booleans())
    def clear(self, data: st.DataObject, rerun: bool) -> None:
        ti_id = self._a_task(data)
        self._override(
            ti_id,
            f"clear({ti_id}, rerun={rerun})",
            frozenset({"scheduled", "pending"}),
            lambda: self._call(self.store.clear_task, ti_id, who="sm"),
        )
        if rerun:
            self._stop_and_claim()

    def _a_task(self, data: st.DataObject) -> int:
        """A running task instance (most often) or any. (The draws do not depend on what the
        database holds, so that hypothesis can replay them.)"""
        rows = self._sql("fetch", "SELECT id, state FROM deferral_task_instances ORDER BY id")
        running = [r["id"] for r in rows if r["state"] == "running"]
        prefer_running = data.draw(st.booleans())
        n = data.draw(st.integers(min_value=0, max_value=5))  # (_dag() has 6 tasks)
        pick = running if prefer_running and running else [r["id"] for r in rows]
        return int(pick[n % len(pick)])

    def _stop_and_claim(self) -> None:
        """The worker stops the tries it was told to stop, reports them gone, and claims (the
        old tries' claims stay, to write late)."""
        beat = self._call(self.store.heartbeat_worker, self.worker, sorted(self.here))
        stopped = {(r.ti_id, r.try_number) for r in beat.stop}
        self.stopped += [(i, self.worker, n) for i, n in sorted(stopped)]
        self.here -= stopped
        self.heartbeat()
        self.claim(3)

    @rule(
        data=st.data(),
        write=st.sampled_from(["success", "failed", "skipped", "defer", "reschedule"]),
    )
    def late_write(self, data: st.DataObject, write: str) -> None:
        """A try told to stop writes what it would have (its worker had not seen the stop, or
        its thread ended after it): nothing moves, whatever try now runs."""
        claim = _pick(data, self.stopped, recent=False)
        if claim is None:
            return
        ti_id, worker, try_number = claim
        self.last_step = f"late_write({ti_id}, try {try_number}, {write})"
        if write == "defer":
            deferral = msgspec.structs.replace(_deferral("x", None), try_number=try_number)
            call: Any = lambda: self._call(self.store.defer_task, ti_id, worker, deferral)  # noqa: E731
        elif write == "reschedule":
            at = self._call(self.store.now)
            call = lambda: self._call(  # noqa: E731
                self.store.reschedule_task, ti_id, worker, at, try_number=try_number
            )
        else:
            outcome = TaskOutcome(ti_id=ti_id, worker_id=worker, try_number=try_number,
                                  kind=write, error="x")  # type: ignore[arg-type]  # fmt: skip
            call = lambda: self._write(self.store.finish_tasks, [outcome])  # noqa: E731
        self._as_claim(claim, call)

    # -- triggerers -------------------------------------------------------------------------

    @rule()
    def claim_triggers(self) -> None:
        self.last_step = "claim_triggers"
        claimed = self._call(self.store.claim_triggers, self.triggerer, 10).claimed
        self.trigger_claims += [(self.triggerer, t.id, t.fence) for t in claimed]

    @rule(
        data=st.data(),
        kind=st.sampled_from(sorted(TRIGGER_OUTCOME_KINDS)),
        twice=st.booleans(),
    )
    def fire(self, data: st.DataObject, kind: Any, twice: bool) -> None:
        """Fires a trigger (a claim lost to another triggerer or already fired: refused);
        ``twice``: the same event is written again at once (a duplicate)."""
        picked = _pick(data, self.trigger_claims)
        if picked is None:
            return
        triggerer, trigger_id, fence = picked
        self.last_step = f"fire({trigger_id}, fence {fence}, {kind}, twice={twice})"
        outcome = TriggerOutcome(trigger_id=trigger_id, fence=fence, kind=kind,
                                 payload=encode_value(kind), error="x")  # fmt: skip
        row = self._sql(
            "fetchrow",
            "SELECT triggerer_id, fence FROM deferral_triggers WHERE id = $1",
            trigger_id,
        )
        current = row is not None and (row["triggerer_id"], row["fence"]) == (triggerer, fence)
        since = self._last_audit()
        accepted = self._write(self.store.fire_triggers, triggerer, [outcome]).accepted
        assert accepted == ({trigger_id} if current else set()), self.last_step
        if not current:
            assert not self._moved(since), f"{self.last_step}: a stale fire moved tasks"
        if twice:
            since = self._last_audit()
            accepted = self._write(self.store.fire_triggers, triggerer, [outcome]).accepted
            assert accepted == set(), f"{self.last_step}: the duplicate was accepted"
            assert not self._moved(since), f"{self.last_step}: the duplicate moved tasks"

    @rule(backstop=st.booleans())
    def timeout(self, backstop: bool) -> None:
        """Ends the deferrals past their deadline, as a triggerer (its triggers) or as the
        scheduler's backstop (all)."""
        self.last_step = f"timeout(backstop={backstop})"
        mine = None if backstop else sorted({t for _, t, _ in self.trigger_claims})
        self._write(self.store.timeout_deferrals, mine)

    @rule()
    def lose_lease(self) -> None:
        """The triggerer's lease lapses: it is reaped, its triggers go back for adoption, and
        a new triggerer takes its place (the old one's claims stay, to fire stale)."""
        self.last_step = "lose_lease"
        self._call(self.store.renew_triggerer_lease, self.triggerer, -60.0)
        self._call(self.store.reap_triggerers)
        self.triggerer = self._call(self.store.register_triggerer, "sm", 1, 100, 3600.0)

    @rule()
    def backstop(self) -> None:
        self.last_step = "backstop"
        self._call(resolve_all_pending, self.store)
        self._call(self.store.finish_dag_runs)

    # -- what must hold -----------------------------------------------------------------------

    @invariant()
    def transitions_are_in_the_table(self) -> None:
        rows = self._sql("fetch", "SELECT * FROM sm_audit WHERE id > $1 ORDER BY id", self.seen)
        if rows:
            self.seen = rows[-1]["id"]
        for r in rows:
            move = (r["old_state"], r["new_state"])
            where = f"task instance {r['ti_id']} after {self.last_step}"
            if r["old_state"] is None:
                assert r["new_state"] in ("pending", "scheduled"), f"created {move}: {where}"
                continue
            if r["id"] in self.overrides:
                assert r["new_state"] in self.override_to, f"{move} by an operator: {where}"
                assert r["new_try"] == r["old_try"], f"an operator changed the try: {where}"
                continue
            assert move in TRANSITIONS, f"{move} is not in the transition table: {where}"
            if r["new_try"] != r["old_try"]:
                assert r["new_try"] == r["old_try"] + 1, f"try {r['old_try']}->{r['new_try']}"
                assert r["new_state"] == "running", f"try counted up on {move}: {where}"

    @invariant()
    def one_outcome_per_try(self) -> None:
        # (Counted since the task instance's last mark or clear: a clear keeps the try number,
        # and a task resolved by its trigger rule before may be resolved again.)
        twice = self._sql(
            "fetch",
            "SELECT a.ti_id, a.old_try, array_agg(a.new_state ORDER BY a.id) AS states "
            "FROM sm_audit a "
            "WHERE a.old_state IS NOT NULL AND a.new_state = ANY ($1::text[]) "
            "AND a.id > COALESCE((SELECT max(o.id) FROM sm_audit o "
            "                     WHERE o.ti_id = a.ti_id AND o.id = ANY ($2::bigint[])), 0) "
            "GROUP BY a.ti_id, a.old_try HAVING count(*) > 1",
            sorted(TRY_OUTCOME_STATES),
            self.overrides,
        )
        assert not twice, f"a try got two outcomes after {self.last_step}: {twice}"

    @invariant()
    def no_new_try_while_an_earlier_one_stops(self) -> None:
        """A try told to stop keeps its task instance from starting another until it has
        stopped; it belongs to a worker that exists (one reaped took its tries with it)."""
        rows = self._sql(
            "fetch",
            "SELECT s.ti_id, s.try_number, ti.try_number AS latest, ti.state, "
            "w.id IS NOT NULL AS worker_known FROM deferral_stopping_tries s "
            "JOIN deferral_task_instances ti ON ti.id = s.ti_id "
            "LEFT JOIN deferral_workers w ON w.id = s.worker_id",
        )
        for r in rows:
            assert r["worker_known"], f"{dict(r)} after {self.last_step}"
            assert r["latest"] == r["try_number"], f"new try while stopping: {dict(r)}"
            assert r["state"] != "running", f"running while stopping: {dict(r)}"

    @invariant()
    def no_task_waits_on_a_trigger_that_is_gone(self) -> None:
        stranded = self._sql(
            "fetch",
            "SELECT id, trigger_id FROM deferral_task_instances ti WHERE state = 'deferred' "
            "AND NOT EXISTS (SELECT 1 FROM deferral_triggers t WHERE t.id = ti.trigger_id)",
        )
        assert not stranded, f"stranded after {self.last_step}: {stranded}"


@pytest.fixture
def machine_store(db_url: str) -> Iterator[tuple[BlockingPortal, Store, asyncpg.Connection]]:
    with anyio.from_thread.start_blocking_portal() as portal:
        store = portal.call(
            lambda: Store.connect(db_url, pool_size=2, keyring=Keyring([TEST_FERNET_KEY]))
        )
        conn = portal.call(asyncpg.connect, db_url)
        try:
            portal.call(conn.execute, AUDIT_SQL)
            dag = _dag()
            portal.call(store.upsert_dag, "sm", "sm.py", dag.serialize_tasks(), None)
            yield portal, store, conn
        finally:
            portal.call(conn.close)
            portal.call(store.close)


def test_random_store_operations_make_only_table_moves_and_one_outcome_per_try(
    machine_store: tuple[BlockingPortal, Store, asyncpg.Connection],
) -> None:
    portal, store, conn = machine_store

    class Machine(StoreMachine):
        pass

    Machine.portal, Machine.store, Machine.conn = portal, store, conn
    run_state_machine_as_test(
        Machine, settings=settings(max_examples=20, stateful_step_count=40, deadline=None)
    )
