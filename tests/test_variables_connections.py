"""Variables and Connections in the database (issue 18): ``deferral variables set|get|list|
delete`` and ``deferral connections add|list|get|delete``, their values encrypted at rest and
re-encrypted by ``deferral keys rotate``; ``Variable.get`` in task code, ``{{ var.value.x }}``,
``{{ var.json.x.field }}`` and ``{{ conn.x.host }}`` in templates, the environment first; a
trigger resolving a stored connection where it runs.

Real database; the commands run through click's CliRunner on the test database (in a thread:
each runs its own event loop, as on the command line)."""

from __future__ import annotations

import datetime as dt
import functools
import json
from typing import Any

import anyio
import asyncpg
import pytest
from click.testing import CliRunner, Result

from engine import DAG, Variable
from engine.cli import cli
from engine.security.keys import Keyring, generate_key
from engine.store import Store
from engine.testing import run_engine
from operators.bash import BashOperator
from operators.python import PythonOperator
from operators.sensors import SqlSensor
from tests.sensor_helpers import FAST
from triggers.base import decode_value
from triggers.connections import Connection

pytestmark = pytest.mark.anyio

LOGICAL = dt.datetime(2026, 11, 29, 6, 30, tzinfo=dt.UTC)
#: The keys of ``connections list --json`` (and ``get --json``), in the table's order.
CONNECTION_KEYS = [
    "conn_id", "conn_type", "host", "port", "schema", "login", "password", "extra",
    "description", "source", "uri",
]  # fmt: skip


def invoke(env: dict[str, str], *args: str, stdin: str | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, input=stdin)


async def ainvoke(env: dict[str, str], *args: str, stdin: str | None = None) -> Result:
    """The command in a thread of its own (it runs its own event loop)."""
    return await anyio.to_thread.run_sync(functools.partial(invoke, env, *args, stdin=stdin))


