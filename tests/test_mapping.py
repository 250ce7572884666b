"""Dynamic task mapping (expand) on a real engine: over a literal list, over an upstream
task's list, over an empty list (skipped), expand_kwargs, partial's shared arguments,
several arguments (their product), TaskFlow's expand, the downstream pulling the list in map
index order, a mapped fleet of deferrable sensors that holds no worker slot while it waits,
and the max_map_length limit."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner

from engine import DAG, task
from engine.cli import cli
from engine.dags.dagbag import DagBag
from engine.store import Store
from engine.testing import EngineTimeout, run_engine
from engine.web.app import make_app
from engine.worker.outcomes import Expanded
from operators.base import BaseOperator, Context, MapInputError
from operators.bash import BashOperator
from operators.python import PythonOperator
from operators.sensors.file import FileSensor
from tests.helpers import wait_until
from triggers.base import decode_value
from triggers.temporal import TimeDeltaTrigger

pytestmark = pytest.mark.anyio


def _result(ti: dict[str, Any]) -> Any:
    assert ti["state"] == "success", ti
    return decode_value(ti["result"]) if ti["result"] is not None else None


async def _run(store: Store, dag: DAG, run_id: str = "run1", **kwargs: Any) -> dict[str, Any]:
    async with run_engine(store, **kwargs) as engine:
        await engine.start_run(dag, run_id)
        return await engine.finish(dag.dag_id, run_id)


def _mapped(tis: dict[str, Any], task_id: str) -> list[dict[str, Any]]:
    found = sorted(
        (ti for ti in tis.values() if ti.get("task_id") == task_id), key=lambda t: t["map_index"]
    )
    return found


async def test_expand_over_a_literal_list_with_shared_partial_arguments(store: Store) -> None:
    def double(x: int, offset: int) -> int:
        return x * 2 + offset

    with DAG(dag_id="map_literal") as dag:
        mapped = PythonOperator.partial(task_id="double", python_callable=double).expand(
            op_kwargs=[{"x": 1, "offset": 100}, {"x": 2, "offset": 100}, {"x": 3, "offset": 0}]
        )
        total = PythonOperator(
            task_id="total", python_callable=lambda ti: ti.xcom_pull(task_ids="double")
        )
        mapped >> total
    tis = await _run(store, dag)
    assert tis["__run__"]["state"] == "success"
    instances = _mapped(tis, "double")
    assert [t["map_index"] for t in instances] == [0, 1, 2]
    assert [_result(t) for t in instances] == [102, 104, 6]
    assert set(tis) >= {"double[0]", "double[1]", "double[2]"}
    # The downstream pulls the list, in map index order.
    assert _result(tis["total"]) == [102, 104, 6]


async def test_taskflow_expand_over_an_upstream_list_and_the_reference_is_the_list(
    store: Store,
) -> None:
    with DAG(dag_id="map_upstream") as dag:

        @task
        def numbers() -> list[int]:
            return [5, 1, 4, 2, 3, 9, 7, 8, 6, 10, 11, 12]

        @task
        def scale(x: int, factor: int) -> int:
            return x * factor

        @task
        def collect(values: list[int], ti: Any) -> dict[str, Any]:
            return {
                "values": values,
                "pulled": ti.xcom_pull(task_ids="scale"),
                "one": ti.xcom_pull(task_ids="scale", map_indexes=2),
                "some": ti.xcom_pull(task_ids="scale", map_indexes=[3, 0]),
            }

        collect(scale.partial(factor=10).expand(x=numbers()))
    tis = await _run(store, dag, slots=4)
    assert tis["__run__"]["state"] == "success"
    expected = [50, 10, 40, 20, 30, 90, 70, 80, 60, 100, 110, 120]
    assert [_result(t) for t in _mapped(tis, "scale")] == expected
    got = _result(tis["collect"])
    assert got["values"] == expected
    assert got["pulled"] == expected
    assert got["one"] == 40
    assert got["some"] == [20, 50]


async def test_expand_over_an_empty_list_skips_the_task_and_its_downstream(store: Store) -> None:
    with DAG(dag_id="map_empty") as dag:

        @task
        def nothing() -> list[int]:
            return []

        @task
        def each(x: int) -> int:
            return x

        @task
        def after(values: list[int]) -> int:
            return len(values)

        @task(trigger_rule="all_done")
        def anyway(values: list[int]) -> list[int]:
            return values

        mapped = each.expand(x=nothing())
        after(mapped)
        anyway(mapped)
    tis = await _run(store, dag)
    assert tis["nothing"]["state"] == "success"
    assert tis["each"]["state"] == "skipped"
    assert tis["each"]["map_index"] == -1
    assert tis["after"]["state"] == "skipped"
    # A task that runs anyway sees an empty list.
    assert _result(tis["anyway"]) == []


async def test_expand_kwargs_over_a_literal_and_over_an_upstream_list(store: Store) -> None:
    with DAG(dag_id="map_kwargs") as dag:

        @task
        def configs() -> list[dict[str, Any]]:
            return [{"a": 1, "b": 2}, {"a": 10, "b": 20}]

        @task
        def add(a: int, b: int) -> int:
            return a + b

        add.expand_kwargs(configs())
        BashOperator.partial(task_id="echo", env={"X": "x"}).expand_kwargs(
            [{"bash_command": "echo one-$X"}, {"bash_command": "echo two-$X"}]
        )
    tis = await _run(store, dag)
    assert [_result(t) for t in _mapped(tis, "add")] == [3, 30]
    assert [_result(t) for t in _mapped(tis, "echo")] == ["one-x", "two-x"]


async def test_several_arguments_map_over_their_product(store: Store) -> None:
    with DAG(dag_id="map_product") as dag:

        @task
        def pair(a: int, b: str) -> str:
            return f"{a}{b}"

        pair.expand(a=[1, 2], b=["x", "y", "z"])
    tis = await _run(store, dag)
    got = [_result(t) for t in _mapped(tis, "pair")]
    assert got == ["1x", "1y", "1z", "2x", "2y", "2z"]


async def test_more_values_than_max_map_length_fail_the_task_clearly(store: Store) -> None:
    with DAG(dag_id="map_limit") as dag:

        @task
        def many() -> list[int]:
            return list(range(6))

        @task(retries=3)
        def each(x: int) -> int:
            return x

        each.expand(x=many())
    tis = await _run(store, dag, worker_options={"max_map_length": 5})
    assert tis["__run__"]["state"] == "failed"
    ti = tis["each"]
    assert ti["state"] == "failed"  # no retry: the same values would be refused again
    assert "map_limit.each" in ti["error"]
    assert "6 values" in ti["error"]
    assert "limit of 5" in ti["error"]
    assert "max_map_length" in ti["error"]
    assert not _mapped({k: v for k, v in tis.items() if k != "each"}, "each")


async def test_mapping_over_a_value_that_is_no_list_fails_clearly(store: Store) -> None:
    with DAG(dag_id="map_bad") as dag:

        @task
        def text() -> str:
            return "abc"

        @task
        def each(x: str) -> str:
            return x

        each.expand(x=text())
    tis = await _run(store, dag)
    assert tis["each"]["state"] == "failed"
    assert "cannot map over x: it is a str" in tis["each"]["error"]


def test_declaration_errors_are_clear() -> None:
    with DAG(dag_id="map_decl"):
        with pytest.raises(MapInputError, match="needs a list"):
            BashOperator.partial(task_id="a").expand(bash_command="echo")
        with pytest.raises(TypeError, match="no argument 'nope'"):
            BashOperator.partial(task_id="b").expand(nope=[1])
        with pytest.raises(TypeError, match="given to both"):
            BashOperator.partial(task_id="c", bash_command="x").expand(bash_command=["y"])
        with pytest.raises(TypeError, match="cannot be mapped"):
            BashOperator.partial(task_id="d", bash_command="x").expand(retries=[1, 2])
        with pytest.raises(TypeError, match="needs task_id"):
            BashOperator.partial(bash_command="x")

        @task
        def f(x: int) -> int:
            return x

        with pytest.raises(TypeError, match="no parameter 'y'"):
            f.expand(y=[1])


async def test_a_mapped_fleet_of_deferrable_sensors_holds_no_slot_while_waiting(
    store: Store, tmp_path: Path
) -> None:
    count = 24
    paths = [str(tmp_path / f"ready-{i}") for i in range(count)]
    with DAG(dag_id="map_fleet") as dag:

        @task
        def files() -> list[str]:
            return paths

        sensors = FileSensor.partial(
            task_id="wait", deferrable=True, poke_interval=0.05, timeout=600
        ).expand(filepath=files())

        @task
        def done(found: list[Any]) -> int:
            return len(found)

        done(sensors.output)
    async with run_engine(store, slots=2) as engine:
        await engine.start_run(dag, "run1")

        for i in range(count):
            await engine.wait_for_state("map_fleet", f"wait[{i}]", "deferred")
        # Every sensor waits, none of them on a worker slot.
        assert not engine.worker.running
        running = await store.list_task_instances(dag_id="map_fleet", state="running")
        assert running == []
        for p in paths:
            await anyio.Path(p).write_text("ok")
        tis = await engine.finish("map_fleet", "run1")
    assert tis["__run__"]["state"] == "success"
    assert [t["state"] for t in _mapped(tis, "wait")] == ["success"] * count
    assert _result(tis["done"]) == count
    assert engine.worker.peak_running <= 2
    # Each instance's try has its own log: its deferral and how its trigger ended it.
    lines = [line.message for line in (await store.task_logs("map_fleet", "run1", "wait[5]")).lines]
    assert any(line.startswith("deferred to trigger") for line in lines), lines
    assert any("ended the task: success" in line and paths[5] in line for line in lines), lines
    assert not any(paths[6] in line for line in lines), lines


async def test_the_cli_addresses_a_mapped_instance(store: Store, db_url: str) -> None:
    def shout(word: str) -> str:
        print(f"shouting {word}")
        return word.upper()

    with DAG(dag_id="map_cli") as dag:
        PythonOperator.partial(task_id="shout", python_callable=shout).expand(
            op_args=[["a"], ["b"], ["c"], ["d"]]
        )
        PythonOperator(task_id="plain", python_callable=lambda: 1)
    tis = await _run(store, dag)
    assert tis["__run__"]["state"] == "success"
    env = {"DEFERRAL_DATABASE_URL": db_url}
    runner = CliRunner()

    def cli_run(*args: str) -> Any:
        return runner.invoke(cli, list(args), env=env)

    async def run(*args: str) -> Any:
        return await anyio.to_thread.run_sync(cli_run, *args)

    listed = await run("tasks", "list", "--dag", "map_cli", "--json")
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    assert sorted((t["task_id"], t["map_index"]) for t in rows) == [
        ("plain", -1),
        ("shout", 0),
        ("shout", 1),
        ("shout", 2),
        ("shout", 3),
    ]
    table = await run("tasks", "list", "--dag", "map_cli", "--wide")
    assert "shout[3]" in table.stdout
    for address in (["--task", "shout[2]"], ["--task", "shout", "--map-index", "2"]):
        one = await run("tasks", "list", "--dag", "map_cli", *address, "--json")
        assert [(t["task_id"], t["map_index"]) for t in json.loads(one.stdout)] == [("shout", 2)]
    every = await run("tasks", "list", "--dag", "map_cli", "--task", "shout", "--json")
    assert [t["map_index"] for t in json.loads(every.stdout)] == [0, 1, 2, 3]
    bad_list = await run("tasks", "list", "--task", "shout[-1]")
    assert bad_list.exit_code == 2

    for address in (["shout[3]"], ["shout", "--map-index", "3"]):
        one = await run("tasks", "xcom", "map_cli", "run1", *address, "--key", "return_value")
        assert one.exit_code == 0, one.output
        assert json.loads(one.stdout) == "D"
        logs = await run("tasks", "logs", "map_cli", "run1", *address)
        assert logs.exit_code == 0, logs.output
        assert "shouting d" in logs.stdout
        assert "shouting a" not in logs.stdout
        why = await run("tasks", "why", "map_cli", "run1", *address)
        assert why.exit_code == 0, why.output
        assert "success" in why.stdout

    bad = await run("tasks", "xcom", "map_cli", "run1", "shout[x]")
    assert bad.exit_code == 2
    assert "must be a number" in bad.stderr
    out_of_range = await run("tasks", "logs", "map_cli", "run1", "shout[7]")
    assert out_of_range.exit_code == 2
    assert "out of range" in out_of_range.stderr
    assert "4 mapped instance(s), [0] to [3]" in out_of_range.stderr
    bare = await run("tasks", "why", "map_cli", "run1", "shout")
    assert bare.exit_code == 2
    assert "shout[0] or with --map-index 0" in bare.stderr
    unmapped = await run("tasks", "xcom", "map_cli", "run1", "plain[1]")
    assert unmapped.exit_code == 2
    assert "not mapped" in unmapped.stderr
    clash = await run("tasks", "xcom", "map_cli", "run1", "shout[1]", "--map-index", "2")
    assert clash.exit_code == 2
    assert "different instances" in clash.stderr


async def test_clear_and_mark_address_one_mapped_instance(store: Store, db_url: str) -> None:
    def shout(word: str) -> str:
        return word.upper()

    with DAG(dag_id="map_cm") as dag:
        mapped = PythonOperator.partial(task_id="shout", python_callable=shout).expand(
            op_args=[["a"], ["b"], ["c"], ["d"]]
        )
        mapped >> PythonOperator(task_id="after", python_callable=lambda: 1)
    tis = await _run(store, dag)
    assert tis["__run__"]["state"] == "success"
    env = {"DEFERRAL_DATABASE_URL": db_url}

    async def run(*args: str) -> Any:
        return await anyio.to_thread.run_sync(lambda: CliRunner().invoke(cli, list(args), env=env))

    async def states() -> dict[str, str]:
        rows = await store.list_task_instances(dag_id="map_cm")
        return {
            t.task_id if t.map_index < 0 else f"{t.task_id}[{t.map_index}]": t.state for t in rows
        }

    cleared = await run(
        "tasks", "clear", "map_cm", "--run", "run1", "--task", "shout[2]", "--yes", "--json"
    )
    assert cleared.exit_code == 0, cleared.output
    assert [(o["task_id"], o["map_index"]) for o in json.loads(cleared.stdout)] == [("shout", 2)]
    now = await states()
    assert now["shout[2]"] == "scheduled"
    assert {now[f"shout[{i}]"] for i in (0, 1, 3)} == {"success"}

    marked = await run(
        "tasks", "mark-failed", "map_cm", "run1", "shout", "--map-index", "1", "--json"
    )
    assert marked.exit_code == 0, marked.output
    assert [(o["task_id"], o["map_index"]) for o in json.loads(marked.stdout)] == [("shout", 1)]
    now = await states()
    assert (now["shout[1]"], now["shout[0]"], now["shout[3]"]) == ("failed", "success", "success")

    # With --downstream, the named instance and the downstream tasks, whole. (No terminal to
    # confirm on: it lists what it would clear and refuses.)
    listed = await run(
        "tasks", "clear", "map_cm", "--run", "run1", "--task", "shout[0]", "--downstream"
    )
    assert listed.exit_code == 1, listed.output
    assert "would clear 2 task instances" in listed.output
    assert "shout[0]" in listed.output
    assert "after" in listed.output
    assert "shout[3]" not in listed.output

    # The bare id still reaches every instance.
    every = await run("tasks", "mark-success", "map_cm", "run1", "shout", "--json")
    assert every.exit_code == 0, every.output
    assert sorted(o["map_index"] for o in json.loads(every.stdout)) == [1, 2]

    out_of_range = await run("tasks", "mark-success", "map_cm", "run1", "shout[7]")
    assert out_of_range.exit_code == 2
    assert "out of range" in out_of_range.stderr
    unmapped = await run("tasks", "clear", "map_cm", "--run", "run1", "--task", "after[0]", "--yes")
    assert unmapped.exit_code == 2
    assert "not mapped" in unmapped.stderr


_ISOLATED_MAPPED_DAG = """
import os

