"""The status page's views (issue 23) against a real database, through aiohttp's test client:
a DAG's grid (runs x tasks, newest first, paged to every run, filtered), the graph's arrows
and its deferred tasks, a run's Gantt view, a task's tries, the DAGs and runs searches, the
triggers by class and triggerer with the blocked-loop reports, and a pool's tasks."""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine import DAG
from engine.store import Deferral, Store, TaskOutcome
from engine.store.logstore import TaskLogRow
from engine.store.models import GridCellCounts, GridRun, TriggererHealth
from engine.store.session import TriggererSession
from engine.web.app import make_app
from engine.web.views.grid import build_grid
from operators.python import PythonOperator
from tests.triggers_for_tests import NeverTrigger
from triggers.base import encode_value, validate_trigger

pytestmark = pytest.mark.anyio

XSS = "<script>alert('x')</script>"
ESCAPED = "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"
DAY = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
HOUR = dt.timedelta(hours=1)


def _noop() -> None:
    pass


@dataclass
class Views:
    store: Store
    worker: int
    triggerer: int
    #: Task instance ids of the newest run (r3).
    ids: dict[str, int]


def _deferral() -> Deferral:
    trigger = validate_trigger(NeverTrigger("views"))
    return Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name="resume",
        method_kwargs=encode_value({}),
        timeout_s=None,
    )


@pytest.fixture
async def views(store: Store) -> Views:
    """DAG "grid" (extract >> load, and wait), tagged "etl", with three runs: r1 a backfill of
    the first hour, r2 scheduled for the second, r3 manual at the third. In r3, extract failed
    its first try (a line in its log) and succeeded its second, load runs, wait is deferred
    on a trigger held by a triggerer. A paused DAG "other" has no run."""
    with DAG(dag_id="grid", tags=["etl"]) as dag:
        extract = PythonOperator(
            task_id="extract", python_callable=_noop, retries=1, retry_delay=dt.timedelta(0)
        )
        extract >> PythonOperator(task_id="load", python_callable=_noop)
        PythonOperator(task_id="wait", python_callable=_noop)
    tasks, schedule = dag.serialize_tasks(), dag.serialize_schedule()
    await store.upsert_dag("grid", "grid.py", tasks, None, schedule)
    await store.upsert_dag("other", "other.py", tasks, None, schedule)
    await store.set_dag_paused("other", True)
    for n, run_type in ((1, "backfill"), (2, "scheduled"), (3, "manual")):
        start = DAY + (n - 1) * HOUR
        await store.create_dag_run(
            "grid",
            f"r{n}",
            logical_date=start,
            run_type=run_type,
            data_interval=(start, start + HOUR),
        )
    worker = await store.register_worker("views-host", 7, 8)
    # r1 and r2: every task through; r3: the scene above.
    ids: dict[str, int] = {}
    while True:
        claimed = (await store.claim_tasks(worker, 10)).claimed
        if not claimed:
            break
        outcomes = []
        for ti in claimed:
            if ti.run_id != "r3":
                outcomes.append(
                    TaskOutcome(
                        ti_id=ti.id, worker_id=worker, try_number=ti.try_number, kind="success"
                    )
                )
                continue
            ids[ti.task_id] = ti.id
            if ti.task_id == "wait":
                assert await store.defer_task(ti.id, worker, _deferral())
            elif ti.task_id == "extract":
                kind = "failed" if ti.try_number == 1 else "success"
                error = "first try failed" if kind == "failed" else None
                outcomes.append(
                    TaskOutcome(
                        ti_id=ti.id,
                        worker_id=worker,
                        try_number=ti.try_number,
                        kind=kind,
                        error=error,
                    )
                )
        if outcomes:
            from engine.store.downstream import settle

            await settle(store, await store.finish_tasks(outcomes))
        if "load" in ids:
            break
    assert {r.run_id for r in await store.finish_dag_runs()} == {"r1", "r2"}
    await store.insert_task_logs(
        [
            TaskLogRow(
                "grid", "r3", "extract", 1, time.time(), "ERROR", "log", "t", "try one's line"
            ),
            TaskLogRow(
                "grid", "r3", "extract", 2, time.time(), "INFO", "log", "t", "try two's line"
            ),
        ]
    )
    triggerer = await store.register_triggerer("trig-host", 9, 50, 60.0)
    assert len((await store.claim_triggers(triggerer, 10)).claimed) == 1
    return Views(store, worker, triggerer, ids)


