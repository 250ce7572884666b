"""Branching on a real engine: BranchPythonOperator and @task.branch (a task id, a list, None),
skip propagation and a join, a branch that defers, ShortCircuitOperator and
@task.short_circuit with ignore_downstream_trigger_rules True and False."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from engine import DAG, task
from engine.dags.dagbag import DagBag
from engine.store import Store, TaskOutcome
from engine.testing import run_engine
from operators.base import Context
from operators.branch import BaseBranchOperator
from operators.python import BranchPythonOperator, PythonOperator, ShortCircuitOperator
from triggers.base import decode_value
from triggers.temporal import TimeDeltaTrigger

pytestmark = pytest.mark.anyio

LOGICAL = dt.datetime(2026, 12, 1, 6, 0, tzinfo=dt.UTC)


async def _run(store: Store, dag: DAG) -> dict[str, Any]:
    async with run_engine(store) as engine:
        await engine.start_run(dag, logical_date=LOGICAL)
        return await engine.finish(dag.dag_id)


def _states(tis: dict[str, Any]) -> dict[str, str]:
    return {task_id: ti["state"] for task_id, ti in tis.items() if task_id != "__run__"}


def _result(ti: dict[str, Any]) -> Any:
    return decode_value(ti["result"]) if ti["result"] is not None else None


def _noop(**_: Any) -> None:
    return None


def _branch_dag(dag_id: str, choice: Any) -> DAG:
    """branch -> a -> a2 -> join, branch -> b -> join, branch -> c; join follows one success."""
    with DAG(dag_id=dag_id) as dag:
        branch = BranchPythonOperator(task_id="branch", python_callable=lambda: choice)
        a = PythonOperator(task_id="a", python_callable=_noop)
        a2 = PythonOperator(task_id="a2", python_callable=_noop)
        b = PythonOperator(task_id="b", python_callable=_noop)
        c = PythonOperator(task_id="c", python_callable=_noop)
        join = PythonOperator(
            task_id="join", python_callable=_noop, trigger_rule="none_failed_min_one_success"
        )
        strict = PythonOperator(task_id="strict", python_callable=_noop)
        branch >> [a, b, c]
        a >> a2 >> join
        b >> join
        [a2, b] >> strict
    return dag


async def test_a_branch_skips_the_others_and_the_join_runs(store: Store) -> None:
    tis = await _run(store, _branch_dag("br_one", "a"))
    assert _states(tis) == {
        "branch": "success",
        "a": "success",
        "a2": "success",
        "b": "skipped",
        "c": "skipped",
        "join": "success",  # none_failed_min_one_success: one path ran
        "strict": "skipped",  # all_success: a skipped upstream skips it
    }
    assert _result(tis["branch"]) == "a"


async def test_a_branch_may_follow_a_list_or_none(store: Store) -> None:
    tis = await _run(store, _branch_dag("br_list", ["a", "b"]))
    states = _states(tis)
    assert (states["a"], states["b"], states["c"]) == ("success", "success", "skipped")
    assert (states["join"], states["strict"]) == ("success", "success")
    assert _result(tis["branch"]) == ["a", "b"]

    tis = await _run(store, _branch_dag("br_none", None))
    assert _states(tis) == {
        "branch": "success",
        "a": "skipped",
        "a2": "skipped",
        "b": "skipped",
        "c": "skipped",
        "join": "skipped",  # no upstream succeeded
        "strict": "skipped",
    }


async def test_a_branch_that_points_at_the_join_directly_keeps_it(store: Store) -> None:
    with DAG(dag_id="br_direct") as dag:
        branch = BranchPythonOperator(task_id="branch", python_callable=lambda: "task1")
        task1 = PythonOperator(task_id="task1", python_callable=_noop)
        join = PythonOperator(
            task_id="join", python_callable=_noop, trigger_rule="none_failed_min_one_success"
        )
        branch >> task1 >> join
        branch >> join
    tis = await _run(store, dag)
    assert _states(tis) == {"branch": "success", "task1": "success", "join": "success"}


async def test_a_bad_choice_fails_the_branch_saying_why(store: Store) -> None:
    tis = await _run(store, _branch_dag("br_bad", "nope"))
    assert tis["branch"]["state"] == "failed"
    assert "'nope', which is not a task of this DAG" in tis["branch"]["error"]
    assert {tis[t]["state"] for t in ("a", "b", "c")} == {"upstream_failed"}

    tis = await _run(store, _branch_dag("br_type", 3))
    assert tis["branch"]["state"] == "failed"
    assert "must return a task id, a list of task ids or None, got int" in tis["branch"]["error"]


async def test_task_branch_decorator(store: Store) -> None:
    @task.branch
    def pick(n: int) -> str:
        return "big" if n > 10 else "small"

    @task
    def number() -> int:
        return 42

    @task
    def big() -> str:
        return "B"

    @task
    def small() -> str:
        return "S"

    with DAG(dag_id="br_taskflow") as dag:
        chosen = pick(number())
        chosen >> [big(), small()]
    tis = await _run(store, dag)
    assert _states(tis) == {
        "number": "success",
        "pick": "success",
        "big": "success",
        "small": "skipped",
    }
    assert _result(tis["pick"]) == "big"


class JobBranch(BaseBranchOperator):
    """Starts a job, defers until it is done, and follows the branch its result names."""

    def choose_branch(self, context: Context) -> Any:
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(seconds=0)),
            method_name="job_done",
            kwargs={"outcome": "good"},
        )

    def job_done(self, context: Context, event: Any = None, outcome: str = "") -> Any:
        return "on_good" if outcome == "good" else ["on_bad"]


class AsyncJobBranch(JobBranch):
    async def job_done(  # type: ignore[override]
        self, context: Context, event: Any = None, outcome: str = ""
    ) -> Any:
        return ["on_bad"]


@pytest.mark.parametrize(("cls", "followed"), [(JobBranch, "on_good"), (AsyncJobBranch, "on_bad")])
async def test_a_branch_may_defer_and_follow_what_its_resumed_method_returns(
    store: Store, cls: type[JobBranch], followed: str
) -> None:
    with DAG(dag_id=f"br_defer_{cls.__name__.lower()}") as dag:
        branch = cls(task_id="branch")
        branch >> [
            PythonOperator(task_id="on_good", python_callable=_noop),
            PythonOperator(task_id="on_bad", python_callable=_noop),
        ]
    async with run_engine(store) as engine:
        await engine.start_run(dag, logical_date=LOGICAL)
        tis = await engine.finish(dag.dag_id)
        rows = await store.list_task_instances(dag_id=dag.dag_id)
    assert _states(tis) == {
        "branch": "success",
        "on_good": "success" if followed == "on_good" else "skipped",
        "on_bad": "success" if followed == "on_bad" else "skipped",
    }
    branch_row = next(r for r in rows if r.task_id == "branch")
    assert branch_row.try_number == 1  # it deferred and resumed within one try


def _circuit_dag(dag_id: str, condition: Any, ignore: bool) -> DAG:
    """check -> direct -> after; other -> after (all_done); check -> direct -> lonely."""
    with DAG(dag_id=dag_id) as dag:
        check = ShortCircuitOperator(
            task_id="check",
            python_callable=lambda: condition,
            ignore_downstream_trigger_rules=ignore,
        )
        direct = PythonOperator(task_id="direct", python_callable=_noop)
        other = PythonOperator(task_id="other", python_callable=_noop)
        after = PythonOperator(task_id="after", python_callable=_noop, trigger_rule="all_done")
        lonely = PythonOperator(task_id="lonely", python_callable=_noop)
        check >> direct >> [after, lonely]
        other >> after
    return dag


async def test_short_circuit_ignoring_downstream_trigger_rules_skips_everything(
    store: Store,
) -> None:
    tis = await _run(store, _circuit_dag("sc_ignore", [], ignore=True))
    assert _states(tis) == {
        "check": "success",
        "direct": "skipped",
        "other": "success",
        "after": "skipped",  # skipped whatever its rule says
        "lonely": "skipped",
    }
    assert _result(tis["check"]) == []


async def test_short_circuit_respecting_trigger_rules_skips_the_direct_tasks_only(
    store: Store,
) -> None:
    tis = await _run(store, _circuit_dag("sc_rules", 0, ignore=False))
    assert _states(tis) == {
        "check": "success",
        "direct": "skipped",
        "other": "success",
        "after": "success",  # all_done: its upstreams are done
        "lonely": "skipped",  # all_success: its upstream was skipped
    }


async def test_a_true_condition_runs_everything(store: Store) -> None:
    tis = await _run(store, _circuit_dag("sc_true", {"ok": 1}, ignore=True))
    assert set(_states(tis).values()) == {"success"}
    assert _result(tis["check"]) == {"ok": 1}


@pytest.mark.parametrize("ignore", [True, False])
async def test_task_short_circuit_decorator(store: Store, ignore: bool) -> None:
    @task.short_circuit(ignore_downstream_trigger_rules=ignore)
    def enough(rows: int) -> bool:
        return rows > 100

    @task
    def count() -> int:
        return 7

    @task
    def load() -> None:
        return None

    @task(trigger_rule="all_done")
    def report() -> None:
        return None

    with DAG(dag_id=f"sc_taskflow_{ignore}") as dag:
        enough(count()) >> load() >> report()
    tis = await _run(store, dag)
    assert _states(tis) == {
        "count": "success",
        "enough": "success",
        "load": "skipped",
        "report": "skipped" if ignore else "success",
    }
    assert _result(tis["enough"]) is False


_ISOLATED_DAG = """
from engine import DAG
from operators.python import BranchPythonOperator, PythonOperator


