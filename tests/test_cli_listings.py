"""What the listing commands show: ``tasks list`` (whole ids, results as JSON, the first try's
start kept across a deferral, when a retry is due, the current try's error), ``triggers list``
and ``triggers show`` (kwargs with secrets masked, the tasks waiting), ``runs list`` and
``runs wait``, and ``--state`` checked against the states.

Real engine and real database; the commands run through click's CliRunner on the test
database (in a thread: each runs its own event loop, as on the command line)."""

from __future__ import annotations

import datetime as dt
import functools
import io
import json
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner, Result
from rich.console import Console
from rich.table import Table

from engine import DAG
from engine.cli import cli
from engine.cli.listing import print_table
from engine.states import STATES
from engine.store import Store, TaskInstance
from engine.testing import run_engine
from operators.base import BaseOperator, Context
from operators.python import PythonOperator
from tests.helpers import claimed_tasks, wait_until
from tests.triggers_for_tests import EchoTrigger, FileTrigger, release_file
from triggers.base import encode_value, validate_trigger

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # What is under test are the commands, which run their own loop (uvloop, as installed).
    return ("asyncio", {"use_uvloop": True})


TASK_KEYS = {
    "dag_id",
    "run_id",
    "task_id",
    "map_index",
    "state",
    "try_number",
    "result",
    "rendered",
    "error",
    "trigger_id",
    "started_at",
    "ended_at",
    "retry_at",
    "try_started_at",
    "duration_s",
    "previous_error",
    "waiting_reason",
    "xcom",
}
TRIGGER_KEYS = {
    "id",
    "classpath",
    "kwargs",
    "triggerer_id",
    "waiting",
    "tasks",
    "timeout_at",
    "created_at",
}
RUN_KEYS = {
    "dag_id", "run_id", "run_type", "logical_date", "data_interval_start", "data_interval_end",
    "state", "conf", "created_at", "ended_at", "tasks", "triggering_asset_events",
}  # fmt: skip

#: A run id longer than any terminal is wide.
LONG_RUN_ID = "backfill__2026-12-01T00:00:00+00:00__" + "x" * 120 + "__end"


def invoke(db_url: str, *args: str) -> Result:
    return CliRunner().invoke(cli, list(args), env={"DEFERRAL_DATABASE_URL": db_url})


async def ainvoke(db_url: str, *args: str) -> Result:
    """The command in a thread of its own (it runs its own event loop)."""
    return await anyio.to_thread.run_sync(functools.partial(invoke, db_url, *args))


async def ajson(db_url: str, *args: str) -> Any:
    result = await ainvoke(db_url, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _time(text: str | None) -> dt.datetime | None:
    return None if text is None else dt.datetime.fromisoformat(text)


async def _stored(store: Store, dag_id: str) -> dict[str, TaskInstance]:
    return {ti.task_id: ti for ti in await store.list_task_instances(dag_id=dag_id)}


# -- --state ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "states"),
    [
        (["tasks", "list", "--state", "defered"], sorted(STATES)),
        (["runs", "list", "--state", "runing"], ["failed", "running", "success"]),
    ],
)
def test_an_unknown_state_is_a_usage_error_listing_the_states(
    db_url: str, args: list[str], states: list[str]
) -> None:
    result = invoke(db_url, *args)
    assert result.exit_code == 2, result.output
    assert "--state" in result.output
    for state in states:
        assert state in result.output, (state, result.output)


# -- tasks list --------------------------------------------------------------------------------


