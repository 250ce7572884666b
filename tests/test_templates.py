"""Templates: every built-in operator's and sensor's ``template_fields`` rendered with Jinja2 on
the worker just before the task runs, on a real engine; undefined variables and missing template
files fail the task saying where; template files from the DAG folder and the search path; the
rendered values kept with the try and shown by ``deferral tasks list --json``."""

from __future__ import annotations

import datetime as dt
import json
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import pytest
from aiohttp import web
from click.testing import CliRunner

from engine import DAG
from engine.cli import cli
from engine.dags.dagbag import DagBag
from engine.store import ClaimedTask, Store
from engine.testing import run_engine
from engine.worker.templating import (
    TEMPLATE_VARIABLES,
    build_context,
    ds_add,
    ds_format,
    jsonable,
    prepare,
)
from operators.base import BaseOperator
from operators.bash import BashOperator
from operators.python import PythonOperator
from operators.sensors import ExternalTaskSensor, FileSensor, HttpSensor, SqlSensor
from tests.sensor_helpers import FAST, MODES, http_server
from triggers.base import decode_value
from triggers.temporal import TimeDeltaTrigger

pytestmark = pytest.mark.anyio

#: The logical date of the runs: 2026-11-29 06:30 UTC.
LOGICAL = dt.datetime(2026, 11, 29, 6, 30, tzinfo=dt.UTC)


def _result(ti: dict[str, Any]) -> Any:
    assert ti["state"] == "success", ti
    return decode_value(ti["result"]) if ti["result"] is not None else None


async def _run(store: Store, dag: DAG, **kwargs: Any) -> dict[str, dict[str, Any]]:
    async with run_engine(store) as engine:
        await engine.start_run(dag, logical_date=LOGICAL, **kwargs)
        return await engine.finish(dag.dag_id)


# -- BashOperator ---------------------------------------------------------------------------


async def test_bash_operator_renders_its_command_and_env(store: Store) -> None:
    with DAG(dag_id="tmpl_bash") as dag:
        BashOperator(
            task_id="say",
            bash_command='echo "{{ ds }} $WHO {{ ts_nodash }} {{ macros.ds_add(ds, -1) }}"',
            env={"WHO": "{{ run_id }}-{{ ds_nodash }}-{{ task.task_id }}"},
        )
    tis = await _run(store, dag)
    assert _result(tis["say"]) == "2026-11-29 run1-20261129-say 20261129T063000 2026-11-28"
    assert tis["say"]["rendered_fields"] == {
        "bash_command": 'echo "2026-11-29 $WHO 20261129T063000 2026-11-28"',
        "env": {"WHO": "run1-20261129-say"},
    }


async def test_a_bash_script_file_is_read_from_the_dag_folder_and_rendered(
    store: Store, tmp_path: Path
) -> None:
    (tmp_path / "report.sh").write_text('echo "report for {{ ds }} of {{ dag_run.dag_id }}"\n')
    with DAG(dag_id="tmpl_bash_file", fileloc=str(tmp_path / "dag.py")) as dag:
        BashOperator(task_id="report", bash_command="report.sh")
    tis = await _run(store, dag)
    assert _result(tis["report"]) == "report for 2026-11-29 of tmpl_bash_file"


# -- PythonOperator -----------------------------------------------------------------------


def _echo_args(
    day: str,
    n: int,
    *,
    when: str,
    nested: dict[str, Any],
    templates_dict: dict[str, Any],
    ds: str,
    data_interval_start: dt.datetime,
    data_interval_end: dt.datetime,
    logical_date: dt.datetime,
    run_id: str,
    dag_run: Any,
    params: dict[str, Any],
    ti: Any,
    macros: Any,
    task: BaseOperator,
) -> dict[str, Any]:
    return {
        "day": day,
        "n": n,
        "when": when,
        "nested": nested,
        "templates_dict": templates_dict,
        "ds": ds,
        "interval": [data_interval_start.isoformat(), data_interval_end.isoformat()],
        "logical_date": logical_date.isoformat(),
        "run_id": run_id,
        "conf": dag_run.conf,
        "params": params,
        "try": ti.try_number,
        "formatted": macros.ds_format(ds, "%Y-%m-%d", "%d/%m/%Y"),
        "task": task.task_id,
    }


