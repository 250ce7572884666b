"""The status page on DAGs of 5,000 tasks, a chain and a fan (one root, 5,000 tasks side by
side, one join), recorded in a real database with a run each: every page that shows such a
DAG, its runs, a run or one of its tasks answers 200 with a bounded body (the task table
paged, the graph summarized)."""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlencode

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine import DAG
from engine.store import Store
from engine.web.app import make_app
from engine.web.graph import depths
from operators.python import PythonOperator

pytestmark = pytest.mark.anyio

N = 5000
#: The largest body a page of such a DAG may have.
MAX_BODY = 400_000


def _chain() -> list[dict[str, Any]]:
    # (weight_rule absolute: the default adds up every downstream task for each task.)
    with DAG(dag_id="chain") as dag:
        previous = None
        for i in range(N):
            task = PythonOperator(task_id=f"c{i}", python_callable=print, weight_rule="absolute")
            if previous is not None:
                previous >> task
            previous = task
    # Listed last task first: the page must not depend on the order the tasks come in.
    return dag.serialize_tasks()[::-1]


def _fan() -> list[dict[str, Any]]:
    with DAG(dag_id="fan") as dag:
        root = PythonOperator(task_id="root", python_callable=print, weight_rule="absolute")
        join = PythonOperator(task_id="join", python_callable=print, weight_rule="absolute")
        for i in range(N):
            (
                root
                >> PythonOperator(task_id=f"f{i}", python_callable=print, weight_rule="absolute")
                >> join
            )
    return dag.serialize_tasks()


@pytest.fixture
async def client(store: Store) -> AsyncIterator[TestClient[Any, Any]]:
    for dag_id, tasks in (("chain", _chain()), ("fan", _fan())):
        await store.upsert_dag(dag_id, f"{dag_id}.py", tasks, None)
        await store.create_dag_run(
            dag_id, "r1", logical_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        )
    async with TestClient(TestServer(make_app(store, token="t0ken"))) as c:
        yield c


async def _get(client: TestClient[Any, Any], path: str, **params: str) -> str:
    started = time.perf_counter()
    response = await client.get(f"{path}?{urlencode(params)}" if params else path)
    text = await response.text()
    took = time.perf_counter() - started
    print(f"{path} {params}: {response.status}, {len(text):,} bytes, {took * 1000:.0f} ms")
    assert response.status == 200, (path, params, text[-2000:])
    assert len(text) <= MAX_BODY, (path, params, len(text))
    return text


@pytest.mark.parametrize("dag_id", ["chain", "fan"])
async def test_every_page_of_a_5000_task_dag_answers_with_a_bounded_body(
    client: TestClient[Any, Any], dag_id: str
) -> None:
    first, middle, last = (
        ("c0", f"c{N // 2}", f"c{N - 1}") if dag_id == "chain" else ("root", f"f{N // 2}", "join")
    )
    total = N if dag_id == "chain" else N + 2
    text = await _get(client, "/dags")
    assert re.search(rf'>{dag_id}</a></td>.*<td class="num">{total}</td>', text)

    # The DAG: its graph summarized, its tasks listed 100 a page.
    text = await _get(client, "/dag", dag_id=dag_id)
    assert "<svg" not in text
    summary = text[text.index('id="graph-summary"') :]
    levels, widest = (N, 1) if dag_id == "chain" else (3, N)
    assert f"{total:,} tasks, {total - 1 if dag_id == 'chain' else 2 * N:,} dependencies" in summary
    assert f"{levels:,} level(s) on the longest path, at most {widest:,} task(s) side by side" in (
        " ".join(summary.split())
    )
    assert f">{first}<" in summary[summary.index('id="graph-roots"') :]
    assert last in summary[summary.index('id="graph-leaves"') :]
    listed = text[text.index('id="dag-tasks"') :]
    assert listed[: listed.index("</table>")].count("<tr") == 1 + 100  # a header, 100 tasks
    assert f"tasks 1 to 100 of {total:,} · page 1 of {-(-total // 100)}" in text
    text = await _get(client, "/dag", dag_id=dag_id, page="2")
    assert f"tasks 101 to 200 of {total:,}" in text
    text = await _get(client, "/dag", dag_id=dag_id, page="999999")  # past the end: the last
    assert f"to {total:,} of {total:,}" in text

    # A run: its tasks 100 a page, by state, its graph summarized with the states.
    text = await _get(client, "/run", dag_id=dag_id, run_id="r1")
    assert "<svg" not in text
    grid = text[text.index('id="grid"') : text.index("</table>", text.index('id="grid"'))]
    assert grid.count("<tr") == 101
    assert f"tasks 1 to 100 of {total:,}" in text
    states = text[text.index('id="grid-states"') :]
    assert re.search(r"scheduled 1<", states)  # the first task
    assert re.search(rf"pending {total - 1:,}<", states)
    assert 'id="graph-states"' in text
    text = await _get(client, "/run", dag_id=dag_id, run_id="r1", state="scheduled")
    grid = text[text.index('id="grid"') : text.index("</table>", text.index('id="grid"'))]
    assert grid.count("<tr") == 2
    assert f">{first}</a>" in grid
    pending = total - 1
    text = await _get(client, "/run", dag_id=dag_id, run_id="r1", state="pending", page="50")
    pages = -(-pending // 100)
    assert f"tasks 4,901 to {min(pending, 5000):,} of {pending:,} · page 50 of {pages}" in text
    assert "state=pending&amp;page=49" in text  # the other pages keep the state
    text = await _get(client, "/run", dag_id=dag_id, run_id="r1", state="failed")
    assert "no task failed" in text

    # Each task: the join's 5,000 upstream tasks named ten at a time, the others counted.
    for task_id in (first, middle, last):
        text = await _get(client, "/task", dag_id=dag_id, run_id="r1", task_id=task_id)
    if dag_id == "fan":
        assert f"… ({N:,} in all)" in text or f"… ({N} in all)" in text
        assert f"and {N - 10} more ({N - 10} pending)" in text


async def test_bad_paging_parameters_are_a_400_page(client: TestClient[Any, Any]) -> None:
    for path, params in (
        ("/run", {"dag_id": "fan", "run_id": "r1", "state": "nope"}),
        ("/run", {"dag_id": "fan", "run_id": "r1", "page": "x"}),
        ("/run", {"dag_id": "fan", "run_id": "r1", "page": "-1"}),
        ("/run", {"dag_id": "fan", "run_id": "r1", "page": "99999999999999999999"}),
        ("/dag", {"dag_id": "fan", "page": "1.5"}),
    ):
        response = await client.get(f"{path}?{urlencode(params)}")
        assert response.status == 400, params
        assert "<h1>Bad Request</h1>" in await response.text()


def test_depths_need_no_recursion_and_no_order() -> None:
    """A chain of 100,000 tasks listed last first; a fan; a cycle (which a recorded DAG never
    has) still gives every task a depth."""
    n = 100_000
    chain = {f"t{i}": [f"t{i - 1}"] if i else [] for i in reversed(range(n))}
    depth = depths(chain)
    assert (depth["t0"], depth[f"t{n - 1}"]) == (0, n - 1)
    fan = {"root": [], **{f"f{i}": ["root"] for i in range(10)}}
    fan["join"] = [f"f{i}" for i in range(10)]
    assert depths(fan) == {"root": 0, **{f"f{i}": 1 for i in range(10)}, "join": 2}
    looped = depths({"a": [], "b": ["a", "c"], "c": ["b"]})
    assert looped["a"] == 0
    assert set(looped) == {"a", "b", "c"}