async def _raw(db_url: str, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(db_url)
    try:
        return list(await conn.fetch(sql))
    finally:
        await conn.close()


async def _ok(env: dict[str, str], *args: str) -> Result:
    result = await ainvoke(env, *args)
    assert result.exit_code == 0, result.output
    return result


# -- the CLI ------------------------------------------------------------------------------


async def test_variables_set_get_list_delete(db_url: str) -> None:
    env = {"DEFERRAL_DATABASE_URL": db_url, "DEFERRAL_FERNET_KEY": generate_key()}
    assert "created" in (await _ok(env, "variables", "set", "bucket", "s3://raw")).output
    assert "set" in (await _ok(env, "variables", "set", "bucket", "s3://clean")).output
    await _ok(env, "variables", "set", "cfg", '{"region": "eu", "n": [1, 2]}', "--json")
    await _ok(env, "variables", "set", "plain_token", "abc123xyz", "--secret")
    assert (await _ok(env, "variables", "get", "bucket")).stdout == "s3://clean\n"
    got = json.loads((await _ok(env, "variables", "get", "cfg", "--json")).stdout)
    assert got == {"region": "eu", "n": [1, 2]}
    listed = {
        v["key"]: v
        for v in json.loads((await _ok(env, "variables", "list", "--json")).stdout)
    }  # fmt: skip
    assert list(listed["bucket"]) == ["key", "value", "is_secret", "description", "updated_at"]
    assert listed["bucket"]["value"] == "s3://clean"
    assert listed["plain_token"]["value"] == "***"  # secret: masked in listings
    assert listed["plain_token"]["is_secret"] is True
    table = (await _ok(env, "variables", "list")).stdout
    assert "abc123xyz" not in table
    assert "bucket" in table
    # Encrypted at rest: the value is nowhere in the table's bytes.
    rows = await _raw(db_url, "SELECT key, value FROM deferral_variables")
    assert rows
    for row in rows:
        assert b"s3://" not in row["value"]
        assert b"abc123xyz" not in row["value"]
    assert "deleted" in (await _ok(env, "variables", "delete", "bucket")).output
    missing = await ainvoke(env, "variables", "get", "bucket")
    assert missing.exit_code == 1
    assert "no Variable 'bucket'" in missing.output
    assert (await _ok(env, "variables", "get", "bucket", "--default", "d")).stdout == "d\n"
    assert (await ainvoke(env, "variables", "delete", "bucket")).exit_code == 1


async def test_variables_set_refuses_bad_input_and_keeps_what_is_stored(db_url: str) -> None:
    env = {"DEFERRAL_DATABASE_URL": db_url}
    await _ok(env, "variables", "set", "cfg", '{"a": 1}', "--json")
    bad = await ainvoke(env, "variables", "set", "cfg", "{not json", "--json")
    assert bad.exit_code == 2
    assert "VALUE is not JSON" in bad.output
    assert json.loads((await _ok(env, "variables", "get", "cfg")).stdout) == {"a": 1}
    assert (await ainvoke(env, "variables", "set", "", "x")).exit_code == 2
    not_json = await ainvoke(env, "variables", "set", "txt", "hello")
    assert not_json.exit_code == 0
    refused = await ainvoke(env, "variables", "get", "txt", "--json")
    assert refused.exit_code == 1
    assert "is not JSON" in refused.output


async def test_connections_add_list_get_delete(db_url: str) -> None:
    env = {"DEFERRAL_DATABASE_URL": db_url, "DEFERRAL_FERNET_KEY": generate_key()}
    added = await _ok(
        env, "connections", "add", "warehouse",
        "--uri", "postgresql://etl:s3cr%40t@db.example.com:5433/sales?sslmode=require",
    )  # fmt: skip
    assert "s3cr" not in added.output
    await _ok(
        env, "connections", "add", "api", "--conn-type", "http", "--host", "api.example.com",
        "--login", "bot", "--password", "hunter22", "--extra", '{"api_key": "k-999", "v": "2"}',
    )  # fmt: skip
    listed = json.loads((await _ok(env, "connections", "list", "--json")).stdout)
    by_id = {c["conn_id"]: c for c in listed}
    assert list(by_id["warehouse"]) == CONNECTION_KEYS
    wh = by_id["warehouse"]
    assert (wh["conn_type"], wh["host"], wh["port"], wh["schema"], wh["login"]) == (
        "postgres", "db.example.com", 5433, "sales", "etl"
    )  # fmt: skip
    assert wh["password"] == "***"
    assert wh["extra"] == {"sslmode": "require"}
    assert wh["source"] == "database"
    api = by_id["api"]
    assert api["password"] == "***"
    assert api["extra"] == {"api_key": "***", "v": "2"}
    table = (await _ok(env, "connections", "list")).stdout
    assert "hunter22" not in table
    assert "s3cr@t" not in table
    assert "warehouse" in table
    shown = json.loads((await _ok(env, "connections", "get", "api", "--json")).stdout)
    assert shown["password"] == "***"
    revealed = await _ok(env, "connections", "get", "warehouse", "--json", "--show-password")
    assert json.loads(revealed.stdout)["password"] == "s3cr@t"
    # The environment wins, and get says so.
    env_first = dict(env, DEFERRAL_CONN_WAREHOUSE="postgresql://other@envhost/x")
    from_env = json.loads(
        (await _ok(env_first, "connections", "get", "warehouse", "--json")).stdout
    )
    assert (from_env["host"], from_env["source"]) == ("envhost", "environment")
    # Encrypted at rest.
    for row in await _raw(db_url, "SELECT secrets FROM deferral_connections"):
        assert b"hunter22" not in row["secrets"]
        assert b"k-999" not in row["secrets"]
    again = await ainvoke(env, "connections", "add", "api", "--uri", "http://h")
    assert again.exit_code == 1
    assert "exists already" in again.output
    await _ok(env, "connections", "add", "api", "--uri", "http://h2", "--replace")
    assert (
        json.loads((await _ok(env, "connections", "get", "api", "--json")).stdout)["host"] == "h2"
    )
    await _ok(env, "connections", "delete", "api")
    assert (await ainvoke(env, "connections", "get", "api")).exit_code == 1
    assert (await ainvoke(env, "connections", "delete", "api")).exit_code == 1


async def test_connections_add_refuses_bad_input(db_url: str) -> None:
    env = {"DEFERRAL_DATABASE_URL": db_url}
    both = await ainvoke(env, "connections", "add", "c", "--uri", "http://h", "--host", "x")
    assert both.exit_code == 2
    assert "either --uri or the fields" in both.output
    neither = await ainvoke(env, "connections", "add", "c")
    assert neither.exit_code == 2
    bad_extra = await ainvoke(
        env, "connections", "add", "c", "--conn-type", "http", "--extra", "[1]"
    )  # fmt: skip
    assert bad_extra.exit_code == 2
    assert "JSON object" in bad_extra.output
    no_scheme = await ainvoke(env, "connections", "add", "c", "--uri", "just-a-host")
    assert no_scheme.exit_code == 2
    assert json.loads((await _ok(env, "connections", "list", "--json")).stdout) == []


async def test_keys_rotate_reencrypts_variables_and_connections(db_url: str) -> None:
    old, new = generate_key(), generate_key()
    env = {"DEFERRAL_DATABASE_URL": db_url, "DEFERRAL_FERNET_KEY": old}
    await _ok(env, "variables", "set", "v1", "one")
    await _ok(env, "connections", "add", "c1", "--uri", "http://u:pw@h")
    env["DEFERRAL_FERNET_KEY"] = f"{new},{old}"
    rotated = await _ok(env, "keys", "rotate")
    assert "re-encrypted 2," in rotated.output
    # Readable with the new key alone.
    env["DEFERRAL_FERNET_KEY"] = new
    assert (await _ok(env, "variables", "get", "v1")).stdout == "one\n"
    got = await _ok(env, "connections", "get", "c1", "--json", "--show-password")
    assert json.loads(got.stdout)["password"] == "pw"
    keyring = Keyring([new])
    for row in await _raw(db_url, "SELECT value FROM deferral_variables"):
        assert keyring.is_current(row["value"])


# -- task code and templates --------------------------------------------------------------


def _reads_variables() -> list[Any]:
    return [
        Variable.get("bucket"),
        Variable.get("missing", default_var="fallback"),
        Variable.get("cfg", deserialize_json=True),
        Variable.get("from_env"),
    ]


async def test_task_code_and_templates_read_variables_and_connections(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.set_variable("bucket", "s3://raw")
    await store.set_variable("cfg", json.dumps({"region": "eu-west-1", "n": 3}))
    await store.set_variable("from_env", "from the database")
    await store.add_connection(
        Connection.from_uri("warehouse", "postgresql://etl:pw@db.example.com:5433/sales")
    )
    monkeypatch.setenv("DEFERRAL_VAR_FROM_ENV", "from the environment")
    with DAG(dag_id="var_conn_reads") as dag:
        PythonOperator(task_id="code", python_callable=_reads_variables)
        BashOperator(
            task_id="tmpl",
            bash_command=(
                "echo {{ var.value.bucket }} {{ var.json.cfg.region }} "
                "{{ var.value.get('nope', 'dflt') }} {{ conn.warehouse.host }} "
                "{{ conn.warehouse.port }} {{ conn.warehouse.login }}"
            ),
        )
    async with run_engine(store) as engine:
        await engine.start_run(dag, logical_date=LOGICAL)
        tis = await engine.finish("var_conn_reads")
    assert tis["code"]["state"] == "success", tis["code"]["error"]
    assert decode_value(tis["code"]["result"]) == [
        "s3://raw", "fallback", {"region": "eu-west-1", "n": 3}, "from the environment",
    ]  # fmt: skip
    assert tis["tmpl"]["state"] == "success", tis["tmpl"]["error"]
    assert decode_value(tis["tmpl"]["result"]) == "s3://raw eu-west-1 dflt db.example.com 5433 etl"


def _missing_variable() -> Any:
    return Variable.get("never_set")


async def test_a_missing_variable_fails_the_task_saying_how_to_set_it(store: Store) -> None:
    with DAG(dag_id="var_missing") as dag:
        PythonOperator(task_id="code", python_callable=_missing_variable)
        BashOperator(task_id="tmpl", bash_command="echo {{ var.value.never_set }}")
    async with run_engine(store) as engine:
        await engine.start_run(dag, logical_date=LOGICAL)
        tis = await engine.finish("var_missing")
    for task in ("code", "tmpl"):
        assert tis[task]["state"] == "failed"
        assert "deferral variables set never_set" in tis[task]["error"]


async def test_a_trigger_resolves_a_stored_connection_where_it_runs(
    store: Store, db_url: str
) -> None:
    await store.add_connection(Connection.from_uri("stored_db", db_url))
    with DAG(dag_id="conn_trigger") as dag:
        SqlSensor(
            task_id="wait", conn="stored_db", sql="SELECT 'from the stored connection'",
            deferrable=True, **FAST,
        )  # fmt: skip
    async with run_engine(store) as engine:
        await engine.start_run(dag, logical_date=LOGICAL)
        tis = await engine.finish("conn_trigger")
    assert tis["wait"]["state"] == "success", tis["wait"]["error"]
    assert decode_value(tis["wait"]["result"]) == "from the stored connection"


_ISOLATED_DAG = """
from engine import DAG, Variable
from operators.python import PythonOperator


def reads():
    return Variable.get("bucket")


with DAG("var_isolated"):
    PythonOperator(task_id="code", python_callable=reads, isolation="process")
"""


async def test_an_isolated_task_is_told_it_cannot_read_stored_variables(
    store: Store, tmp_path: Any
) -> None:
    from engine.dags.dagbag import DagBag

    await store.set_variable("bucket", "s3://raw")
    (tmp_path / "var_isolated_dag.py").write_text(_ISOLATED_DAG)
    bag = DagBag(tmp_path)
    dag = bag.get_dag("var_isolated")
    await store.upsert_dag(dag.dag_id, dag.fileloc, dag.serialize_tasks(), None)
    await store.create_dag_run(dag.dag_id, "run1", logical_date=LOGICAL)
    async with run_engine(store, dagbag=bag) as engine:
        tis = await engine.finish("var_isolated")
    assert tis["code"]["state"] == "failed"
    assert 'isolation="process"' in tis["code"]["error"]