def _wants_ds(ds: str) -> str:
    return f"asked for {ds}"


async def test_python_operator_renders_op_args_op_kwargs_and_templates_dict(
    store: Store,
) -> None:
    with DAG(dag_id="tmpl_python") as dag:
        PythonOperator(
            task_id="echo",
            python_callable=_echo_args,
            op_args=["{{ ds }}", 3],
            op_kwargs={
                "when": "{{ ts }}",
                "nested": {"days": ["{{ ds_nodash }}", ("{{ dag_run.conf.region }}", 7)]},
            },
            templates_dict={"query": "SELECT * FROM t WHERE day = '{{ ds }}'"},
        )
        PythonOperator(task_id="by_name", python_callable=_wants_ds)
    tis = await _run(store, dag, conf={"region": "eu"})
    got = _result(tis["echo"])
    assert got == {
        "day": "2026-11-29",
        "n": 3,
        "when": "2026-11-29T06:30:00+00:00",
        "nested": {"days": ["20261129", ["eu", 7]]},  # (the tuple comes back as a list)
        "templates_dict": {"query": "SELECT * FROM t WHERE day = '2026-11-29'"},
        "ds": "2026-11-29",
        "interval": [LOGICAL.isoformat(), LOGICAL.isoformat()],
        "logical_date": LOGICAL.isoformat(),
        "run_id": "run1",
        "conf": {"region": "eu"},
        "params": {},
        "try": 1,
        "formatted": "29/11/2026",
        "task": "echo",
    }
    assert tis["echo"]["rendered_fields"]["op_args"] == ["2026-11-29", 3]
    assert _result(tis["by_name"]) == "asked for 2026-11-29"
    assert tis["by_name"]["rendered_fields"] is None  # nothing templated, nothing stored


def _all_of_it(**context: Any) -> dict[str, Any]:
    prev = context["prev_data_interval_start_success"]
    return {
        "keys": sorted(set(TEMPLATE_VARIABLES) - context.keys()),
        "prev": None if prev is None else prev.isoformat(),
    }


async def test_prev_data_interval_start_success_is_the_last_successful_earlier_run(
    store: Store,
) -> None:
    with DAG(dag_id="tmpl_prev") as dag:
        PythonOperator(task_id="all", python_callable=_all_of_it)
        BashOperator(task_id="bash", bash_command="echo {{ prev_data_interval_start_success }}")
    days = [LOGICAL - dt.timedelta(days=2), LOGICAL - dt.timedelta(days=1), LOGICAL]
    results: list[Any] = []
    async with run_engine(store) as engine:
        for i, day in enumerate(days):
            await engine.start_run(dag, f"r{i}", logical_date=day)
            tis = await engine.finish("tmpl_prev", f"r{i}")
            results.append((_result(tis["all"]), _result(tis["bash"])))
    assert results[0] == ({"keys": [], "prev": None}, "None")
    assert results[1][0]["prev"] == days[0].isoformat()
    assert results[2] == ({"keys": [], "prev": days[1].isoformat()}, str(days[1]))


# -- sensors --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["poke", "deferrable"])
async def test_file_sensor_renders_its_filepath(store: Store, tmp_path: Path, mode: str) -> None:
    (tmp_path / "data_20261129.csv").write_text("x")
    (tmp_path / "data_20261128.csv").write_text("x")
    with DAG(dag_id="tmpl_file") as dag:
        FileSensor(
            task_id="wait",
            filepath=str(tmp_path / "data_{{ ds_nodash }}.csv"),
            **FAST,
            **MODES[mode],
        )
    tis = await _run(store, dag)
    assert _result(tis["wait"]) == [str(tmp_path / "data_20261129.csv")]


