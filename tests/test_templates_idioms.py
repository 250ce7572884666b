"""Templates as Airflow users write them (engine/worker/templating.py, context.py, macros.py):
templates that name no variable, pendulum dates, filters, macros, the DAG's Jinja settings, the
sandbox, nested template fields, conf data never rendered, "did you mean", the previous
successful run; the unit cases render directly, the rest on a real engine."""

from __future__ import annotations

import datetime as dt
import json
import textwrap
import uuid
from pathlib import Path
from typing import Any

import jinja2
import pendulum
import pytest

from engine import DAG
from engine.store import ClaimedTask, Store
from engine.testing import run_engine
from engine.worker.context import PREV_SUCCESS_KEYS, TEMPLATE_VARIABLES, build_context
from engine.worker.macros import ds_add, ds_format_locale
from engine.worker.templating import TemplateRenderError, prepare
from operators.base import BaseOperator
from operators.bash import BashOperator
from operators.python import PythonOperator
from operators.sensors import SqlSensor
from tests.sensor_helpers import FAST
from triggers.base import decode_value

#: The logical date of the runs: 2026-11-29 06:30 UTC.
LOGICAL = dt.datetime(2026, 11, 29, 6, 30, tzinfo=dt.UTC)
REPO = Path(__file__).resolve().parent.parent


def _claimed(task_id: str = "t", conf: dict[str, Any] | None = None) -> ClaimedTask:
    return ClaimedTask(
        id=7, dag_id="idioms", run_id="manual_1", task_id=task_id, try_number=1,
        logical_date=LOGICAL, conf=conf or {}, first_try_at=LOGICAL, try_started_at=LOGICAL,
        execution_timeout_s=None, db_now=LOGICAL,
        data_interval_start=LOGICAL - dt.timedelta(days=1), data_interval_end=LOGICAL,
        run_type="scheduled",
    )  # fmt: skip


