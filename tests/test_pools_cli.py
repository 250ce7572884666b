"""``deferral pools set / list / delete``: a pool created and resized (what is not given is
kept), the table and the JSON keys, what a pool holds as its task is queued, running and done,
and the deletes that are refused: a pool a task still uses, default_pool, an unknown pool.

Real database; the commands run through click's CliRunner on the test database (in a thread:
each runs its own event loop, as on the command line)."""

from __future__ import annotations

import datetime as dt
import functools
import json
from typing import Any

import anyio
import pytest
from click.testing import CliRunner, Result

from engine import DAG
from engine.cli import cli
from engine.store import Store, TaskOutcome
from operators.python import PythonOperator

pytestmark = pytest.mark.anyio

#: The keys of ``pools list --json``, in the table's column order.
POOL_KEYS = [
    "name", "slots", "running", "queued", "deferred", "open", "include_deferred", "description",
]  # fmt: skip


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # What is under test are the commands, which run their own loop (uvloop, as installed).
    return ("asyncio", {"use_uvloop": True})


def invoke(db_url: str, *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env={"DEFERRAL_DATABASE_URL": db_url})


async def ainvoke(db_url: str, *args: str) -> Result:
    """The command in a thread of its own (it runs its own event loop)."""
    return await anyio.to_thread.run_sync(functools.partial(invoke, db_url, *args))


async def listed(db_url: str) -> dict[str, dict[str, Any]]:
    """``pools list --json`` by pool name."""
    result = await ainvoke(db_url, "pools", "list", "--json")
    assert result.exit_code == 0, result.output
    return {row["name"]: row for row in json.loads(result.stdout)}


def _noop() -> None:
    pass


async def test_set_creates_a_pool_then_resizes_it_keeping_what_is_not_given(
    store: Store, db_url: str
) -> None:
    result = await ainvoke(
        db_url, "pools", "set", "etl", "--slots", "3", "--include-deferred",
        "--description", "nightly loads",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "pool etl created: 3 slots" in result.output
    assert "deferred tasks counted" in result.output

    result = await ainvoke(db_url, "pools", "set", "etl", "--slots", "5")
    assert result.exit_code == 0, result.output
    assert "pool etl set: 5 slots" in result.output
    (row,) = await store.list_pools("etl")
    assert (row.slots, row.include_deferred, row.description) == (5, True, "nightly loads")

    result = await ainvoke(db_url, "pools", "set", "etl", "--slots", "0", "--no-include-deferred")
    assert result.exit_code == 0, result.output
    (row,) = await store.list_pools("etl")
    assert (row.slots, row.include_deferred, row.description) == (0, False, "nightly loads")

    # default_pool can be resized (never deleted).
    result = await ainvoke(db_url, "pools", "set", "default_pool", "--slots", "7")
    assert result.exit_code == 0, result.output
    assert (await listed(db_url))["default_pool"]["slots"] == 7


async def test_list_shows_the_columns_in_a_table_and_the_keys_in_json(db_url: str) -> None:
    description = "[red]not markup[/] for <b>etl</b>"
    result = await ainvoke(
        db_url, "pools", "set", "etl", "--slots", "3", "--include-deferred",
        "--description", description,
    )  # fmt: skip
    assert result.exit_code == 0, result.output

    result = await ainvoke(db_url, "pools", "list", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [row["name"] for row in rows] == ["default_pool", "etl"]
    for row in rows:
        assert list(row) == POOL_KEYS
    assert rows[1] == {
        "name": "etl",
        "slots": 3,
        "running": 0,
        "queued": 0,
        "deferred": 0,
        "open": 3,
        "include_deferred": True,
        "description": description,
    }
    assert rows[0]["slots"] == 128
    assert rows[0]["include_deferred"] is False

    # Not a terminal: one line a row; rich markup in a description is shown as it is.
    result = await ainvoke(db_url, "pools", "list")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = [c.strip() for c in lines[1].strip("┃ ").split("┃")]
    assert header == POOL_KEYS
    (line,) = [line for line in lines if "etl" in line]
    cells = [c.strip() for c in line.strip("│ ").split("│")]
    assert cells == ["etl", "3", "0", "0", "0", "3", "yes", description]


async def test_delete_is_refused_while_a_task_instance_uses_the_pool(
    store: Store, db_url: str
) -> None:
    result = await ainvoke(db_url, "pools", "set", "etl", "--slots", "3")
    assert result.exit_code == 0, result.output
    with DAG(dag_id="loads") as dag:
        PythonOperator(task_id="load", python_callable=_noop, pool="etl", pool_slots=2)
    await store.upsert_dag("loads", "loads.py", dag.serialize_tasks(), None)
    await store.create_dag_run("loads", "r1", logical_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))

    # Due and not claimed yet: queued (a count of tasks).
    etl = (await listed(db_url))["etl"]
    assert (etl["running"], etl["queued"], etl["open"]) == (0, 1, 3)
    result = await ainvoke(db_url, "pools", "delete", "etl")
    assert result.exit_code == 1, result.output
    assert "pool etl is used by 1 task instance(s) not finished yet" in result.output

    # Running: it holds its pool_slots.
    worker = await store.register_worker("pools-host", 1, 4)
    (claimed,) = (await store.claim_tasks(worker, 10)).claimed
    etl = (await listed(db_url))["etl"]
    assert (etl["running"], etl["queued"], etl["open"]) == (2, 0, 1)
    result = await ainvoke(db_url, "pools", "delete", "etl")
    assert result.exit_code == 1, result.output
    assert "used by 1 task instance(s)" in result.output
    assert [p.name for p in await store.list_pools("etl")] == ["etl"]

    # Its task ended, but the DAG still names the pool: its next run would fail at claim.
    await store.finish_tasks(
        [TaskOutcome(ti_id=claimed.id, worker_id=worker, try_number=1, kind="success")]
    )
    result = await ainvoke(db_url, "pools", "delete", "etl")
    assert result.exit_code == 1, result.output
    assert "named by tasks of active DAG(s) loads" in result.output
    assert [p.name for p in await store.list_pools("etl")] == ["etl"]

    # Once the DAG's task uses another pool, the pool can go.
    with DAG(dag_id="loads") as moved:
        PythonOperator(task_id="load", python_callable=_noop)
    await store.upsert_dag("loads", "loads.py", moved.serialize_tasks(), None)
    result = await ainvoke(db_url, "pools", "delete", "etl")
    assert result.exit_code == 0, result.output
    assert "pool etl deleted" in result.output
    assert await store.list_pools("etl") == []


async def test_default_pool_is_never_deleted(store: Store, db_url: str) -> None:
    result = await ainvoke(db_url, "pools", "delete", "default_pool")
    assert result.exit_code == 1, result.output
    assert "default_pool" in result.output
    assert "cannot be deleted" in result.output
    assert [p.name for p in await store.list_pools("default_pool")] == ["default_pool"]


async def test_an_unknown_pool_is_an_error_saying_how_to_see_the_pools(db_url: str) -> None:
    result = await ainvoke(db_url, "pools", "delete", "nope")
    assert result.exit_code == 2, result.output
    assert "no pool named 'nope'" in result.output
    assert "deferral pools list" in result.output
    assert "Traceback" not in result.output