@pytest.fixture
async def client(views: Views) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(make_app(views.store))) as c:
        yield c


async def get(client: TestClient[Any, Any], path: str, status: int = 200, **params: Any) -> str:
    response = await client.get(f"{path}?{urlencode(params)}" if params else path)
    text = await response.text()
    assert response.status == status, text[-2000:]
    assert XSS not in text
    return text


def region(text: str, element_id: str, end: str = "</table>") -> str:
    start = text.index(f'id="{element_id}"')
    return text[start : text.index(end, start)]


async def test_the_grid_shows_runs_newest_first_with_type_interval_and_cells_linking_to_tries(
    client: TestClient[Any, Any],
) -> None:
    text = await get(client, "/dag", dag_id="grid")
    grid = region(text, "dag-grid")
    heads = re.findall(r'<th class="run-head"><a href="([^"]+)"', grid)
    assert [h.rsplit("=", 1)[1] for h in heads] == ["r3", "r2", "r1"]
    marks = re.findall(r'<span class="rtype">(\w)</span>', grid)
    assert marks == ["M", "S", "B"]
    assert "2026-01-01 02:00 → 2026-01-01 03:00" in grid  # r3's data interval
    assert "2026-01-01 00:00 → 2026-01-01 01:00" in grid
    rows = re.findall(r'<th class="task">(\w+)', grid)
    assert rows == ["extract", "wait", "load"]  # by depth: the roots first
    # r3's cells: extract succeeded (try 2), load runs, wait is deferred.
    extract = grid[grid.index('<th class="task">extract') :].split("</tr>")[0]
    cells = re.findall(r'<a class="cell state-(\w+)" href="([^"]+)" title="([^"]+)"', extract)
    assert [c[0] for c in cells] == ["success"] * 3
    assert cells[0][1] == "/task?dag_id=grid&amp;run_id=r3&amp;task_id=extract"
    assert "extract in r3: success, try 2" in cells[0][2]
    assert 'class="cell state-deferred"' in grid
    assert 'class="cell state-running"' in grid
    legend = region(text, "grid-legend", "</p>")
    for state in ("success", "failed", "deferred", "up_for_retry", "upstream_failed"):
        assert f'state-{state}"></span> {state}' in legend
    assert "runs 1 to 3 of 3" in text


async def test_the_grid_pages_reach_every_run_and_filter_them(views: Views) -> None:
    for n in range(4, 61):
        await views.store.create_dag_run(
            "grid", f"r{n}", logical_date=DAY + (n - 1) * HOUR, run_type="scheduled"
        )
    async with TestClient(TestServer(make_app(views.store))) as client:
        text = await get(client, "/dag", dag_id="grid")
        assert "runs 1 to 25 of 60 · page 1 of 3" in text
        grid = region(text, "dag-grid")
        assert grid.count('class="run-head"') == 25
        assert ">r60<" not in grid
        assert "run_id=r60" in grid
        assert "run_id=r35" not in grid
        last = re.search(r'<a href="([^"]+)">last \(3\)</a>', text)
        assert last is not None
        text = await get(client, last.group(1).replace("&amp;", "&"))
        grid = region(text, "dag-grid")
        assert "runs 51 to 60 of 60" in text
        assert "run_id=r1&" in grid
        # Filters: by state, run type and logical date; they carry over to the pages' links.
        text = await get(client, "/dag", dag_id="grid", run_type="backfill")
        assert "runs 1 to 1 of 1" in text
        assert "run_id=r1&" in region(text, "dag-grid")
        text = await get(client, "/dag", dag_id="grid", state="success")
        assert "runs 1 to 2 of 2" in text  # r1 and r2 ended
        text = await get(client, "/dag", dag_id="grid", since="2026-01-02", run_type="scheduled")
        assert "runs 1 to 25 of 36" in text  # r25 (00:00 on the 2nd) to r60
        assert "since=2026-01-02" in text
        assert "run_type=scheduled" in text
        text = await get(client, "/dag", dag_id="grid", until="2026-01-01")  # the whole day
        assert "of 24" in text
        text = await get(client, "/dag", dag_id="grid", until="2026-01-01T02:00")
        assert "runs 1 to 2 of 2" in text
        text = await get(client, "/dag", dag_id="grid", state="failed")
        assert "no run matches the filter" in text
        for bad in (
            {"state": "nope"},
            {"run_type": "x"},
            {"since": "yesterday"},
            {"run_page": "-1"},
        ):
            await get(client, "/dag", 400, dag_id="grid", **bad)
        # Every run's runs list, across DAGs, with the same filters.
        text = await get(client, "/runs")
        assert "runs 1 to 50 of 60" in text
        text = await get(client, "/runs", run_type="manual")
        listing = region(text, "run-list")
        assert "r3" in listing
        assert listing.count("<tr") == 2


