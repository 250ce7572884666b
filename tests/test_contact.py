"""The scheduler's contact with the database (engine/scheduler/contact.py): unbroken stretches from
the database times of answered statements, and the reap's own guard against a freeze it did not
see yet. (With real processes and a stopped server: tests/test_database_hang.py.)"""

from __future__ import annotations

import datetime as dt

import pytest

from engine import DAG
from engine.scheduler.contact import Contact, max_gap_s, probe_interval_s
from engine.store import Store
from operators.python import PythonOperator

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def test_contacts_closer_than_the_gap_are_one_stretch() -> None:
    contact = Contact()
    assert contact.broken
    assert contact.since is None
    for s in (0.0, 0.5, 1.4, 2.0):
        contact.seen(_at(s), max_gap_s=1.0)
    assert (contact.since, contact.last, contact.broken, contact.gaps) == (_at(0), _at(2), False, 0)


def test_a_gap_longer_than_allowed_starts_a_new_stretch() -> None:
    # A hang (or this scheduler paused): the first contact after it is where silence counts.
    contact = Contact()
    contact.seen(_at(0), max_gap_s=1.0)
    contact.seen(_at(40), max_gap_s=1.0)
    assert (contact.since, contact.gaps) == (_at(40), 1)
    contact.seen(_at(40.5), max_gap_s=1.0)
    assert contact.since == _at(40)


def test_an_answer_older_than_the_last_contact_changes_nothing() -> None:
    # A statement sent before a freeze and answered after it carries its start time: it is
    # older news than a later probe's, never a sign that contact went on through the freeze.
    contact = Contact()
    contact.seen(_at(0), max_gap_s=1.0)
    contact.seen(_at(40), max_gap_s=1.0)
    contact.seen(_at(0.2), max_gap_s=1.0)
    assert (contact.since, contact.last) == (_at(40), _at(40))


def test_a_failure_makes_the_next_contact_begin_a_stretch() -> None:
    contact = Contact()
    contact.seen(_at(0), max_gap_s=1.0)
    contact.lost()
    assert contact.broken
    contact.seen(_at(0.3), max_gap_s=1.0)
    assert (contact.since, contact.broken, contact.gaps) == (_at(0.3), False, 0)


def test_the_schedulers_own_recovery_restarts_the_stretch_after_a_probes_contact() -> None:
    # The probe reached the database at 5 s, the scheduler's pass (after its backoff) at 9 s:
    # the count begins at 9 s, and a later probe's answer does not move it back.
    contact = Contact()
    contact.seen(_at(0), max_gap_s=1.0)
    contact.lost()
    contact.seen(_at(5), max_gap_s=1.0)
    contact.restart(_at(9))
    contact.seen(_at(9.5), max_gap_s=1.0)
    assert (contact.since, contact.last, contact.broken) == (_at(9), _at(9.5), False)


def test_the_gap_and_the_probe_follow_the_zombie_threshold() -> None:
    assert max_gap_s(30.0) == 15.0
    assert probe_interval_s(30.0) == 1.0  # at most a second
    assert probe_interval_s(2.0) == 0.25  # four probes within the gap


@pytest.mark.anyio
async def test_the_reap_reaps_nothing_when_it_starts_long_after_the_last_contact(
    store: Store,
) -> None:
    with DAG(dag_id="guarded") as dag:
        PythonOperator(task_id="t", python_callable=print)
    await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
    await store.create_dag_run("guarded", "r1", logical_date=await store.now())
    worker = await store.register_worker("test", 1, 1)
    (claimed,) = (await store.claim_tasks(worker, 1)).claimed
    now = await store.now()
    # The statement is the first the database answers after a freeze of 40 s: every
    # heartbeat is older than the threshold, but the scheduler last reached it 40 s ago.
    long_ago, then = now - dt.timedelta(seconds=60), now - dt.timedelta(seconds=40)
    frozen = await store.reap_zombie_tasks(
        0.0, contact_since=long_ago, last_contact=then, max_gap_s=15.0
    )
    assert frozen == []
    assert [w.id for w in (await store.fleet()).workers] == [worker]  # not dropped either
    reaped = await store.reap_zombie_tasks(
        0.0, contact_since=long_ago, last_contact=now, max_gap_s=15.0
    )
    assert [(z.id, z.state) for z in reaped] == [(claimed.id, "failed")]
