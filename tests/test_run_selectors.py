"""Every command that takes a RUN takes a run id, a logical date (``2026-11-20``, with a time
too, naive in the DAG's time zone), a unique prefix of an id, or ``latest``, and suggests the
closest ids when the selector names no run (engine/client/runsel.py, the one resolver).

The commands run through click's CliRunner on the test's database (in a thread: each runs its
own event loop, as on the command line)."""

from __future__ import annotations

import datetime as dt
import functools
import json
import zoneinfo
from typing import Any

import anyio
import pytest
from click.testing import CliRunner, Result

from engine import DAG
from engine.cli import cli
from engine.client.runsel import date_span
from engine.scheduler.dagrecord import DagRecorder
from engine.store import Store
from operators.python import PythonOperator

pytestmark = pytest.mark.anyio

UTC = dt.UTC
PARIS = zoneinfo.ZoneInfo("Europe/Paris")

#: The runs of DAG "sel", in the order they are created (the last: the newest, ``latest``).
MIDNIGHT = "scheduled__2026-11-20T00:00:00+00:00"
MORNING = "manual__2026-11-20T07:40:17.123456+00:00"
NEXT_DAY = "scheduled__2026-11-21T00:00:00+00:00"
NEWEST = "manual__2026-12-02T07:40:17.123456+00:00"
RUNS = {
    MIDNIGHT: dt.datetime(2026, 11, 20, tzinfo=UTC),
    MORNING: dt.datetime(2026, 11, 20, 7, 40, 17, 123456, tzinfo=UTC),
    NEXT_DAY: dt.datetime(2026, 11, 21, tzinfo=UTC),
    NEWEST: dt.datetime(2026, 12, 2, 7, 40, 17, 123456, tzinfo=UTC),
}


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})  # (the commands run their own loop)


def _noop() -> None:
    return None


def invoke(db_url: str, *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env={"DEFERRAL_DATABASE_URL": db_url})


async def ainvoke(db_url: str, *args: str) -> Result:
    return await anyio.to_thread.run_sync(functools.partial(invoke, db_url, *args))


async def run_of(db_url: str, *selector_args: str) -> str:
    """The run id ``tasks list --json`` lists tasks of, with ``--run`` and its arguments."""
    result = await ainvoke(db_url, "tasks", "list", "--json", *selector_args)
    assert result.exit_code == 0, result.output
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    assert rows, result.output
    (run_id,) = {str(row["run_id"]) for row in rows}
    return run_id


@pytest.fixture
async def runs(store: Store) -> Store:
    """DAG ``sel`` (one task, ``a``) with the four runs of RUNS; DAG ``other`` with a run
    called like sel's first (run ids are unique within a DAG only)."""
    with DAG(dag_id="sel") as sel:
        PythonOperator(task_id="a", python_callable=_noop)
    with DAG(dag_id="other") as other:
        PythonOperator(task_id="o", python_callable=_noop)
    await DagRecorder(store).record([sel, other])
    for run_id, when in RUNS.items():
        kind = run_id.split("__")[0]
        await store.create_dag_run("sel", run_id, logical_date=when, run_type=kind)
    await store.create_dag_run("other", MIDNIGHT, logical_date=RUNS[MIDNIGHT], run_type="scheduled")
    return store


async def test_a_logical_date_names_a_run(runs: Store, db_url: str) -> None:
    # A day: the run exactly at its start is the one meant (the manual run that morning is
    # in the same day).
    assert await run_of(db_url, "--dag", "sel", "--run", "2026-11-20") == MIDNIGHT
    assert await run_of(db_url, "--dag", "sel", "--run", "2026-11-21") == NEXT_DAY
    # To the minute, to the second, to the microsecond, with an offset.
    assert await run_of(db_url, "--dag", "sel", "--run", "2026-11-20T07:40") == MORNING
    assert await run_of(db_url, "--dag", "sel", "--run", "2026-11-20 07:40:17") == MORNING
    assert await run_of(db_url, "--dag", "sel", "--run", "2026-11-20T08:40:17+01:00") == MORNING
    assert await run_of(db_url, "--dag", "sel", "--run", "2026-12-02T07:40:17.123456") == NEWEST


async def test_a_unique_prefix_and_latest_name_a_run(runs: Store, db_url: str) -> None:
    assert await run_of(db_url, "--dag", "sel", "--run", "manual__2026-12") == NEWEST
    assert await run_of(db_url, "--dag", "sel", "--run", "scheduled__2026-11-21") == NEXT_DAY
    assert await run_of(db_url, "--dag", "sel", "--run", "latest") == NEWEST
    assert await run_of(db_url, "--dag", "sel", "--run", MORNING) == MORNING  # in full


async def test_a_typo_suggests_the_closest_ids(runs: Store, db_url: str) -> None:
    typo = "manual__2026-12-02T07:40:17.123465+00:00"  # two digits swapped
    result = await ainvoke(db_url, "tasks", "list", "--dag", "sel", "--run", typo)
    assert result.exit_code == 2, result.output
    assert f"no run {typo!r} of DAG 'sel'" in result.output
    assert f"did you mean {NEWEST}" in result.output
    assert "Traceback" not in result.output
    # A mistyped date suggests the runs of the date meant.
    result = await ainvoke(db_url, "tasks", "list", "--dag", "sel", "--run", "2026-11-2l")
    assert result.exit_code == 2, result.output
    assert "did you mean" in result.output
    assert MIDNIGHT in result.output
    # Nothing close: where to look instead.
    result = await ainvoke(db_url, "tasks", "list", "--dag", "sel", "--run", "zzz")
    assert result.exit_code == 2, result.output
    assert "deferral runs list --dag sel" in result.output