def test_a_cell_of_several_task_instances_shows_their_count_and_the_worst_state() -> None:
    run = GridRun(
        id=1, dag_id="d", run_id="r", run_type="manual", state="running",
        logical_date=DAY, data_interval_start=DAY, data_interval_end=DAY,
        created_at=DAY, started_at=DAY, ended_at=None,
    )  # fmt: skip
    mapped = GridCellCounts(
        dag_run_id=1, task_id="m", instances=5, states={"success": 3, "failed": 2}, try_number=1
    )
    grid = build_grid([run], ["m", "gone"], [mapped], others=True)
    (cell,) = grid.rows[0].cells
    assert cell is not None
    assert (cell.state, cell.count) == ("failed", 5)
    assert cell.title == "m in r: 5 task instances: 2 failed, 3 success"
    assert grid.rows[1].cells == [None]  # a task the run does not have: an empty cell
    # A task a run has that the DAG no longer names is a row of its own, said so.
    extra = GridCellCounts(
        dag_run_id=1, task_id="old", instances=1, states={"success": 1}, try_number=1
    )
    grid = build_grid([run], ["m"], [mapped, extra], others=True)
    assert [(r.task_id, r.note) for r in grid.rows] == [("m", ""), ("old", "not in the DAG now")]


async def test_the_graph_has_an_arrow_per_dependency_and_deferred_tasks_stand_out(
    client: TestClient[Any, Any],
) -> None:
    text = await get(client, "/run", dag_id="grid", run_id="r3")
    svg = region(text, "dag-graph" if 'id="dag-graph"' in text else "run", "</svg>")
    assert '<marker id="arrow"' in svg
    edges = re.findall(
        r'<path class="edge" d="M[^"]+" marker-end="url\(#arrow\)"><title>([^<]+)</title>', svg
    )
    assert edges == ["extract → load"]
    assert re.search(r'<g class="node state-deferred">.*?deferred: on a trigger', svg)
    assert re.search(r'<g class="node state-running">.*?>running<', svg)
    # The DAG's page colors its graph by the grid's newest run.
    text = await get(client, "/dag", dag_id="grid")
    graph = region(text, "dag-graph", "</svg>")
    assert "states of run <a" in graph
    assert ">r3</a>" in graph
    assert 'class="node state-deferred"' in graph


async def test_the_gantt_view_draws_each_try_s_spans(client: TestClient[Any, Any]) -> None:
    text = await get(client, "/gantt", dag_id="grid", run_id="r3")
    chart = region(text, "gantt-chart", "</svg>")
    labels = re.findall(r'<text class="task"[^>]*>([^<]+)</text>', chart)
    # (in the DAG's order, as the task instances were created)
    assert labels == ["extract · try 1", "extract · try 2", "load · try 1", "wait · try 1"]
    rows = chart.split('<g class="row">')[1:]
    kinds = [re.findall(r'class="span span-(\w+)"', row) for row in rows]
    assert kinds[0] == ["queued", "running"]  # try 1, failed and retried
    assert kinds[2][-1] == "running"
    assert kinds[3] == ["queued", "running", "deferred"]
    assert "now (going on)" in rows[3]  # the deferral goes on
    assert "/task?dag_id=grid&amp;run_id=r3&amp;task_id=extract&amp;try=1" in chart
    assert 'id="gantt-legend"' in text
    await get(client, "/gantt", 404, dag_id="grid", run_id="nope")
    text = await get(client, "/run", dag_id="grid", run_id="r3")
    assert '<a href="/gantt?dag_id=grid&amp;run_id=r3" id="gantt-link">' in text