@pytest.mark.parametrize("mode", ["poke", "deferrable"])
async def test_sql_sensor_renders_its_sql_and_parameters(
    store: Store, db_url: str, mode: str
) -> None:
    with DAG(dag_id="tmpl_sql") as dag:
        SqlSensor(
            task_id="wait",
            conn=db_url,
            sql="SELECT $1::text || ' ' || '{{ ds }}'",
            parameters=["{{ run_id }}"],
            **FAST,
            **MODES[mode],
        )
    tis = await _run(store, dag)
    assert _result(tis["wait"]) == "run1 2026-11-29"


async def test_sql_template_files_come_from_the_dag_folder_and_the_search_path(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    folder, extra = tmp_path / "dags", tmp_path / "sql"
    folder.mkdir()
    (extra / "more").mkdir(parents=True)
    (folder / "check.sql").write_text("SELECT 'folder {{ ds }}'\n")
    (extra / "more" / "search.sql").write_text("SELECT 'search path {{ ds_nodash }}'\n")
    with DAG(
        dag_id="tmpl_sql_files", fileloc=str(folder / "dag.py"), template_searchpath=str(extra)
    ) as dag:
        SqlSensor(task_id="from_folder", conn=db_url, sql="check.sql", **FAST)
        SqlSensor(task_id="from_search_path", conn=db_url, sql="more/search.sql", **FAST)
    tis = await _run(store, dag)
    assert _result(tis["from_folder"]) == "folder 2026-11-29"
    assert _result(tis["from_search_path"]) == "search path 20261129"
    # (Jinja drops the file's one trailing newline, as Airflow's environment does.)
    assert tis["from_folder"]["rendered_fields"] == {
        "sql": "SELECT 'folder 2026-11-29'",
        "parameters": [],
    }


async def test_a_missing_template_file_fails_naming_the_field_and_the_folders(
    store: Store, tmp_path: Path
) -> None:
    with DAG(dag_id="tmpl_no_file", fileloc=str(tmp_path / "dag.py")) as dag:
        SqlSensor(task_id="wait", conn="postgresql://unused", sql="nowhere.sql", **FAST)
    tis = await _run(store, dag)
    assert tis["wait"]["state"] == "failed"
    assert (
        f"task tmpl_no_file.wait: template field 'sql': template file 'nowhere.sql' not found "
        f"in {tmp_path}" in tis["wait"]["error"]
    )


class _Service:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.text()
        self.seen.append((request.path, request.headers.get("X-Day"), body))
        ok = (request.path, request.headers.get("X-Day"), body) == (
            "/status/2026-11-29",
            "20261129",
            "run=run1",
        )
        return web.json_response({"ok": ok}, status=200 if ok else 404)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/status/{day}", self.handle)
        return app


@pytest.mark.parametrize("mode", ["poke", "deferrable"])
async def test_http_sensor_renders_endpoint_headers_and_data(
    store: Store, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = _Service()
    async with http_server(service.app()) as base:
        monkeypatch.setenv("DEFERRAL_CONN_TMPL_API", base)
        with DAG(dag_id="tmpl_http") as dag:
            HttpSensor(
                task_id="wait",
                conn_id="tmpl-api",
                endpoint="status/{{ ds }}",
                method="POST",
                headers={"X-Day": "{{ ds_nodash }}"},
                data="run={{ run_id }}",
                **FAST,
                **MODES[mode],
            )
        tis = await _run(store, dag)
    assert _result(tis["wait"])["status"] == 200
    assert service.seen[-1] == ("/status/2026-11-29", "20261129", "run=run1")


def test_http_sensor_takes_one_endpoint_or_url() -> None:
    assert HttpSensor(task_id="a", url="http://127.0.0.1/x").endpoint == "http://127.0.0.1/x"
    for kwargs in ({}, {"url": "/a", "endpoint": "/b"}):
        with pytest.raises(ValueError, match="task b: give HttpSensor one endpoint"):
            HttpSensor(task_id="b", **kwargs)


async def test_external_task_sensor_renders_its_ids(store: Store) -> None:
    with DAG(dag_id="tmpl_producer") as producer:
        PythonOperator(task_id="load", python_callable=_wants_ds)
    with DAG(dag_id="tmpl_consumer") as consumer:
        ExternalTaskSensor(
            task_id="wait",
            external_dag_id="{{ dag_run.conf['upstream'] }}",
            external_task_id="{{ dag_run.conf['task'] }}",
            **FAST,
        )
    async with run_engine(store) as engine:
        await engine.start_run(producer, logical_date=LOGICAL)
        await engine.finish("tmpl_producer")
        conf = {"upstream": "tmpl_producer", "task": "load"}
        await engine.start_run(consumer, conf=conf, logical_date=LOGICAL)
        tis = await engine.finish("tmpl_consumer")
    assert _result(tis["wait"])["state"] == "success"
    assert tis["wait"]["rendered_fields"] == {
        "external_dag_id": "tmpl_producer",
        "external_task_id": "load",
    }


# -- errors ---------------------------------------------------------------------------------


async def test_an_undefined_variable_fails_the_task_naming_task_field_and_variable(
    store: Store,
) -> None:
    with DAG(dag_id="orders") as dag:
        BashOperator(task_id="load", bash_command="echo {{ foo }}", retries=1, retry_delay=0.0)
    tis = await _run(store, dag)
    load = tis["load"]
    assert load["state"] == "failed"
    assert load["try_number"] == 2  # a normal failure: the retry ran (and failed the same way)
    assert "task orders.load: template field 'bash_command': 'foo' is undefined" in load["error"]
    assert load["rendered_fields"] is None


async def test_a_template_syntax_error_fails_the_task_saying_so(store: Store) -> None:
    with DAG(dag_id="tmpl_syntax") as dag:
        PythonOperator(task_id="p", python_callable=_wants_ds, op_kwargs={"x": "{{ ds "})
    tis = await _run(store, dag)
    assert tis["p"]["state"] == "failed"
    assert (
        "task tmpl_syntax.p: template field 'op_kwargs': template syntax error"
        in (tis["p"]["error"])
    )


# -- resume, isolation, the CLI ------------------------------------------------------------


class _DefersWithTemplate(BaseOperator):
    template_fields = ("target",)

    def __init__(self, *, target: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target = target

    def execute(self, context: Any) -> None:
        self.defer(
            trigger=TimeDeltaTrigger(dt.timedelta(0)),
            method_name="resume",
            kwargs={"first": self.target},
        )

    def resume(self, context: Any, event: Any, first: str) -> list[str]:
        return [first, self.target]


async def test_a_resumed_method_sees_the_fields_rendered_as_before(store: Store) -> None:
    with DAG(dag_id="tmpl_resume") as dag:
        _DefersWithTemplate(task_id="d", target="s3://bucket/{{ ds }}/")
    tis = await _run(store, dag)
    assert _result(tis["d"]) == ["s3://bucket/2026-11-29/", "s3://bucket/2026-11-29/"]
    assert tis["d"]["rendered_fields"] == {"target": "s3://bucket/2026-11-29/"}


_ISOLATED_DAG = """
from engine import DAG
from operators.bash import BashOperator
from operators.python import PythonOperator


def takes(day, ds, dag_run, ti):
    return [day, ds, dag_run.run_id, ti.task_id]


with DAG("tmpl_isolated"):
    BashOperator(task_id="bash", bash_command="job.sh", isolation="process")
    PythonOperator(
        task_id="python", python_callable=takes, op_args=["{{ ds }}"], isolation="process"
    )
"""


async def test_an_isolated_task_is_rendered_in_its_child_process(
    store: Store, tmp_path: Path
) -> None:
    (tmp_path / "tmpl_isolated_dag.py").write_text(textwrap.dedent(_ISOLATED_DAG))
    (tmp_path / "job.sh").write_text("echo child {{ ds_nodash }} $$\n")
    bag = DagBag(tmp_path)
    dag = bag.get_dag("tmpl_isolated")
    await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
    await store.create_dag_run(dag.dag_id, "run1", logical_date=LOGICAL)
    async with run_engine(store, dagbag=bag) as engine:
        tis = await engine.finish("tmpl_isolated")
    said = _result(tis["bash"]).split()
    assert said[:2] == ["child", "20261129"]
    assert _result(tis["python"]) == ["2026-11-29", "2026-11-29", "run1", "python"]
    assert tis["bash"]["rendered_fields"]["bash_command"].startswith("echo child 20261129 ")


class _Plain(BaseOperator):
    def execute(self, context: Any) -> str:
        return str(context["ds"])


async def test_tasks_list_json_shows_what_the_fields_rendered_to(store: Store, db_url: str) -> None:
    with DAG(dag_id="tmpl_cli") as dag:
        BashOperator(task_id="bash", bash_command="echo {{ ds }}", env={"DAY": "{{ ds }}"})
        _Plain(task_id="plain")
    tis = await _run(store, dag)
    assert _result(tis["plain"]) == "2026-11-29"
    args = ["tasks", "list", "--dag", "tmpl_cli", "--json"]
    env = {"DEFERRAL_DATABASE_URL": db_url}
    # (The command runs its own event loop: in a thread, off the test's.)
    result = await anyio.to_thread.run_sync(lambda: CliRunner().invoke(cli, args, env=env))
    assert result.exit_code == 0, result.output
    listed = {row["task_id"]: row for row in json.loads(result.output)}
    assert listed["bash"]["rendered"] == {
        "bash_command": "echo 2026-11-29",
        "env": {"DAY": "2026-11-29"},
    }
    assert listed["plain"]["rendered"] is None


# -- macros ---------------------------------------------------------------


def test_macros() -> None:
    assert ds_add("2026-01-31", 1) == "2026-02-01"
    assert ds_add("2026-03-01", -1) == "2026-02-28"
    assert ds_format("2026-01-31", "%Y-%m-%d", "%d/%m/%Y") == "31/01/2026"


class _Pair(NamedTuple):
    left: str
    right: int


class _Many(BaseOperator):
    template_fields = ("text", "items", "mapping", "other", "absent")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.text = "{{ ds }}"
        self.items = ("{{ ds_nodash }}", {"{{ ds }}"}, _Pair("{{ run_id }}", 2), [1, None])
        self.mapping = {"{{ key }}": ["{{ ti.try_number }}", {"deep": "{{ params.p }}"}]}
        self.other = object()


def test_fields_render_inside_containers_and_other_values_pass_unchanged() -> None:
    with DAG(dag_id="tmpl_unit"):
        op = _Many(task_id="many")
    other = op.other
    now = dt.datetime(2026, 11, 29, 23, 30, tzinfo=dt.timezone(dt.timedelta(hours=-2)))
    ti = ClaimedTask(
        id=7, dag_id="tmpl_unit", run_id="r", task_id="many", try_number=3, logical_date=now,
        conf={"p": "from conf"}, first_try_at=now, try_started_at=now,
        execution_timeout_s=None, db_now=now,
    )  # fmt: skip
    context = build_context(ti, op, _WithParams(), default_deferrable=False)
    assert (context["ds"], context["ts_nodash"]) == ("2026-11-30", "20261130T013000")  # UTC
    assert context["params"] == {"p": "from conf", "q": 1}
    rendered = prepare(op).render(context)
    assert op.text == "2026-11-30"
    assert op.items == ("20261130", {"2026-11-30"}, _Pair("r", 2), [1, None])
    assert op.mapping == {"{{ key }}": ["3", {"deep": "from conf"}]}  # keys are not rendered
    assert op.other is other
    assert rendered is not None
    assert jsonable(rendered)["items"] == ["20261130", ["2026-11-30"], ["r", 2], [1, None]]
    assert jsonable(rendered)["other"].startswith("<object object")


class _WithParams:
    params = {"p": "default", "q": 1}