class WaitsForFile(BaseOperator):
    """Defers on a file the test creates; returns the file's text when resumed."""

    def __init__(self, *, path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path

    def execute(self, context: Context) -> None:
        self.defer(trigger=FileTrigger(self.path), method_name="resume")

    def resume(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        return {"text": event["text"], "parts": [1, 2], "none": None}


async def test_tasks_list_keeps_the_first_start_across_a_deferral_and_shows_whole_ids(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "go"
    with DAG(dag_id="listed") as dag:
        WaitsForFile(task_id="wait", path=str(path))
    async with run_engine(store, dags=[dag]) as engine:
        await engine.start_run(dag, LONG_RUN_ID)
        await engine.wait_for_state("listed", "wait", "deferred", run_id=LONG_RUN_ID)
        release_file(path, "done")
        await engine.finish("listed", LONG_RUN_ID)

    (row,) = await ajson(db_url, "tasks", "list", "--dag", "listed")
    assert set(row) == TASK_KEYS
    assert row["run_id"] == LONG_RUN_ID
    assert row["state"] == "success"
    assert row["result"] == {"text": "done", "parts": [1, 2], "none": None}  # JSON, not repr
    stored = (await _stored(store, "listed"))["wait"]
    # started_at is the first try's start, not the resume's claim (which came after the wait).
    assert _time(row["started_at"]) == stored.first_try_at == _time(row["try_started_at"])
    assert stored.started_at is not None
    assert stored.first_try_at is not None
    assert stored.started_at > stored.first_try_at
    ended = _time(row["ended_at"])
    assert ended is not None
    assert stored.first_try_at is not None
    assert row["duration_s"] == pytest.approx((ended - stored.first_try_at).total_seconds())
    assert row["retry_at"] is None
    assert row["error"] is None

    # Not a terminal: one line a row, however long; with --wide too.
    for args in ([], ["--wide"]):
        result = await ainvoke(db_url, "tasks", "list", *args)
        assert result.exit_code == 0, result.output
        (line,) = [line for line in result.stdout.splitlines() if "wait" in line]
        assert LONG_RUN_ID in line
        assert '"parts":[1,2]' in line
        assert '"text":"done"' in line
        assert '"none":null' in line
        assert "{'text'" not in result.stdout
        header = result.stdout.splitlines()[1]
        for column in ("run_id", "state", "started_at", "duration", "result", "error"):
            assert column in header, header


async def test_tasks_list_says_when_a_retry_is_due_and_shows_the_current_tries_error(
    store: Store, db_url: str
) -> None:
    second_try = threading.Event()
    go_on = threading.Event()

    def fails_then_waits(try_number: int) -> None:
        if try_number == 1:
            raise ValueError("the first try failed")
        second_try.set()
        go_on.wait(60)
        raise ValueError("the second try failed")

    def always_fails() -> None:
        raise ValueError("not yet")

    with DAG(dag_id="retries") as dag:
        PythonOperator(task_id="again", python_callable=fails_then_waits, retries=1, retry_delay=0)
        PythonOperator(task_id="later", python_callable=always_fails, retries=1, retry_delay=3600)
    try:
        async with run_engine(store, dags=[dag]) as engine:
            await engine.start_run(dag)
            await engine.wait_for_state("retries", "later", "up_for_retry")

            async def second_try_runs() -> bool:
                return second_try.is_set()

            await wait_until(second_try_runs, what="the second try to run")

            rows = {r["task_id"]: r for r in await ajson(db_url, "tasks", "list")}
            later, again = rows["later"], rows["again"]
            assert set(later) == set(again) == TASK_KEYS
            stored = await _stored(store, "retries")
            assert _time(later["retry_at"]) == stored["later"].run_after
            assert "not yet" in later["error"]
            # The retry runs: no error of its own yet; the first try's is the previous one.
            assert (again["state"], again["try_number"]) == ("running", 2)
            assert again["error"] is None
            assert again["retry_at"] is None
            assert "the first try failed" in again["previous_error"]

            table = (await ainvoke(db_url, "tasks", "list")).stdout
            (later_line,) = [line for line in table.splitlines() if "later" in line]
            assert "retry at" in later_line
            assert "ValueError: not yet" in later_line
            (again_line,) = [line for line in table.splitlines() if "again" in line]
            assert "running" in again_line
            assert "first try failed" not in again_line

            go_on.set()
            await engine.wait_for_state("retries", "again", "failed")
            (again,) = await ajson(db_url, "tasks", "list", "--state", "failed")
            assert "the second try failed" in again["error"]
            assert "the first try failed" in again["previous_error"]
            assert again["retry_at"] is None
    finally:
        go_on.set()


# -- triggers list / show ----------------------------------------------------------------------

SECRET_KWARGS = {
    "url": "https://example.test/jobs",
    "password": "hunter2",
    "api_key": "k-123",
    "Refresh_Token": "r-456",
    "headers": {"Authorization": "Bearer abc", "Accept": "application/json", "X-Cookie": "c"},
    "nested": [{"client_secret": "s-789", "name": "kept"}],
}
SECRETS = ("hunter2", "k-123", "r-456", "Bearer abc", "s-789")


async def test_triggers_list_and_show_mask_secrets_and_name_the_waiting_tasks(
    store: Store, db_url: str
) -> None:
    from engine.store import Deferral

    dag_id, worker, claimed = await claimed_tasks(store, 7, "waiters")
    trigger = validate_trigger(EchoTrigger(SECRET_KWARGS))
    deferral = Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name="resume",
        method_kwargs=encode_value({}),
        timeout_s=3600.0,
    )
    for ti in claimed:
        assert await store.defer_task(ti.id, worker, deferral)

    (row,) = await ajson(db_url, "triggers", "list")
    assert set(row) == TRIGGER_KEYS
    data = row["kwargs"]["data"]
    assert data["url"] == SECRET_KWARGS["url"]
    assert data["password"] == data["api_key"] == data["Refresh_Token"] == "***"
    assert data["headers"] == {
        "Authorization": "***",
        "Accept": "application/json",
        "X-Cookie": "***",
    }
    assert data["nested"] == [{"client_secret": "***", "name": "kept"}]
    assert row["waiting"] == 7
    assert row["triggerer_id"] is None
    first = [{"dag_id": dag_id, "run_id": "r1", "task_id": ti.task_id} for ti in claimed]
    assert row["tasks"] == first[:5]  # the first few; waiting counts them all
    assert row["timeout_at"] is not None

    listed = await ainvoke(db_url, "triggers", "list")
    assert listed.exit_code == 0, listed.output
    assert "(+2 more)" in listed.stdout
    assert f"{dag_id}/r1/t0" in listed.stdout
    assert not [s for s in SECRETS if s in listed.stdout], listed.stdout

    shown = await ainvoke(db_url, "triggers", "show", str(row["id"]), "--json")
    assert shown.exit_code == 0, shown.output
    one = json.loads(shown.stdout)
    assert one["tasks"] == first
    assert one["waiting"] == 7
    assert one["kwargs"] == row["kwargs"]
    assert one["deadline_kind"] == "trigger_timeout"
    assert one["triggerer"] is None
    assert {"fence", "created_at", "timeout_at", "classpath", "triggerer_id"} <= set(one)
    text = await ainvoke(db_url, "triggers", "show", str(row["id"]))
    assert text.exit_code == 0, text.output
    assert trigger.classpath in text.stdout
    assert "the timeout given to defer()" in text.stdout
    assert all(f"t{i}" in text.stdout for i in range(7))
    assert not [s for s in SECRETS if s in text.stdout], text.stdout

    missing = await ainvoke(db_url, "triggers", "show", "987654")
    assert missing.exit_code == 2
    assert "no trigger 987654 (it may have fired already)" in missing.output


# -- runs list / wait ----------------------------------------------------------------------------


def _fails() -> None:
    raise RuntimeError("broken on purpose")


async def test_runs_list_and_runs_wait(store: Store, db_url: str) -> None:
    with DAG(dag_id="good") as good:
        PythonOperator(task_id="a", python_callable=lambda: 1)
        PythonOperator(task_id="b", python_callable=lambda: 2)
    with DAG(dag_id="bad") as bad:
        PythonOperator(task_id="c", python_callable=_fails)
    async with run_engine(store, dags=[good, bad]) as engine:
        await engine.run_dag(good, "g1", {"k": "v"})
        await engine.run_dag(bad, "b1")
    await store.create_dag_run("good", "g2", logical_date=await store.now())  # nobody runs it

    rows = await ajson(db_url, "runs", "list")
    assert [(r["dag_id"], r["run_id"], r["state"]) for r in rows] == [
        ("good", "g2", "running"),
        ("bad", "b1", "failed"),
        ("good", "g1", "success"),
    ]
    assert all(set(r) == RUN_KEYS for r in rows)
    assert rows[2]["tasks"] == {"success": 2}
    assert rows[2]["conf"] == {"k": "v"}
    assert rows[0]["tasks"] == {"scheduled": 2}
    assert rows[0]["ended_at"] is None
    assert [r["run_id"] for r in await ajson(db_url, "runs", "list", "--dag", "good")] == [
        "g2",
        "g1",
    ]
    assert [r["run_id"] for r in await ajson(db_url, "runs", "list", "--state", "failed")] == ["b1"]
    assert len(await ajson(db_url, "runs", "list", "--limit", "1")) == 1
    table = await ainvoke(db_url, "runs", "list")
    assert table.exit_code == 0
    assert "2 success" in table.stdout

    ok = await ainvoke(db_url, "runs", "wait", "good", "g1")
    assert ok.exit_code == 0, ok.output
    assert "good/g1: success" in ok.stdout
    assert " a " in ok.stdout
    failed = await ainvoke(db_url, "runs", "wait", "bad", "b1")
    assert failed.exit_code == 1, failed.output
    assert "RuntimeError: broken on purpose" in failed.stdout
    late = await ainvoke(db_url, "runs", "wait", "good", "g2", "--timeout", "0.2")
    assert late.exit_code == 3, late.output
    assert "good/g2: running" in late.stdout
    unknown = await ainvoke(db_url, "runs", "wait", "good", "nope")
    assert unknown.exit_code == 2, unknown.output
    assert "no run 'nope' of DAG 'good'" in unknown.output


async def test_runs_wait_with_the_run_id_alone(store: Store, db_url: str) -> None:
    """`deferral runs wait RUN_ID`: the id `dags trigger` printed is enough when one DAG has a
    run of that id; when several have one, the error names them and asks for the DAG."""
    with DAG(dag_id="good") as good:
        PythonOperator(task_id="a", python_callable=lambda: 1)
    with DAG(dag_id="other") as other:
        PythonOperator(task_id="o", python_callable=lambda: 2)
    async with run_engine(store, dags=[good, other]) as engine:
        await engine.run_dag(good, "only-good")
        await engine.run_dag(good, "shared")
        await engine.run_dag(other, "shared")

    ok = await ainvoke(db_url, "runs", "wait", "only-good")
    assert ok.exit_code == 0, ok.output
    assert "good/only-good: success" in ok.stdout
    both = await ainvoke(db_url, "runs", "wait", "shared")
    assert both.exit_code == 2, both.output
    assert "good, other" in both.output
    assert "deferral runs wait DAG_ID shared" in both.output
    named = await ainvoke(db_url, "runs", "wait", "other", "shared")
    assert named.exit_code == 0, named.output
    assert "other/shared: success" in named.stdout
    unknown = await ainvoke(db_url, "runs", "wait", "nope")
    assert unknown.exit_code == 2, unknown.output
    assert "no run 'nope'" in unknown.output
    too_many = await ainvoke(db_url, "runs", "wait", "a", "b", "c")
    assert too_many.exit_code == 2, too_many.output
    assert "expected RUN or DAG_ID RUN" in too_many.output


async def test_dags_list_shows_the_whole_last_run_id(store: Store, db_url: str) -> None:
    """`dags list` cut the last run's id at the table's width: it is whole, on one line, when
    the output is not a terminal or with --wide, like every other listing."""
    with DAG(dag_id="listed_dag") as dag:
        PythonOperator(task_id="a", python_callable=lambda: 1)
    async with run_engine(store, dags=[dag]) as engine:
        await engine.run_dag(dag, LONG_RUN_ID)
    for args in (("dags", "list"), ("dags", "list", "--wide")):
        result = await ainvoke(db_url, *args)
        assert result.exit_code == 0, result.output
        lines = [line for line in result.stdout.splitlines() if "listed_dag" in line]
        assert len(lines) == 1, result.stdout
        assert LONG_RUN_ID in lines[0], result.stdout


def _terminal(width: int) -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=True, width=width, color_system=None), buffer


def _tasks_table() -> Table:
    table = Table("dag_id", "run_id", "task_id", "state", "try", "started_at", "result", "error")
    for task_id, state in (("first", "success"), ("second", "up_for_retry")):
        table.add_row(
            "orders",
            "manual__2026-12-01T11:30:04.846111+00:00",
            task_id,
            state,
            "1",
            "2026-12-01 11:30:04Z",
            '{"ok":1}',
            "",
        )
    return table


def test_a_table_too_wide_for_the_terminal_shows_each_row_whole() -> None:
    """In an 80-column terminal `tasks list` kept its ids whole by squeezing every other
    column to nothing: no state, no result. A table that cannot fit is shown one row at a
    time, every column named; one that fits stays a table with every column readable."""
    narrow, text = _terminal(80)
    print_table(_tasks_table(), wide=False, out=narrow)
    lines = text.getvalue().splitlines()
    assert "run_id      manual__2026-12-01T11:30:04.846111+00:00" in lines, text.getvalue()
    assert "state       success" in lines
    assert "state       up_for_retry" in lines
    assert 'result      {"ok":1}' in lines
    assert all(len(line) <= 80 for line in lines), text.getvalue()

    roomy, text = _terminal(160)
    print_table(_tasks_table(), wide=False, out=roomy)
    rows = [line for line in text.getvalue().splitlines() if "manual__" in line]
    assert len(rows) == 2, text.getvalue()
    assert "up_for_retry" in rows[1], text.getvalue()
    assert '{"ok":1}' in rows[1], text.getvalue()


async def test_dags_trigger_of_an_existing_run_id_says_how_to_wait_for_it(
    store: Store, db_url: str
) -> None:
    """`dags trigger DAG --run-id R --wait` on a run that exists is refused (exit 2), and the
    error says how to wait for that run instead."""
    with DAG(dag_id="again") as dag:
        PythonOperator(task_id="a", python_callable=lambda: 1)
    async with run_engine(store, dags=[dag]) as engine:
        await engine.run_dag(dag, "r 1")
    result = await ainvoke(db_url, "dags", "trigger", "again", "--run-id", "r 1", "--wait")
    assert result.exit_code == 2, result.output
    assert "DAG again already has a run 'r 1'" in result.output
    assert "to wait for it: deferral runs wait again 'r 1'" in result.output