async def test_the_try_selector_shows_each_try_with_its_log_error_and_duration(
    client: TestClient[Any, Any],
) -> None:
    text = await get(client, "/task", dag_id="grid", run_id="r3", task_id="extract")
    selector = region(text, "tries", "</nav>")
    assert re.findall(r"try (\d)", selector) == ["1", "2"]
    assert (
        '<b class="try" aria-current="page"><span class="sq state-success"></span> try 2</b>'
        in selector
    )
    assert "try two&#39;s line" in text
    assert "try one" not in text
    text = await get(client, "/task", dag_id="grid", run_id="r3", task_id="extract", **{"try": "1"})
    assert "an earlier try" in text
    assert "try one&#39;s line" in text
    assert "try two" not in text
    assert "first try failed" in region(text, "error", "</pre>")
    fields = region(text, "task-fields", "</dl>")
    assert "up_for_retry" in fields
    assert "<dt>duration</dt>" in fields
    assert re.search(r"<dt>spans</dt><dd>queued [^,]+, running ", fields)
    await get(client, "/task", 404, dag_id="grid", run_id="r3", task_id="extract", **{"try": "3"})
    await get(client, "/task", 400, dag_id="grid", run_id="r3", task_id="extract", **{"try": "x"})


async def test_dags_are_searched_by_name_tag_latest_run_state_and_paused(
    client: TestClient[Any, Any],
) -> None:
    def listed(text: str) -> list[str]:
        if 'id="dag-list"' not in text or "<table" not in text:
            return []
        return re.findall(r'<a href="/dag\?dag_id=(\w+)">', region(text, "dag-list"))

    assert listed(await get(client, "/dags")) == ["grid", "other"]
    assert listed(await get(client, "/dags", name="GRI")) == ["grid"]
    assert listed(await get(client, "/dags", name="etl")) == ["grid", "other"]  # the tag
    assert listed(await get(client, "/dags", paused="yes")) == ["other"]
    assert listed(await get(client, "/dags", state="running")) == ["grid"]
    text = await get(client, "/dags", state="failed")
    assert listed(text) == []
    assert "no DAG matches the filter" in text
    text = await get(client, "/dags", name=XSS)
    assert ESCAPED in text
    await get(client, "/dags", 400, paused="maybe")


async def test_triggers_by_class_and_triggerer_with_the_blocked_loop_reports(
    views: Views, client: TestClient[Any, Any]
) -> None:
    session = TriggererSession(views.store.url, timeout_s=5)
    await session.connect()
    try:
        health = TriggererHealth(
            loop_lag_p99_ms=3.0, blocked_loops=2, worst_blocker=f"pkg.{XSS}", worst_block_ms=800.0
        )
        assert await session.renew(views.triggerer, 60.0, health) == 1
    finally:
        await session.close()
    text = await get(client, "/triggers")
    classes = region(text, "trigger-classes")
    row = classes[classes.index("NeverTrigger") :].split("</tr>")[0]
    assert re.findall(r'<td class="num">([^<]+)</td>', row)[:3] == ["1", "1", "1"]
    assert f"triggerer {views.triggerer} (800.0 ms)" in classes  # the class that blocked it
    owners = region(text, "trigger-owners")
    assert f"{views.triggerer} (trig-host [9])" in owners
    assert re.search(r'1 / 50</td><td class="num">1</td><td class="num">1</td>', owners)
    assert f"2 (worst: pkg.{ESCAPED}, 800.0 ms)" in owners
    blocks = region(text, "blocked-loops")
    assert f"pkg.{ESCAPED}" in blocks
    assert "800.0 ms" in blocks