def pick():
    return "b"


def noop():
    return None


with DAG(dag_id="br_isolated") as dag:
    branch = BranchPythonOperator(task_id="branch", python_callable=pick, isolation="process")
    branch >> [
        PythonOperator(task_id="a", python_callable=noop),
        PythonOperator(task_id="b", python_callable=noop),
    ]
"""


async def test_a_branch_in_a_child_process_skips_the_same_way(store: Store, tmp_path: Path) -> None:
    """With isolation='process' the choice crosses the child's pipe with the outcome."""
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "isolated_branch.py").write_text(_ISOLATED_DAG)
    dagbag = DagBag(dags)
    assert not dagbag.import_errors, dagbag.import_errors
    dag = dagbag.get_dag("br_isolated")
    async with run_engine(store, dagbag=dagbag) as engine:
        await engine.start_run(dag, logical_date=LOGICAL)
        tis = await engine.finish(dag.dag_id)
    assert _states(tis) == {"branch": "success", "a": "skipped", "b": "success"}
    assert _result(tis["branch"]) == "b"


async def test_the_skip_is_fenced_by_the_worker_and_the_try(store: Store) -> None:
    """Only the worker holding the branch's try skips, with its success, and only pending
    tasks of its run: a late write of a reaped try (another worker, another try) moves
    nothing."""
    with DAG(dag_id="br_fenced") as dag:
        branch = BranchPythonOperator(task_id="branch", python_callable=_pick_b)
        branch >> [
            PythonOperator(task_id="a", python_callable=_noop),
            PythonOperator(task_id="b", python_callable=_noop),
        ]
    await store.upsert_dag(dag.dag_id, "br_fenced.py", dag.serialize_tasks(), None)
    await store.create_dag_run(dag.dag_id, "r1", logical_date=await store.now())
    worker = await store.register_worker("test", 1, 4)
    other = await store.register_worker("test", 2, 4)
    (ti,) = [t for t in (await store.claim_tasks(worker, 100)).claimed if t.dag_id == "br_fenced"]
    assert ti.task_id == "branch"

    def success(worker_id: int, try_number: int, skip: tuple[str, ...]) -> TaskOutcome:
        return TaskOutcome(
            ti_id=ti.id, worker_id=worker_id, try_number=try_number, kind="success", skip=skip
        )

    assert await store.finish_tasks([success(other, ti.try_number, ("a",))]) == []
    assert await store.finish_tasks([success(worker, ti.try_number + 1, ("a",))]) == []
    moved = await store.finish_tasks([success(worker, ti.try_number, ("a", "branch", "nope"))])
    # The branch's success and the skip, in one statement; the branch itself is not skipped.
    assert [(m.task_id, m.state, m.worker_id) for m in moved] == [
        ("branch", "success", worker),
        ("a", "skipped", None),
    ]
    assert await store.finish_tasks([success(worker, ti.try_number, ("b",))]) == []
    states = {t.task_id: t.state for t in await store.list_task_instances(dag_id="br_fenced")}
    assert states == {"branch": "success", "a": "skipped", "b": "pending"}


def _pick_b() -> str:
    return "b"


def _follow(choice: str) -> str:
    return choice


async def test_a_mapped_branch_skips_with_each_instance_success(store: Store) -> None:
    """Each instance of a mapped branch writes its skips with its own success: what no instance
    follows is skipped by the first one to succeed, and the followed task runs after all."""
    with DAG(dag_id="br_mapped") as dag:
        branch = BranchPythonOperator.partial(task_id="branch", python_callable=_follow).expand(
            op_args=[["a"], ["a"]]
        )
        branch >> [
            PythonOperator(task_id="a", python_callable=_noop),
            PythonOperator(task_id="b", python_callable=_noop),
        ]
    tis = await _run(store, dag)
    assert _states(tis) == {
        "branch[0]": "success",
        "branch[1]": "success",
        "a": "success",
        "b": "skipped",
    }
