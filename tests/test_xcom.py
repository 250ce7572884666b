"""XCom on a real engine: return values and pushes pulled within a run, across runs and DAGs,
lists of task ids in order, missing values, values of the types JSON lacks, encode errors and
the size limit (nothing written), encryption at rest, templates that pull, a new try without
the previous try's pushes."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import uuid
from typing import Any

import anyio
import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner

from engine import DAG
from engine.cli import cli
from engine.security.keys import Keyring, generate_key
from engine.store import Store
from engine.testing import run_engine
from engine.web.app import make_app
from operators.base import BaseOperator, Context
from operators.bash import BashOperator
from operators.python import PythonOperator
from tests.conftest import TEST_FERNET_KEY
from triggers.base import decode_value
from triggers.temporal import TimeDeltaTrigger
from triggers.values import encode_data

pytestmark = pytest.mark.anyio


def _result(ti: dict[str, Any]) -> Any:
    assert ti["state"] == "success", ti
    return decode_value(ti["result"]) if ti["result"] is not None else None


async def _run(store: Store, dag: DAG, run_id: str = "run1", **kwargs: Any) -> dict[str, Any]:
    async with run_engine(store, **kwargs) as engine:
        await engine.start_run(dag, run_id)
        return await engine.finish(dag.dag_id, run_id)


async def test_a_return_value_and_pushes_are_pulled_downstream(store: Store) -> None:
    def produce(ti: Any) -> int:
        ti.xcom_push("extra", {"rows": [1, 2, 3]})
        ti.xcom_push(key="note", value="hello")
        return 42

    def consume(ti: Any) -> list[Any]:
        return [
            ti.xcom_pull(task_ids="produce"),
            ti.xcom_pull(task_ids="produce", key="extra"),
            ti.xcom_pull("produce", "note"),
            ti.xcom_pull(task_ids="produce", key="missing"),
            ti.xcom_pull(task_ids="produce", key="missing", default="dflt"),
            ti.xcom_pull(task_ids="nobody", default=7),
        ]

    with DAG(dag_id="xc_basic") as dag:
        PythonOperator(task_id="produce", python_callable=produce) >> PythonOperator(
            task_id="consume", python_callable=consume
        )
    tis = await _run(store, dag)
    assert _result(tis["consume"]) == [42, {"rows": [1, 2, 3]}, "hello", None, "dflt", 7]


async def test_a_list_of_task_ids_gives_a_list_in_that_order(store: Store) -> None:
    with DAG(dag_id="xc_list") as dag:
        a = PythonOperator(task_id="a", python_callable=lambda: "A")
        b = PythonOperator(task_id="b", python_callable=lambda: "B")
        none = PythonOperator(task_id="none", python_callable=lambda: None)
        pull = PythonOperator(
            task_id="pull",
            python_callable=lambda ti: [
                ti.xcom_pull(task_ids=["b", "a"]),
                ti.xcom_pull(task_ids=["none", "a", "b"]),
                ti.xcom_pull(task_ids=[]),
            ],
        )
        [a, b, none] >> pull
    tis = await _run(store, dag)
    # (A task without the XCom is left out, as Airflow does.)
    assert _result(tis["pull"]) == [["B", "A"], ["A", "B"], []]


async def test_values_pull_across_runs_and_dags(store: Store) -> None:
    with DAG(dag_id="xc_source") as source:
        PythonOperator(task_id="make", python_callable=lambda run_id: f"made in {run_id}")
    with DAG(dag_id="xc_reader") as reader:
        PythonOperator(
            task_id="read",
            python_callable=lambda ti: [
                ti.xcom_pull(task_ids="make", dag_id="xc_source", run_id="first"),
                ti.xcom_pull(task_ids="make", dag_id="xc_source", run_id="second"),
                ti.xcom_pull(task_ids="make", dag_id="xc_source", run_id="nope", default=0),
            ],
        )
    await _run(store, source, "first")
    await _run(store, source, "second")
    tis = await _run(store, reader, "r")
    assert _result(tis["read"]) == ["made in first", "made in second", 0]


async def test_values_keep_their_types(store: Store) -> None:
    value = {
        "when": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
        "naive": dt.datetime(2026, 1, 2, 3, 4, 5),
        "day": dt.date(2026, 1, 2),
        "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "amount": decimal.Decimal("10.25"),
        "raw": b"\x00\x01",
        "span": dt.timedelta(days=1, seconds=2, microseconds=3),
        "at": dt.time(4, 5, 6),
        "nested": [1, 2.5, None, True, "s", (1, 2)],
    }
    with DAG(dag_id="xc_types") as dag:
        PythonOperator(task_id="give", python_callable=lambda: value) >> PythonOperator(
            task_id="take", python_callable=lambda ti: ti.xcom_pull(task_ids="give")
        )
    tis = await _run(store, dag)
    got = _result(tis["take"])
    assert got == {**value, "nested": [1, 2.5, None, True, "s", [1, 2]]}
    assert type(got["day"]) is dt.date
    assert type(got["amount"]) is decimal.Decimal


@pytest.mark.parametrize(
    ("how", "bad", "says"),
    [
        ("return", object(), "cannot be stored as its value: the value is a builtins.object"),
        ("push", {1: "x"}, "keys must be str"),
        ("return", {"f": len}, "the value['f'] is a builtins.builtin_function_or_method"),
        ("return", {"a": [1, {"b": {2}}]}, "the value['a'][1]['b'] is a builtins.set"),
        ("push", "x" * 3000, "over the limit of 2000 bytes (setting xcom_max_bytes)"),
        ("return", b"y" * 3000, "over the limit of 2000 bytes (setting xcom_max_bytes)"),
    ],
)
async def test_a_value_that_cannot_be_stored_fails_the_task_and_nothing_is_written(
    store: Store, how: str, bad: Any, says: str
) -> None:
    def task(ti: Any) -> Any:
        ti.xcom_push("good", 1)
        if how == "push":
            ti.xcom_push("bad", bad)
            return "never"
        return bad

    with DAG(dag_id="xc_bad") as dag:
        PythonOperator(task_id="bad_task", python_callable=task, retries=0)
    tis = await _run(store, dag, worker_options={"xcom_max_bytes": 2000})
    ti = tis["bad_task"]
    assert ti["state"] == "failed"
    key = "'bad'" if how == "push" else "'return_value'"
    assert f"task xc_bad.bad_task: XCom {key}" in ti["error"]
    assert says in ti["error"]
    assert ti["result"] is None
    assert await store.xcom_of_task("xc_bad", "run1", "bad_task") == {}


async def test_values_are_encrypted_at_rest(store: Store) -> None:
    # (The store of the tests has a key: values are sealed as in production.)
    def task(ti: Any) -> str:
        ti.xcom_push("secretish", "plain-text-marker")
        return "another-marker"

    with DAG(dag_id="xc_enc") as dag:
        PythonOperator(task_id="t", python_callable=task)
    await _run(store, dag)
    async with store._pool.acquire() as conn:
        raw = await conn.fetchval("SELECT value FROM deferral_xcom WHERE key = 'secretish'")
        result = await conn.fetchval(
            "SELECT result FROM deferral_task_instances WHERE task_id = 't'"
        )
    assert b"plain-text-marker" not in raw
    assert raw != encode_data("plain-text-marker")
    assert b"another-marker" not in result
    stored = await store.xcom_of_task("xc_enc", "run1", "t")
    assert stored is not None
    assert {k: decode_value(v) for k, v in stored.items()} == {
        "secretish": "plain-text-marker",
        "return_value": "another-marker",
    }


async def test_templates_pull_with_ti(store: Store) -> None:
    with DAG(dag_id="xc_tmpl") as dag:
        total = PythonOperator(task_id="total", python_callable=lambda: 17)
        echo = BashOperator(
            task_id="echo",
            bash_command="echo total={{ ti.xcom_pull(task_ids='total') }} "
            "missing={{ ti.xcom_pull(task_ids='x', default='none') }}",
        )
        total >> echo
    tis = await _run(store, dag)
    assert _result(tis["echo"]) == "total=17 missing=none"


class _PushThenFailOnce(BaseOperator):
    def execute(self, context: Context) -> Any:
        ti = context["ti"]
        seen = ti.xcom_pull(task_ids=self.task_id, key="mine")
        ti.xcom_push("mine", context["try_number"])
        if context["try_number"] == 1:
            # (Pushes of a failing call are not written; a deferral writes them, see below.)
            raise RuntimeError("first try fails")
        return seen


async def test_a_new_try_does_not_see_the_previous_tries_pushes(store: Store) -> None:
    with DAG(dag_id="xc_retry") as dag:
        _PushThenFailOnce(task_id="again", retries=1, retry_delay=0)
    tis = await _run(store, dag)
    assert tis["again"]["try_number"] == 2
    assert _result(tis["again"]) is None  # try 2 saw nothing of try 1
    stored = await store.xcom_of_task("xc_retry", "run1", "again")
    assert stored is not None
    assert decode_value(stored["mine"]) == 2


class _PushDeferReturn(BaseOperator):
    """Pushes before deferring; the resumed method returns the value handed downstream."""

    def execute(self, context: Context) -> None:
        context["ti"].xcom_push("submitted", {"job": "j-1"})
        self.defer(trigger=TimeDeltaTrigger(0), method_name="done", kwargs={"job_id": "j-1"})

    def done(self, context: Context, event: Any = None, job_id: str = "") -> str:
        return job_id


class _AsyncPull(BaseOperator):
    async def execute(self, context: Context) -> Any:
        ti = context["ti"]
        try:
            ti.xcom_pull(task_ids="wait")
        except RuntimeError as exc:
            refused = str(exc)
        return [await ti.xcom_pull_async(task_ids="wait"), "xcom_pull_async" in refused]


async def test_a_resumed_method_returns_the_value_and_pushes_survive_the_deferral(
    store: Store,
) -> None:
    with DAG(dag_id="xc_defer") as dag:
        wait = _PushDeferReturn(task_id="wait")
        use = PythonOperator(
            task_id="use",
            python_callable=lambda ti: [
                ti.xcom_pull(task_ids="wait"),
                ti.xcom_pull(task_ids="wait", key="submitted"),
            ],
        )
        wait >> use >> _AsyncPull(task_id="async_pull")
    tis = await _run(store, dag)
    assert _result(tis["wait"]) == "j-1"
    assert _result(tis["use"]) == ["j-1", {"job": "j-1"}]
    assert _result(tis["async_pull"]) == ["j-1", True]


async def test_cli_lists_and_prints_xcoms(store: Store, db_url: str) -> None:
    def produce(ti: Any) -> dict[str, Any]:
        ti.xcom_push("long", "z" * 500)
        ti.xcom_push("password", "hunter2")
        return {"n": 1}

    with DAG(dag_id="xc_cli") as dag:
        PythonOperator(task_id="produce", python_callable=produce)
        PythonOperator(task_id="quiet", python_callable=lambda: None)
    await _run(store, dag)
    env = {"DEFERRAL_DATABASE_URL": db_url}
    runner = CliRunner()

    def cli_run(*args: str) -> Any:
        return runner.invoke(cli, list(args), env=env)

    listed = await anyio.to_thread.run_sync(cli_run, "tasks", "list", "--dag", "xc_cli", "--json")
    assert listed.exit_code == 0, listed.output
    by_task = {t["task_id"]: t for t in json.loads(listed.stdout)}
    xcom = by_task["produce"]["xcom"]
    assert set(xcom) == {"return_value", "long", "password"}
    assert xcom["return_value"] == {"bytes": len(encode_data({"n": 1})), "preview": '{"n":1}'}
    assert xcom["long"]["bytes"] == len(encode_data("z" * 500))
    assert xcom["long"]["preview"].endswith("...")
    assert len(xcom["long"]["preview"]) == 80
    assert "hunter2" not in listed.stdout
    assert by_task["quiet"]["xcom"] == {}

    full = await anyio.to_thread.run_sync(cli_run, "tasks", "xcom", "xc_cli", "run1", "produce")
    assert full.exit_code == 0, full.output
    assert "z" * 500 in full.stdout
    assert "return_value:" in full.stdout
    assert "hunter2" not in full.stdout
    one = await anyio.to_thread.run_sync(
        cli_run, "tasks", "xcom", "xc_cli", "run1", "produce", "--key", "return_value", "--json"
    )
    assert json.loads(one.stdout) == {"n": 1}
    both = await anyio.to_thread.run_sync(
        cli_run, "tasks", "xcom", "xc_cli", "run1", "produce", "--json"
    )
    assert json.loads(both.stdout)["long"] == "z" * 500
    missing = await anyio.to_thread.run_sync(
        cli_run, "tasks", "xcom", "xc_cli", "run1", "produce", "--key", "nope"
    )
    assert missing.exit_code == 2
    assert "no XCom 'nope'" in missing.stderr
    assert "long, password, return_value" in missing.stderr
    nothing = await anyio.to_thread.run_sync(cli_run, "tasks", "xcom", "xc_cli", "run1", "nobody")
    assert nothing.exit_code == 2


async def test_the_status_page_task_view_shows_the_xcoms(store: Store) -> None:
    def produce(ti: Any) -> int:
        ti.xcom_push("rows", ["<b>bold</b>"])
        return 5

    with DAG(dag_id="xc_web") as dag:
        PythonOperator(task_id="produce", python_callable=produce)
    await _run(store, dag)
    async with TestClient(TestServer(make_app(store))) as client:
        response = await client.get("/task?dag_id=xc_web&run_id=run1&task_id=produce")
        text = await response.text()
    assert response.status == 200
    assert 'id="xcoms"' in text
    assert "<dt>rows</dt>" in text
    assert "&lt;b&gt;bold&lt;/b&gt;" in text
    assert 'id="result"' in text  # the return value: the result, shown as such


async def test_key_rotation_reencrypts_pushed_values(store: Store, db_url: str) -> None:
    def task(ti: Any) -> str:
        ti.xcom_push("a", [1, 2])
        ti.xcom_push("b", "two")
        return "r"

    with DAG(dag_id="xc_rotate") as dag:
        PythonOperator(task_id="t", python_callable=task)
    await _run(store, dag)
    new_key = generate_key()
    rotated = await Store.connect(db_url, pool_size=2, keyring=Keyring([new_key, TEST_FERNET_KEY]))
    try:
        counts = await rotated.rotate_keys(batch_size=1)
        # the result and the two pushed values
        assert counts == {"rewritten": 3, "current": 0, "changed": 0, "unreadable": 0}
    finally:
        await rotated.close()
    only_new = await Store.connect(db_url, pool_size=2, keyring=Keyring([new_key]))
    try:
        stored = await only_new.xcom_of_task("xc_rotate", "run1", "t")
    finally:
        await only_new.close()
    assert stored is not None
    assert {k: decode_value(v) for k, v in stored.items()} == {
        "a": [1, 2],
        "b": "two",
        "return_value": "r",
    }


async def test_a_push_that_cannot_be_stored_is_not_retried(store: Store) -> None:
    def task(ti: Any) -> None:
        ti.xcom_push("bad", {1, 2})

    with DAG(dag_id="xc_push_no_retry") as dag:
        PythonOperator(task_id="t", python_callable=task, retries=3, retry_delay=0)
    tis = await _run(store, dag)
    assert tis["t"]["state"] == "failed"
    assert tis["t"]["try_number"] == 1
    assert (
        "XComError: task xc_push_no_retry.t: XCom 'bad' cannot be stored as its value: the value "
        "is a builtins.set" in (tis["t"]["error"])
    )