async def test_a_selector_that_names_several_runs_lists_them(runs: Store, db_url: str) -> None:
    result = await ainvoke(db_url, "tasks", "list", "--dag", "sel", "--run", "manual__")
    assert result.exit_code == 2, result.output
    assert MORNING in result.output
    assert NEWEST in result.output
    assert "give more of the id" in result.output
    # A date without a DAG: sel's and other's runs of that midnight.
    result = await ainvoke(db_url, "runs", "wait", "2026-11-20", "--timeout", "0.1")
    assert result.exit_code == 2, result.output
    assert "DAG sel" in result.output
    assert "DAG other" in result.output
    # A full id two DAGs have: tasks list lists both, runs wait asks for the DAG.
    rows = json.loads((await ainvoke(db_url, "tasks", "list", "--run", MIDNIGHT, "--json")).stdout)
    assert {row["dag_id"] for row in rows} == {"sel", "other"}
    result = await ainvoke(db_url, "runs", "wait", MIDNIGHT)
    assert result.exit_code == 2, result.output
    assert f"deferral runs wait DAG_ID {MIDNIGHT}" in result.output


async def test_every_command_taking_a_run_resolves_it(runs: Store, db_url: str) -> None:
    why = await ainvoke(db_url, "tasks", "why", "sel", "2026-11-21", "a")
    assert why.exit_code == 0, why.output
    assert "no run" not in why.output
    wrong = await ainvoke(db_url, "tasks", "why", "sel", "2026-11-22", "a")
    assert wrong.exit_code == 2, wrong.output
    assert "no run '2026-11-22' of DAG 'sel'" in wrong.output

    logs = await ainvoke(db_url, "tasks", "logs", "sel", "latest", "a")
    assert logs.exit_code == 0, logs.output
    wrong = await ainvoke(db_url, "tasks", "logs", "sel", "manual__2026-12-02T07:40:17.123465", "a")
    assert wrong.exit_code == 2, wrong.output
    assert f"did you mean {NEWEST}" in wrong.output

    waited = await ainvoke(db_url, "runs", "wait", "sel", "2026-11-21", "--timeout", "0.1")
    assert waited.exit_code == 3, waited.output  # (nobody runs it: still running)
    assert f"sel/{NEXT_DAY}: running" in waited.output
    # The run's DAG is found when only one DAG has such a run.
    newest = await ainvoke(db_url, "runs", "wait", "latest", "--timeout", "0.1")
    assert newest.exit_code == 3, newest.output
    assert "other/" in newest.output  # (other's run was created last)
    prefixed = await ainvoke(db_url, "runs", "wait", "manual__2026-12", "--timeout", "0.1")
    assert f"sel/{NEWEST}: running" in prefixed.output


async def test_a_naive_date_is_in_the_dags_time_zone(store: Store, db_url: str) -> None:
    """A DAG scheduled at Paris midnight: its run of 2026-11-20 has the logical date
    2026-11-19T23:00Z, and `2026-11-20` names it."""
    with DAG(
        dag_id="paris",
        schedule="@daily",
        start_date=dt.datetime(2026, 1, 1, tzinfo=PARIS),
    ) as paris:
        PythonOperator(task_id="a", python_callable=_noop)
    await DagRecorder(store).record([paris])
    when = dt.datetime(2026, 11, 20, tzinfo=PARIS)
    run_id = f"scheduled__{when.astimezone(UTC).isoformat()}"
    await store.create_dag_run("paris", run_id, logical_date=when, run_type="scheduled")
    assert await run_of(db_url, "--dag", "paris", "--run", "2026-11-20") == run_id
    assert await run_of(db_url, "--dag", "paris", "--run", "2026-11-19T23:00Z") == run_id


def _at(*parts: int) -> dt.datetime:
    return dt.datetime(*parts, tzinfo=UTC)  # type: ignore[arg-type,misc]


@pytest.mark.parametrize(
    ("text", "start", "length"),
    [
        ("2026-11-20", _at(2026, 11, 20), dt.timedelta(days=1)),
        ("2026-11-20T06", _at(2026, 11, 20, 6), dt.timedelta(hours=1)),
        ("2026-11-20 06:30", _at(2026, 11, 20, 6, 30), dt.timedelta(minutes=1)),
        ("2026-11-20T06:30:05Z", _at(2026, 11, 20, 6, 30, 5), dt.timedelta(seconds=1)),
        ("2026-11-20T06:30:05.1", _at(2026, 11, 20, 6, 30, 5, 100000), dt.timedelta(seconds=0.1)),
        ("2026-11-20T07:30+01:00", _at(2026, 11, 20, 6, 30), dt.timedelta(minutes=1)),
    ],
)
def test_a_date_names_the_span_it_is_written_to(
    text: str, start: dt.datetime, length: dt.timedelta
) -> None:
    assert date_span(text) == (start, start + length)


def test_a_day_of_a_clock_change_is_its_wall_clock_day() -> None:
    start, end = date_span("2026-10-25", PARIS) or (None, None)
    assert start == dt.datetime(2026, 10, 24, 22, tzinfo=UTC)
    assert end == dt.datetime(2026, 10, 25, 23, tzinfo=UTC)  # 25 hours


@pytest.mark.parametrize("text", ["latest", "manual__2026", "2026-13-45", "2026-11-20x", ""])
def test_what_is_not_a_date(text: str) -> None:
    assert date_span(text) is None