from engine import DAG, task
from operators.python import PythonOperator


def where(x):
    return [x, os.getpid()]


with DAG("mapped_isolated"):

    @task
    def values():
        return [["a"], ["b"], ["c"]]

    PythonOperator.partial(
        task_id="each", python_callable=where, isolation="process"
    ).expand(op_args=values())
"""


async def test_mapped_instances_run_in_their_own_process_with_isolation(
    store: Store, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "mapped_isolated_dag.py").write_text(_ISOLATED_MAPPED_DAG)
    bag = DagBag(dags)
    async with run_engine(store, dagbag=bag) as engine:
        tis = await engine.run_dag(bag.get_dag("mapped_isolated"))
    results = [_result(t) for t in _mapped(tis, "each")]
    assert [r[0] for r in results] == ["a", "b", "c"]
    assert all(pid != os.getpid() for _, pid in results)


async def test_the_status_page_shows_and_addresses_mapped_instances(store: Store) -> None:
    def shout(word: str, ti: Any) -> str:
        print(f"shouting {word}")
        ti.xcom_push("word", word)
        return word.upper()

    with DAG(dag_id="map_web") as dag:
        PythonOperator.partial(task_id="shout", python_callable=shout).expand(
            op_args=[["alpha"], ["beta"], ["gamma"]]
        )
    await _run(store, dag)
    async with TestClient(TestServer(make_app(store))) as client:

        async def get(path: str) -> tuple[int, str]:
            response = await client.get(path)
            return response.status, await response.text()

        status, run_page = await get("/run?dag_id=map_web&run_id=run1")
        assert status == 200
        for i in range(3):
            assert f"shout[{i}]" in run_page
        status, page = await get("/task?dag_id=map_web&run_id=run1&task_id=shout%5B1%5D")
        assert status == 200
        assert "BETA" in page
        assert "shouting beta" in page  # its own log lines
        assert "shouting alpha" not in page
        assert "<dt>word</dt>" in page
        status, gantt = await get("/gantt?dag_id=map_web&run_id=run1")
        assert status == 200
        assert "shout[2]" in gantt
        status, page = await get("/task?dag_id=map_web&run_id=run1&task_id=shout%5B9%5D")
        assert status == 404
        assert "out of range" in page
        status, page = await get("/task?dag_id=map_web&run_id=run1&task_id=shout")
        assert status == 404
        assert "shout[0] or with --map-index 0" in page
    # The page's actions on an instance's page act on that instance alone.
    async with TestClient(TestServer(make_app(store, token="t0ken-for-tests"))) as acting:
        page = await (
            await acting.get("/task?dag_id=map_web&run_id=run1&task_id=shout%5B1%5D")
        ).text()
        assert 'name="map_index" value="1"' in page
        form = {
            "dag_id": "map_web", "run_id": "run1", "task_id": "shout", "map_index": "1",
            "state": "failed", "token": "t0ken-for-tests",
        }  # fmt: skip
        response = await acting.post("/actions/mark", data=form, allow_redirects=False)
        assert response.status == 303
        assert response.headers["Location"].endswith("task_id=shout%5B1%5D")
    states = {t.map_index: t.state for t in await store.list_task_instances(dag_id="map_web")}
    assert states == {0: "success", 1: "failed", 2: "success"}


async def test_trigger_rules_count_the_mapped_instances(store: Store) -> None:
    def check(x: int) -> int:
        if x == 2:
            raise ValueError("two is bad")
        return x

    with DAG(dag_id="map_rules") as dag:
        mapped = PythonOperator.partial(task_id="check", python_callable=check).expand(
            op_args=[[1], [2], [3]]
        )
        strict = PythonOperator(task_id="strict", python_callable=lambda: "ran")
        on_failure = PythonOperator(
            task_id="on_failure", python_callable=lambda: "ran", trigger_rule="one_failed"
        )
        done = PythonOperator(
            task_id="done",
            python_callable=lambda ti: ti.xcom_pull(task_ids="check"),
            trigger_rule="all_done",
        )
        mapped >> [strict, on_failure, done]
    tis = await _run(store, dag)
    assert [t["state"] for t in _mapped(tis, "check")] == ["success", "failed", "success"]
    assert tis["strict"]["state"] == "upstream_failed"
    assert _result(tis["on_failure"]) == "ran"
    # The failed instance has no value: the list holds the others', in map index order.
    assert _result(tis["done"]) == [1, 3]


async def test_taskflow_sensor_and_bash_tasks_map_too(store: Store) -> None:
    with DAG(dag_id="map_kinds") as dag:

        @task.bash
        def say(word: str) -> str:
            return f"echo said-{word}"

        @task.sensor(poke_interval=0.05, timeout=30, mode="reschedule")
        def ready(n: int) -> Any:
            from engine import PokeReturnValue

            return PokeReturnValue(True, n * 10)

        say.expand(word=["a", "b"])
        ready.expand(n=[1, 2, 3])
    tis = await _run(store, dag)
    assert [_result(t) for t in _mapped(tis, "say")] == ["said-a", "said-b"]
    assert [_result(t) for t in _mapped(tis, "ready")] == [10, 20, 30]


async def test_a_retried_mapped_instance_keeps_its_own_arguments(store: Store) -> None:
    def flaky(x: int, ti: Any) -> list[int]:
        if ti.try_number == 1 and x == 20:
            raise RuntimeError("first try fails")
        return [x, ti.map_index, ti.try_number]

    with DAG(dag_id="map_retry") as dag:

        @task
        def values() -> list[list[int]]:
            return [[10], [20], [30]]

        PythonOperator.partial(
            task_id="flaky", python_callable=flaky, retries=1, retry_delay=0
        ).expand(op_args=values())
    tis = await _run(store, dag)
    got = [_result(t) for t in _mapped(tis, "flaky")]
    assert got == [[10, 0, 1], [20, 1, 2], [30, 2, 1]]


class _DefersThenResumes(BaseOperator):
    """Defers on a timer; resumes with its own argument."""

    def __init__(self, *, label: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.label = label

    def execute(self, context: Context) -> None:
        self.defer(trigger=TimeDeltaTrigger(dt.timedelta(0)), method_name="resume")

    def resume(self, context: Context, event: Any = None) -> list[Any]:
        return [self.label, context["ti"].map_index]


async def test_mapped_deferrable_operators_resume_with_their_own_arguments(
    store: Store,
) -> None:
    with DAG(dag_id="map_resume") as dag:

        @task
        def labels() -> list[str]:
            return ["x", "y", "z"]

        _DefersThenResumes.partial(task_id="wait").expand(label=labels())
    tis = await _run(store, dag, slots=1)
    assert [_result(t) for t in _mapped(tis, "wait")] == [["x", 0], ["y", 1], ["z", 2]]
    lines = [
        line.message for line in (await store.task_logs("map_resume", "run1", "wait[1]")).lines
    ]
    assert any(line.startswith("resuming at resume") for line in lines), lines


async def test_values_from_upstream_are_not_templates_but_literal_ones_are(store: Store) -> None:
    with DAG(dag_id="map_templates") as dag:

        @task
        def texts() -> list[str]:
            return ["{{ run_id }} from upstream"]

        @task
        def echo(text: str, note: str) -> list[str]:
            return [text, note]

        echo.partial(note="{{ run_id }} fixed").expand(text=texts())
        echo.expand(text=["{{ run_id }} literal"], note=["n"])

        @task
        def arg_lists() -> list[list[str]]:
            return [["{{ run_id }} as op_args"]]

        PythonOperator.partial(task_id="classic", python_callable=lambda s: s).expand(
            op_args=arg_lists()
        )
    tis = await _run(store, dag)
    assert _result(tis["echo[0]"]) == ["{{ run_id }} from upstream", "run1 fixed"]
    assert _result(tis["echo__1[0]"]) == ["run1 literal", "n"]
    assert _result(tis["classic[0]"]) == "{{ run_id }} as op_args"


async def test_a_mapped_instance_cleared_or_marked_says_so_in_its_own_log(store: Store) -> None:
    # The clear's and the mark's log line, audit and archived try are under TASK[i], the name
    # a mapped instance's lines are read by (not the bare task id, which no address reaches).
    def double(x: int) -> int:
        return x * 2

    with DAG(dag_id="map_override") as dag:
        PythonOperator.partial(task_id="double", python_callable=double).expand(
            op_kwargs=[{"x": 1}, {"x": 2}]
        )
    tis = await _run(store, dag)
    first, second = _mapped(tis, "double")
    assert await store.clear_task(second["id"], who="ops", via="the command line")
    assert await store.mark_task(first["id"], "failed", who="ops", via="the command line")

    cleared = await store.task_logs("map_override", "run1", "double[1]", try_number=1)
    assert any(line.message.startswith("cleared by ops") for line in cleared.lines)
    marked = await store.task_logs("map_override", "run1", "double[0]", try_number=1)
    assert any(line.message.startswith("marked failed by ops") for line in marked.lines)
    bare = await store.task_logs("map_override", "run1", "double", try_number=1)
    assert not any("by ops" in line.message for line in bare.lines)


#: What the upstream of test_a_cleared_mapped_instance_reads_its_values_again returns.
VALUES = {"now": [1, 2]}


async def test_a_cleared_mapped_instance_reads_its_values_again(store: Store) -> None:
    # A clear of the upstream and its downstream reruns the mapped instances on the values
    # the upstream returns now, not on those their expansion read.
    def numbers() -> list[list[int]]:
        return [[x] for x in VALUES["now"]]

    def double(x: int) -> int:
        return x * 2

    with DAG(dag_id="map_clear") as dag:
        up = PythonOperator(task_id="numbers", python_callable=numbers)
        PythonOperator.partial(task_id="double", python_callable=double).expand(op_args=up.output)
    VALUES["now"] = [1, 2]
    tis = await _run(store, dag)
    assert [_result(ti) for ti in _mapped(tis, "double")] == [2, 4]

    VALUES["now"] = [10, 20]
    targets = await store.override_targets("map_clear", "run1", ["numbers"], downstream=True)
    assert await store.clear_tasks([t.id for t in targets], who="ops", via="the command line")
    async with run_engine(store, dags=[dag]) as engine:
        tis = await engine.finish("map_clear", "run1")
    assert [_result(ti) for ti in _mapped(tis, "double")] == [20, 40]


@pytest.mark.parametrize(("before", "now"), [([1, 2], [10, 20, 30]), ([1, 2, 3], [5])])
async def test_a_mapped_task_cleared_whole_is_expanded_again(
    store: Store, before: list[int], now: list[int]
) -> None:
    # Its upstream's list changed length: the task cleared whole (every instance) expands
    # anew over the values its upstream returns now, as many instances as there are values.
    def numbers() -> list[list[int]]:
        return [[x] for x in VALUES["now"]]

    def double(x: int) -> int:
        return x * 2

    dag_id = f"map_reclear_{len(before)}_{len(now)}"
    with DAG(dag_id=dag_id) as dag:
        up = PythonOperator(task_id="numbers", python_callable=numbers)
        PythonOperator.partial(task_id="double", python_callable=double).expand(op_args=up.output)
    VALUES["now"] = before
    tis = await _run(store, dag)
    assert [_result(ti) for ti in _mapped(tis, "double")] == [2 * x for x in before]
    tried = max(ti["try_number"] for ti in _mapped(tis, "double"))

    VALUES["now"] = now
    targets = await store.override_targets(dag_id, "run1", ["numbers"], downstream=True)
    assert await store.clear_tasks([t.id for t in targets], who="ops", via="the command line")
    async with run_engine(store, dags=[dag]) as engine:
        tis = await engine.finish(dag_id, "run1")
    assert tis["__run__"]["state"] == "success"
    assert [_result(ti) for ti in _mapped(tis, "double")] == [2 * x for x in now]
    # Every instance's new try numbers on from the tries made before (none is reused).
    assert all(ti["try_number"] > tried for ti in _mapped(tis, "double"))


async def test_instance_0_claimed_before_the_expanding_try_has_ended_runs(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Instance 0 is the expanded row itself (its id) with its try number given back: claimed
    # again before the worker had let go of the expanding try, the claim was taken for that
    # try found again and dropped, and the run never ended (seen under load as a 30 s
    # timeout with "double[0] running (try 1)"). Here the expanding try waits for that claim.
    with DAG(dag_id="map_quick_claim") as dag:
        up = PythonOperator(task_id="numbers", python_callable=lambda: [[1], [2]])
        PythonOperator.partial(task_id="double", python_callable=lambda x: x * 2).expand(
            op_args=up.output
        )
    # While its expansion is written, the expanding try is still one of the worker's running
    # tries (its heartbeat, a stop and the graceful stop's wait cover it).
    held_while_writing: list[bool] = []
    async with run_engine(store) as engine:
        record = engine.worker.recorder.record

        async def record_then_see_instance_0_claimed(
            ti: Any, worker_id: int, outcome: Any, *, started: float
        ) -> None:
            if isinstance(outcome, Expanded):
                held_while_writing.append(engine.worker.running.get(ti.id) is ti)
            await record(ti, worker_id, outcome, started=started)
            if isinstance(outcome, Expanded):

                async def claimed() -> bool:
                    tis = await engine.task_instances("map_quick_claim")
                    return bool(tis["double[0]"]["state"] != "scheduled")

                await wait_until(claimed, what="instance 0 to be claimed")

        monkeypatch.setattr(engine.worker.recorder, "record", record_then_see_instance_0_claimed)
        await engine.start_run(dag)
        tis = await engine.finish("map_quick_claim")
    assert [_result(ti) for ti in _mapped(tis, "double")] == [2, 4]
    assert held_while_writing == [True]


async def test_a_run_not_ended_in_time_is_reported_with_its_task_instances(
    store: Store, tmp_path: Path
) -> None:
    # The harness's timeout says where each task instance was (a run of the test above
    # once timed out under load saying only "waiting for run ... to end").
    with DAG(dag_id="map_stuck") as dag:
        up = PythonOperator(
            task_id="files", python_callable=lambda: [str(tmp_path / "a"), str(tmp_path / "b")]
        )
        FileSensor.partial(task_id="wait", deferrable=True).expand(filepath=up.output)
    async with run_engine(store, triggerer=False) as engine:
        await engine.start_run(dag)
        await engine.wait_for_state("map_stuck", "wait[0]", "deferred")
        await engine.wait_for_state("map_stuck", "wait[1]", "deferred")
        with pytest.raises(EngineTimeout) as raised:
            await engine.finish("map_stuck", timeout_s=0.1)
    assert str(raised.value).endswith(
        "waiting for run map_stuck/run1 to end (it is running; its task instances: "
        "files success (try 1), wait[0] deferred (try 1), wait[1] deferred (try 1))"
    )


async def test_a_mapped_task_cleared_whole_keeps_the_callbacks_not_run_yet(
    store: Store, db_url: str
) -> None:
    # Callback requests not run yet that name instances [1..] (a task's failure, the DAG's
    # failure naming its last failed instance) stay when the task is cleared whole: they
    # name the one instance it folds back into.
    def numbers() -> list[list[int]]:
        return [[1], [2], [3]]

    with DAG(dag_id="map_reclear_cb") as dag:
        up = PythonOperator(task_id="numbers", python_callable=numbers)
        PythonOperator.partial(task_id="double", python_callable=lambda x: x).expand(
            op_args=up.output
        )
    tis = await _run(store, dag)
    instances = _mapped(tis, "double")
    assert len(instances) == 3
    ids = {ti["map_index"]: ti["id"] for ti in instances}
    run = tis["__run__"]
    conn = await asyncpg.connect(db_url)
    try:
        run_pk = await conn.fetchval(
            "SELECT dag_run_id FROM deferral_task_instances WHERE id = $1", ids[2]
        )
        await conn.execute(
            "INSERT INTO deferral_callback_requests (kind, dag_run_id, dag_id, ti_id, try_number)"
            " VALUES ('failure', $1, 'map_reclear_cb', $2, 1),"
            " ('dag_failure', $1, 'map_reclear_cb', $3, 1)",
            run_pk,
            ids[1],
            ids[2],
        )
    finally:
        await conn.close()
    assert run["state"] == "success"
    targets = await store.override_targets("map_reclear_cb", "run1", ["double"])
    assert {t.id for t in targets} == set(ids.values())
    assert await store.clear_tasks([t.id for t in targets], who="ops", via="the command line")
    left = await store.list_callback_requests()
    assert sorted(r.kind for r in left) == ["dag_failure", "failure"]
    assert {r.ti_id for r in left} == {ids[0]}