async def test_a_pool_s_counts_link_to_its_tasks(
    views: Views, client: TestClient[Any, Any]
) -> None:
    text = await get(client, "/pool", name="default_pool", tasks="deferred")
    tasks = region(text, "pool-tasks")
    assert "grid / r3 / wait" in tasks
    assert "trigger " in tasks
    text = await get(client, "/pool", name="default_pool")  # running by default
    assert "grid / r3 / load" in region(text, "pool-tasks")
    text = await get(client, "/pool", name="default_pool", tasks="queued")
    assert "no task queued in this pool" in text
    await get(client, "/pool", 404, name="nope")
    await get(client, "/pool", 400, name="default_pool", tasks="everything")


async def test_bad_query_parameters_of_the_views_are_a_400_naming_them(
    client: TestClient[Any, Any],
) -> None:
    """Every new page's parameters: not a number, negative, past the database's range, not a
    date, a date past the calendar's end, a value not among the choices, a NUL, a missing one.
    Each is a 400 page naming the parameter, never a 500."""
    run = {"dag_id": "grid", "run_id": "r3"}
    for path, bad, name in (
        ("/runs", {"page": "x"}, "page"),
        ("/runs", {"page": "-1"}, "page"),
        ("/runs", {"page": "99999999999999999999"}, "page"),
        ("/runs", {"state": "nope"}, "state"),
        ("/runs", {"run_type": "nope"}, "run_type"),
        ("/runs", {"since": "yesterday"}, "since"),
        ("/runs", {"since": "2026-13-01"}, "since"),
        ("/runs", {"until": "9999-12-31"}, "until"),
        ("/runs", {"since": "0001-01-01T00:00+14:00"}, "since"),
        ("/runs", {"until": "2026-01-01\x00"}, "until"),
        ("/dag", {"dag_id": "grid", "run_page": "-3"}, "run_page"),
        ("/dag", {"dag_id": "grid", "until": "9999-12-31"}, "until"),
        ("/dags", {"state": "nope"}, "state"),
        ("/dags", {"name": "a\x00"}, "name"),
        ("/gantt", {"dag_id": "grid"}, "run_id"),
        ("/gantt", {**run, "page": "1.5"}, "page"),
        ("/task", {**run, "task_id": "extract", "try": "-1"}, "try"),
        ("/task", {**run, "task_id": "extract", "try": "99999999999999999999"}, "try"),
        ("/pool", {}, "name"),
        ("/pool", {"name": "default_pool", "page": "x"}, "page"),
        ("/triggers", {"triggerer": "1e3"}, "triggerer"),
    ):
        text = await get(client, path, 400, **bad)
        assert name in text, (path, bad)
        assert "<h1>Bad Request</h1>" in text, (path, bad)


async def test_an_earlier_trys_rendered_fields_and_error_are_shown_masked(store: Store) -> None:
    """Try 1's rendered fields and error, kept when try 2 started, go through the same masking
    as the latest try's: a key named like a secret and a password inside a URL are ***."""
    with DAG(dag_id="secret") as dag:
        PythonOperator(task_id="t", python_callable=_noop, retries=1, retry_delay=dt.timedelta(0))
    await store.upsert_dag("secret", "secret.py", dag.serialize_tasks(), None)
    await store.create_dag_run("secret", "r1", logical_date=DAY)
    worker = await store.register_worker("mask-host", 8, 4)
    (first,) = (await store.claim_tasks(worker, 1)).claimed
    rendered = {"password": "hunter2-field", "dsn": "postgresql://u:hunter2-url@db/x"}
    assert await store.set_rendered_fields(first.id, worker, 1, rendered)
    await store.finish_tasks(
        [
            TaskOutcome(
                ti_id=first.id,
                worker_id=worker,
                try_number=1,
                kind="failed",
                error="cannot connect to postgresql://u:hunter2-error@db/x",
            )
        ]
    )
    (second,) = (await store.claim_tasks(worker, 1)).claimed
    assert second.try_number == 2
    async with TestClient(TestServer(make_app(store))) as client:
        text = await get(client, "/task", dag_id="secret", run_id="r1", task_id="t", **{"try": "1"})
    assert "an earlier try" in text
    assert "hunter2" not in text
    assert "***" in region(text, "error", "</pre>")
    assert "***" in text
