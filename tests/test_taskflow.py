"""TaskFlow on a real engine: @task with and without arguments, chains of references,
multiple_outputs, context parameters, get_current_context, duplicate task ids, references in
classic operators' templated fields and ``>>`` on references, @task.sensor in each mode,
@task.bash."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine import DAG, PokeReturnValue, get_current_context, task
from engine.store import Store
from engine.testing import run_engine
from operators.bash import BashOperator
from operators.python import PythonOperator
from operators.xcom import XComArg
from triggers.base import decode_value

pytestmark = pytest.mark.anyio

LOGICAL = dt.datetime(2026, 11, 29, 6, 30, tzinfo=dt.UTC)


def _result(ti: dict[str, Any]) -> Any:
    assert ti["state"] == "success", ti
    return decode_value(ti["result"]) if ti["result"] is not None else None


async def _run(store: Store, dag: DAG, **kwargs: Any) -> dict[str, Any]:
    async with run_engine(store, **kwargs) as engine:
        await engine.start_run(dag, logical_date=LOGICAL)
        return await engine.finish(dag.dag_id)


# -- declaring (no engine) ------------------------------------------------------------------


def test_a_call_adds_a_task_and_returns_a_reference() -> None:
    @task
    def extract() -> list[int]:
        return [1, 2, 3]

    @task(task_id="sum_it", retries=3, pool="p", queue="q", priority_weight=5)
    def total(values: list[int], factor: int = 1) -> int:
        return sum(values) * factor

    with DAG(dag_id="tf_decl") as dag:
        ref = extract()
        out = total(ref, factor=2)
    assert isinstance(ref, XComArg)
    assert set(dag.tasks) == {"extract", "sum_it"}
    op = dag.tasks["sum_it"]
    assert (op.retries, op.pool, op.queue, op.priority_weight) == (3, "p", "q", 5)
    assert op.upstream_task_ids == {"extract"}
    assert out.task_id == "sum_it"
    assert out.operator.output == out


def test_calling_twice_numbers_the_task_ids() -> None:
    @task
    def step(n: int) -> int:
        return n

    with DAG(dag_id="tf_dupes") as dag:
        a, b, c = step(1), step(2), step(3)
        d = step.override(task_id="other")(4)
    assert (a.task_id, b.task_id, c.task_id, d.task_id) == ("step", "step__1", "step__2", "other")
    assert set(dag.tasks) == {"step", "step__1", "step__2", "other"}


def test_references_take_shift_and_sit_in_classic_templated_fields() -> None:
    @task
    def make() -> str:
        return "x"

    with DAG(dag_id="tf_shift") as dag:
        first = make()
        second = make()
        echo = BashOperator(task_id="echo", bash_command="echo hi", env={"V": second})
        last = PythonOperator(task_id="last", python_callable=print, op_args=[echo.output])
        first >> second
        [first, second] >> PythonOperator(task_id="after", python_callable=print)
        last << first
    assert dag.tasks["make__1"].upstream_task_ids == {"make"}
    assert dag.tasks["echo"].upstream_task_ids == {"make__1"}
    assert dag.tasks["last"].upstream_task_ids == {"echo", "make"}
    assert dag.tasks["after"].upstream_task_ids == {"make", "make__1"}


def test_misuse_is_a_clear_error() -> None:
    @task
    def lone() -> None:
        return None

    with pytest.raises(RuntimeError, match=r"inside a `with DAG\(...\):` block"):
        lone()
    with pytest.raises(TypeError, match="async function"):

        @task
        async def nope() -> None:
            return None

    with DAG(dag_id="tf_iter"), pytest.raises(TypeError, match="cannot be iterated"):
        list(lone())
    with pytest.raises(RuntimeError, match="outside a running task"):
        get_current_context()


# -- running ----------------------------------------------------------------------------------


async def test_a_taskflow_chain_passes_values(store: Store) -> None:
    @task
    def extract() -> list[int]:
        return [1, 2, 3, 4]

    @task
    def double(values: list[int]) -> list[int]:
        return [v * 2 for v in values]

    @task
    def total(values: list[int], start: int, extra: list[int]) -> int:
        return start + sum(values) + sum(extra)

    with DAG(dag_id="tf_chain") as dag:
        raw = extract()
        total(double(raw), start=100, extra=raw)
    tis = await _run(store, dag)
    assert _result(tis["total"]) == 100 + 20 + 10


async def test_multiple_outputs_store_each_key(store: Store) -> None:
    @task(multiple_outputs=True)
    def split() -> Any:
        return {"name": "n", "size": 3}

    @task
    def annotated() -> dict[str, int]:  # a dict annotation means multiple_outputs
        return {"a": 1}

    @task
    def join(name: str, size: int, a: int, whole: dict[str, Any]) -> str:
        return f"{name}:{size}:{a}:{sorted(whole)}"

    with DAG(dag_id="tf_multi") as dag:
        parts = split()
        other = annotated()
        join(parts["name"], parts["size"], other["a"], parts)
    tis = await _run(store, dag)
    assert _result(tis["join"]) == "n:3:1:['name', 'size']"
    stored = await store.xcom_of_task("tf_multi", "run1", "split")
    assert stored is not None
    assert set(stored) == {"return_value", "name", "size"}


async def test_context_parameters_and_get_current_context(store: Store) -> None:
    @task
    def uses(ti: Any, ds: str, logical_date: dt.datetime, params: dict[str, Any]) -> list[Any]:
        ctx = get_current_context()
        return [ti.task_id, ds, logical_date, params, ctx["run_id"], ctx["ti"] is ti]

    @task
    def everything(**context: Any) -> list[Any]:
        return [context["task_id"], context["dag_run"].run_id]

    with DAG(dag_id="tf_ctx", params={"p": 1}) as dag:
        uses()
        everything()
    tis = await _run(store, dag)
    assert _result(tis["uses"]) == ["uses", "2026-11-29", LOGICAL, {"p": 1}, "run1", True]
    assert _result(tis["everything"]) == ["everything", "run1"]


async def test_references_in_classic_operators_resolve(store: Store) -> None:
    @task
    def word() -> str:
        return "{{ not rendered }}"

    with DAG(dag_id="tf_classic") as dag:
        w = word()
        echo = BashOperator(task_id="echo", bash_command='echo "$W"', env={"W": w})
        PythonOperator(
            task_id="last",
            python_callable=lambda a, b: [a, b],
            op_args=[echo.output, w],
        )
    tis = await _run(store, dag)
    assert _result(tis["echo"]) == "{{ not rendered }}"
    assert _result(tis["last"]) == ["{{ not rendered }}", "{{ not rendered }}"]


async def test_a_missing_value_is_none_and_a_missing_key_fails_saying_so(
    store: Store,
) -> None:
    @task
    def nothing() -> None:
        return None

    @task
    def needs(value: Any) -> Any:
        return ["got", value]

    with DAG(dag_id="tf_missing") as dag:
        none = nothing()
        needs(none)
        needs.override(task_id="needs_key")(none["k"])
    tis = await _run(store, dag)
    assert _result(tis["needs"]) == ["got", None]
    assert tis["needs_key"]["state"] == "failed"
    assert "no XCom 'k' of nothing" in tis["needs_key"]["error"]


@pytest.mark.parametrize("mode", ["poke", "reschedule"])
async def test_task_sensor_waits_and_returns_its_value(
    store: Store, tmp_path: Path, mode: str
) -> None:
    flag = tmp_path / "flag"

    @task.sensor(poke_interval=0.05, timeout=30, mode=mode)
    def wait_for_flag(path: str) -> PokeReturnValue:
        if not Path(path).exists():
            Path(path).write_text("seen once")  # true at the next check
            return PokeReturnValue(False)
        return PokeReturnValue(True, xcom_value=Path(path).read_text())

    @task.sensor(poke_interval=0.05, timeout=30, mode=mode)
    def plain(x: int) -> bool:
        return x > 0

    @task
    def after(value: str, ok: Any) -> list[Any]:
        return [value, ok]

    with DAG(dag_id=f"tf_sensor_{mode}") as dag:
        after(wait_for_flag(str(flag)), plain(1))
    tis = await _run(store, dag)
    # (A sensor done with True returns nothing: its reference gives None.)
    assert _result(tis["after"]) == ["seen once", None]


async def test_task_sensor_times_out_softly(store: Store) -> None:
    @task.sensor(poke_interval=0.05, timeout=0.2, mode="reschedule", soft_fail=True)
    def never() -> bool:
        return False

    with DAG(dag_id="tf_sensor_soft") as dag:
        never()
    tis = await _run(store, dag)
    assert tis["never"]["state"] == "skipped"


async def test_task_sensor_defers_with_an_async_check(store: Store, tmp_path: Path) -> None:
    flag = tmp_path / "flag"

    @task.sensor(
        poke_interval=0.05, timeout=30, deferrable=True, async_check="tests.test_taskflow.exists"
    )
    def file_there(path: str) -> bool:
        Path(path).touch()  # (true by the time the triggerer checks)
        return False

    with DAG(dag_id="tf_sensor_defer") as dag:
        file_there(path=str(flag))
    tis = await _run(store, dag)
    assert tis["file_there"]["state"] == "success"


async def exists(path: str) -> bool:
    """The async check of the deferrable sensor above (awaited on the triggerer)."""
    return await anyio.Path(path).exists()


async def test_task_bash_runs_the_returned_command(store: Store) -> None:
    @task
    def name() -> str:
        return "world"

    @task.bash(env={"GREETING": "hello"})
    def greet(who: str, ds: str) -> str:
        return f'echo "$GREETING {who} {ds}"'

    @task.bash
    def empty() -> str:
        return ""

    with DAG(dag_id="tf_bash") as dag:
        greet(name())
        empty()
    tis = await _run(store, dag)
    assert _result(tis["greet"]) == "hello world 2026-11-29"
    assert tis["empty"]["state"] == "failed"
    assert "must return the command" in tis["empty"]["error"]