class _Templated(BaseOperator):
    template_fields = ("value",)
    template_ext = (".sql",)

    def __init__(self, *, value: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.value = value

    def execute(self, context: Any) -> Any:
        return self.value


def render(value: Any, *, dag: DAG | None = None, conf: dict[str, Any] | None = None) -> Any:
    """``value`` as a templated field renders in a run of ``dag``."""
    dag = dag or DAG("idioms")
    with dag:
        op = _Templated(task_id=f"t{uuid.uuid4().hex[:8]}", value=value)
    context = build_context(_claimed(op.task_id, conf), op, dag, default_deferrable=False)
    prepare(op).render(context)
    return op.value


# -- the bug: a template naming no variable was never rendered ----------------------------


def test_every_template_is_rendered_even_one_that_names_no_variable(tmp_path: Path) -> None:
    assert render("echo {{ 1 + 1 }}") == "echo 2"
    assert render("{% for i in range(3) %}{{ i }}{% endfor %}") == "012"
    assert render("{% raw %}${#list[@]}{% endraw %}") == "${#list[@]}"
    assert render(["{{ 'a' ~ 'b' }}", {"k": "{# a comment #}x"}]) == ["ab", {"k": "x"}]
    # A template file without variables: its text, not its name.
    (tmp_path / "static.sql").write_text("SELECT 1")
    dag = DAG("idioms_file", fileloc=str(tmp_path / "dag.py"))
    assert render("static.sql", dag=dag) == "SELECT 1"


@pytest.mark.anyio
async def test_bash_runs_a_template_without_variables_rendered(store: Store) -> None:
    with DAG(dag_id="tmpl_novars") as dag:
        BashOperator(task_id="math", bash_command="echo {{ 1 + 1 }}")
        BashOperator(task_id="loop", bash_command="echo {% for i in range(3) %}{{ i }}{% endfor %}")
    async with run_engine(store) as engine:
        await engine.start_run(dag, logical_date=LOGICAL)
        tis = await engine.finish("tmpl_novars")
    assert decode_value(tis["math"]["result"]) == "2"
    assert decode_value(tis["loop"]["result"]) == "012"
    assert tis["math"]["rendered_fields"]["bash_command"] == "echo 2"


def test_ds_add_takes_unpadded_dates_as_airflow_does() -> None:
    assert ds_add("2015-1-5", 1) == "2015-01-06"
    assert ds_add("2015-01-06", -5) == "2015-01-01"
    assert ds_add("2015-1-5", 0) == "2015-1-5"


# -- pendulum dates, filters, keys, macros -------------------------------------------------


def test_context_dates_are_pendulum_datetimes() -> None:
    assert render("{{ logical_date.in_timezone('Europe/Amsterdam').format('YYYY-MM-DD HH:mm') }}") \
        == "2026-11-29 07:30"  # fmt: skip
    assert render("{{ logical_date.add(days=1) | ds }}") == "2026-11-30"
    assert render("{{ data_interval_start.format('YYYY-MM') }}") == "2026-11"
    assert render("{{ dag_run.logical_date.day_of_week }}") == str(pendulum.SUNDAY.value)
    dag = DAG("idioms_ctx")
    with dag:
        op = _Templated(task_id="ctx", value="")
    context = build_context(_claimed("ctx"), op, dag, default_deferrable=False)
    assert isinstance(context["logical_date"], pendulum.DateTime)
    assert isinstance(context["data_interval_end"], pendulum.DateTime)
    assert context["logical_date"].timezone_name == "UTC"


def test_the_airflow_filters_and_keys() -> None:
    assert render("{{ data_interval_end | ds }} {{ data_interval_end | ds_nodash }}") == (
        "2026-11-29 20261129"
    )
    assert render("{{ logical_date | ts_nodash }} {{ logical_date | ts_nodash_with_tz }}") == (
        "20261129T063000 20261129T063000+0000"
    )
    assert render("{{ data_interval_start | ts }}") == "2026-11-28T06:30:00+00:00"
    assert render("{{ ts_nodash_with_tz }}") == "20261129T063000+0000"
    assert render("{{ task_instance_key_str }}").startswith("idioms__t")
    assert render("{{ task_instance.try_number }} {{ ti.dag_id }}") == "1 idioms"
    assert render("{{ dag.dag_id }} {{ inlets }} {{ outlets }} {{ run_type }}") == (
        "idioms [] [] scheduled"
    )


def test_the_airflow_macros() -> None:
    assert render("{{ macros.json.dumps({'a': 1}) }}") == '{"a": 1}'
    assert render("{{ macros.time.gmtime(0).tm_year }}") == "1970"
    assert len(render("{{ macros.uuid.uuid4() }}")) == 36
    assert 0 <= float(render("{{ macros.random() }}")) < 1
    assert render("{{ macros.dateutil.relativedelta.relativedelta(months=1).months }}") == "1"
    assert (
        render("{{ macros.datetime_diff_for_humans(data_interval_start, data_interval_end) }}")
        == "1 day before"
    )
    assert render("{{ macros.ds_format('2026-11-29', '%Y-%m-%d', '%d/%m') }}") == "29/11"
    assert (
        render("{{ macros.ds_format_locale(ds, '%Y-%m-%d', 'EEEE d MMMM', 'nl_NL') }}")
        == "zondag 29 november"
    )
    assert ds_format_locale("12/07/2024", "%d/%m/%Y", "EEEE dd MMMM yyyy", "en_US") == (
        "Friday 12 July 2024"
    )


def test_every_template_variable_is_in_the_context_and_the_docs() -> None:
    dag = DAG("idioms_keys")
    with dag:
        op = _Templated(task_id="keys", value="")
    context = build_context(_claimed("keys"), op, dag, default_deferrable=False)
    prev = {k for k in TEMPLATE_VARIABLES if k.startswith("prev_")}
    assert set(TEMPLATE_VARIABLES) - prev <= context.keys()
    doc = (REPO / "docs" / "reference" / "templates.md").read_text()
    for name in TEMPLATE_VARIABLES:
        assert f"| `{name}` |" in doc, name


# -- the DAG's Jinja settings --------------------------------------------------------------


def test_user_defined_macros_and_filters() -> None:
    dag = DAG(
        "idioms_user",
        user_defined_macros={"project": "acme", "double": lambda x: 2 * x},
        user_defined_filters={"shout": lambda s: s.upper() + "!"},
    )
    assert render("{{ project | shout }} {{ double(21) }}", dag=dag) == "ACME! 42"


def test_render_template_as_native_obj_gives_python_values() -> None:
    dag = DAG("idioms_native", render_template_as_native_obj=True)
    assert render("{{ 1 + 2 }}", dag=dag) == 3
    assert render({"ids": "{{ [1, 2] + [3] }}", "day": "{{ ds }}"}, dag=dag) == {
        "ids": [1, 2, 3],
        "day": "2026-11-29",
    }
    # Still sandboxed (Airflow's native environment is not).
    with pytest.raises(TemplateRenderError, match="sandbox"):
        render("{{ ds.__class__.__mro__ }}", dag=dag)


def test_template_undefined_and_jinja_environment_kwargs() -> None:
    lenient = DAG("idioms_lenient", template_undefined=jinja2.Undefined)
    assert render("[{{ nothing_here }}]", dag=lenient) == "[]"
    keep = DAG("idioms_keep", jinja_environment_kwargs={"keep_trailing_newline": True})
    assert render("{{ ds }}\n", dag=keep) == "2026-11-29\n"
    # Airflow's default: a rendered string loses one trailing newline.
    assert render("{{ ds }}\n") == "2026-11-29"
    assert render("echo hi\n") == "echo hi"
    with pytest.raises(TemplateRenderError, match="DAG idioms_badkw: jinja_environment_kwargs"):
        render("{{ ds }}", dag=DAG("idioms_badkw", jinja_environment_kwargs={"nope": 1}))


def test_the_do_extension() -> None:
    assert render("{% set xs = [] %}{% do xs.append(ds) %}{{ xs | length }}") == "1"


def test_the_sandbox_refuses_internal_attributes() -> None:
    with pytest.raises(TemplateRenderError, match="refused by the template sandbox"):
        render("{{ ds.__class__.__mro__ }}")
    with pytest.raises(TemplateRenderError, match="refused by the template sandbox"):
        render("{{ macros.json.__loader__ }}")


# -- nested objects, data that is never rendered, errors -----------------------------------


class _Query:
    template_fields = ("sql", "params")

    def __init__(self, sql: str, params: dict[str, Any]) -> None:
        self.sql = sql
        self.params = params


def test_objects_with_template_fields_inside_a_field_are_rendered() -> None:
    nested = render({"q": _Query("SELECT '{{ ds }}'", {"d": "{{ ds_nodash }}"}), "n": 1})
    assert isinstance(nested["q"], _Query)
    assert (nested["q"].sql, nested["q"].params, nested["n"]) == (
        "SELECT '2026-11-29'", {"d": "20261129"}, 1
    )  # fmt: skip


def test_values_from_conf_are_data_never_rendered() -> None:
    conf = {"cmd": "{{ 7 * 7 }}", "p": "{% for x in range(2) %}{{ x }}{% endfor %}"}
    dag = DAG("idioms_conf", params={"p": "default"})
    assert render("run {{ dag_run.conf.cmd }}", dag=dag, conf=conf) == "run {{ 7 * 7 }}"
    assert render("{{ params.p }}", dag=dag, conf=conf) == conf["p"]
    native = DAG("idioms_conf_native", render_template_as_native_obj=True)
    assert render("{{ dag_run.conf['cmd'] }}", dag=native, conf=conf) == "{{ 7 * 7 }}"
    # (text that parses as a literal Python cannot build: a set of a set)
    assert render("{{ dag_run.conf['x'] }}", dag=native, conf={"x": "{{ 1 }}"}) == "{{ 1 }}"


def test_an_undefined_name_says_what_was_meant() -> None:
    with pytest.raises(TemplateRenderError) as caught:
        render("{{ dss }}")
    assert "'dss' is undefined (did you mean `ds`?)" in str(caught.value)
    with pytest.raises(
        TemplateRenderError, match=r"has no attribute 'confx' \(did you mean `conf`"
    ):
        render("{{ dag_run.confx }}")
    with pytest.raises(TemplateRenderError) as caught:
        render("{{ totally_unknown_thing }}")
    assert "did you mean" not in str(caught.value)


# -- on a real engine ----------------------------------------------------------------------


def _prev(**context: Any) -> dict[str, Any]:
    return {
        k: None if context[k] is None else context[k].isoformat()
        for k in ("prev_data_interval_start_success", "prev_data_interval_end_success",
                  "prev_start_date_success", "prev_end_date_success")
    }  # fmt: skip


@pytest.mark.anyio
async def test_the_previous_successful_run_values(store: Store) -> None:
    with DAG(dag_id="tmpl_prev_all") as dag:
        PythonOperator(task_id="p", python_callable=_prev)
        BashOperator(task_id="b", bash_command="echo {{ prev_end_date_success is not none }}")
    async with run_engine(store) as engine:
        await engine.start_run(dag, "r0", logical_date=LOGICAL - dt.timedelta(days=1))
        first = await engine.finish("tmpl_prev_all", "r0")
        await engine.start_run(dag, "r1", logical_date=LOGICAL)
        second = await engine.finish("tmpl_prev_all", "r1")
    assert decode_value(first["p"]["result"]) == dict.fromkeys(PREV_SUCCESS_KEYS)
    got = decode_value(second["p"]["result"])
    assert got["prev_data_interval_start_success"] == (LOGICAL - dt.timedelta(days=1)).isoformat()
    assert got["prev_start_date_success"] is not None
    assert got["prev_end_date_success"] is not None
    assert decode_value(second["b"]["result"]) == "True"


def _returns_context_dates(logical_date: Any, data_interval_end: Any) -> list[Any]:
    return [logical_date, data_interval_end.add(hours=1)]


@pytest.mark.anyio
async def test_a_task_returns_pendulum_dates_as_its_result(store: Store) -> None:
    with DAG(dag_id="tmpl_pendulum_result") as dag:
        PythonOperator(task_id="p", python_callable=_returns_context_dates)
    async with run_engine(store) as engine:
        await engine.start_run(dag, logical_date=LOGICAL)
        tis = await engine.finish("tmpl_pendulum_result")
    assert tis["p"]["state"] == "success", tis["p"]["error"]
    assert decode_value(tis["p"]["result"]) == [LOGICAL, LOGICAL + dt.timedelta(hours=1)]


@pytest.mark.anyio
async def test_a_typo_fails_the_task_with_the_name_meant(store: Store) -> None:
    with DAG(dag_id="tmpl_typo") as dag:
        BashOperator(task_id="b", bash_command="echo {{ dss }}")
    async with run_engine(store) as engine:
        await engine.start_run(dag, logical_date=LOGICAL)
        tis = await engine.finish("tmpl_typo")
    assert tis["b"]["state"] == "failed"
    assert (
        "task tmpl_typo.b: template field 'bash_command': 'dss' is undefined (did you mean `ds`?)"
        in tis["b"]["error"]
    )


_NATIVE_DAG = """
from engine import DAG
from operators.python import PythonOperator


def kinds(ids, when, conf_cmd):
    return [type(ids).__name__, ids, when, conf_cmd]


with DAG("tmpl_native_iso", render_template_as_native_obj=True,
         user_defined_macros={"base": 40}):
    PythonOperator(
        task_id="p",
        python_callable=kinds,
        op_kwargs={"ids": "{{ [base, base + 2] }}", "when": "{{ ds }}",
                   "conf_cmd": "{{ dag_run.conf['cmd'] }}"},
        isolation="process",
    )
"""


@pytest.mark.anyio
async def test_an_isolated_task_renders_with_the_dags_settings_in_its_child(
    store: Store, tmp_path: Path
) -> None:
    from engine.dags.dagbag import DagBag

    (tmp_path / "native_iso_dag.py").write_text(textwrap.dedent(_NATIVE_DAG))
    bag = DagBag(tmp_path)
    dag = bag.get_dag("tmpl_native_iso")
    await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
    await store.create_dag_run(dag.dag_id, "run1", logical_date=LOGICAL, conf={"cmd": "{{ 1 }}"})
    async with run_engine(store, dagbag=bag) as engine:
        tis = await engine.finish("tmpl_native_iso")
    assert tis["p"]["state"] == "success", tis["p"]["error"]
    assert decode_value(tis["p"]["result"]) == ["list", [40, 42], "2026-11-29", "{{ 1 }}"]
    assert json.loads(json.dumps(tis["p"]["rendered_fields"]))["op_kwargs"]["ids"] == [40, 42]


@pytest.mark.anyio
async def test_sql_file_without_variables_runs_its_text(store: Store, db_url: str,
                                                        tmp_path: Path) -> None:  # fmt: skip
    (tmp_path / "static.sql").write_text("SELECT 'static'\n")
    with DAG(dag_id="tmpl_static_sql", fileloc=str(tmp_path / "dag.py")) as dag:
        SqlSensor(task_id="wait", conn=db_url, sql="static.sql", **FAST)
    async with run_engine(store) as engine:
        await engine.start_run(dag, logical_date=LOGICAL)
        tis = await engine.finish("tmpl_static_sql")
    assert decode_value(tis["wait"]["result"]) == "static"
