"""Secrets stay masked wherever the engine shows values, end to end: the status page (real
HTTP requests to the aiohttp app), the CLI's listings, ``show`` and ``--json`` outputs,
``deferral tasks test``, and the task and trigger log lines a real engine stores.

Every secret below is in a shape of its own (tests/test_masking.py tests each shape alone):
a sensitive key, a URL password holding ``@``, a libpq DSN keyword, a ``?token=`` query, a
presigned URL, headers, a key named ``pwd``, a bearer token, a registered value."""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner, Result

from engine import DAG, masking
from engine.cli import cli
from engine.store import Deferral, Store, TaskOutcome
from engine.store.models import TaskLogRow
from engine.testing import run_engine
from engine.web.app import make_app
from operators.base import BaseOperator, Context
from operators.python import PythonOperator
from tests.helpers import REPO_ROOT, child_env
from triggers.base import BaseTrigger, TriggerEvent, encode_value

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # The commands run their own loop; the page and the engine run on this one.
    return ("asyncio", {"use_uvloop": True})


@pytest.fixture(autouse=True)
def no_registered_secrets() -> Iterator[None]:
    masking.forget_secrets()
    yield
    masking.forget_secrets()


CONF = {
    "password": "conf-pw-0001",
    "db": "postgresql://app:conf@pw-0002@db.example:5432/x",
    "libpq": "host=db.example password='conf pw 0003' dbname=x",
    "callback": "https://hooks.example/cb?token=conf-tok-0004&page=1",
    "headers": {
        "X-Api-Key": "conf-key-0005",
        "Ocp-Apim-Subscription-Key": "conf-key-0006",
        "Api-Key": "conf-key-0007",
    },
    "pwd": "conf-pwd-0008",
    "presigned": (
        "https://b.s3.amazonaws.com/k.csv?X-Amz-Credential=AKIACONF0009"
        "&X-Amz-Signature=confsig0010&X-Amz-Expires=60"
    ),
    "note": "kept-visible-conf",
}
RENDERED = {
    "bash_command": "curl -H 'Authorization: Bearer rend-tok-0001' https://api.example/x",
    "env": {"API_TOKEN": "rend-tok-0002", "REGION": "kept-visible-rendered"},
    "sql": "-- on host=h password=rend-pw-0003 dbname=x",
}
ERROR = (
    "Traceback (most recent call last):\n"
    "ConnectionError: postgresql://u:err-pw-0001@h/d refused (the vault said "
    "registered-bare-0003)\nsent Authorization: Bearer err-tok-0002"
)
RESULT = {
    "access_token": "res-tok-0001",
    "next": "https://api.example/x?token=res-tok-0002",
    "rows": 1234,
}
KWARGS = {
    "url": "https://svc:kw-pw-0001@jobs.example/x",
    "headers": {"X-Api-Key": "kw-key-0002", "Accept": "kept-visible-kwargs"},
    "pwd": "kw-pwd-0003",
    "poll": 5,
}
#: Registered as a connection's password: masked also as a bare word.
REGISTERED = "registered-bare-0003"


ALL_SECRETS = [
    "conf-pw-0001", "conf@pw-0002", "conf pw 0003", "conf-tok-0004", "conf-key-0005",
    "conf-key-0006", "conf-key-0007", "conf-pwd-0008", "AKIACONF0009", "confsig0010",
    "rend-tok-0001", "rend-tok-0002", "rend-pw-0003", "err-pw-0001", "err-tok-0002",
    REGISTERED, "res-tok-0001", "res-tok-0002", "kw-pw-0001", "kw-key-0002", "kw-pwd-0003",
]  # fmt: skip
VISIBLE = ["kept-visible-conf", "kept-visible-rendered", "kept-visible-kwargs"]


def _none_shown(text: str, secrets: list[str] = ALL_SECRETS) -> None:
    shown = [s for s in secrets if s in text or s.replace("@", "%40") in text]
    assert not shown, f"secrets shown: {shown}\n{text}"


@dataclass
class Scene:
    store: Store
    ids: dict[str, int]
    trigger_id: int


@pytest.fixture
async def scene(store: Store) -> Scene:
    """A run with secrets in its conf; task a failed (secrets in its error and its rendered
    fields, a stored log line holding them), b succeeded (secrets in its result), c deferred
    on a trigger with secrets in its kwargs."""
    with DAG(dag_id="masked") as dag:
        for task_id in "abc":
            PythonOperator(task_id=task_id, python_callable=print)
    await store.upsert_dag("masked", "masked.py", dag.serialize_tasks(), None)
    await store.create_dag_run(
        "masked", "r1", logical_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC), conf=CONF
    )
    worker = await store.register_worker("mask-host", 4242, 4)
    claimed = (await store.claim_tasks(worker, 10)).claimed
    ids = {ti.task_id: ti.id for ti in claimed}
    assert await store.set_rendered_fields(ids["a"], worker, 1, RENDERED)
    await store.defer_task(
        ids["c"],
        worker,
        Deferral(
            classpath="tests.triggers_for_tests.NeverTrigger",
            kwargs=encode_value(KWARGS),
            dedup_key="mask-c",
            method_name="resume",
            method_kwargs=encode_value({}),
            timeout_s=3600.0,
        ),
    )
    await store.finish_tasks(
        [
            TaskOutcome(ti_id=ids["a"], worker_id=worker, try_number=1, kind="failed", error=ERROR),
            TaskOutcome(
                ti_id=ids["b"],
                worker_id=worker,
                try_number=1,
                kind="success",
                result=encode_value(RESULT),
            ),
        ]
    )
    trigger_id = (await store.task_try("masked", "r1", "c")).trigger_id  # type: ignore[union-attr]
    assert trigger_id is not None
    return Scene(store, ids, trigger_id)


# -- the status page -----------------------------------------------------------------------------


@pytest.fixture
async def client(scene: Scene) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(make_app(scene.store))) as c:
        yield c


async def _page(client: TestClient[Any, Any], path: str, **params: str) -> str:
    response = await client.get(path, params=params)
    text = await response.text()
    assert response.status == 200, text
    return text


async def test_the_status_page_masks_conf_rendered_fields_kwargs_result_error_and_log(
    scene: Scene, client: TestClient[Any, Any]
) -> None:
    # The page process knows this secret (a connection of its own, say): masked as a bare word.
    masking.register_secret(REGISTERED)
    # A log line stored before the secret was known to the writer... and one after.
    await scene.store.insert_task_logs(
        [TaskLogRow("masked", "r1", "a", 1, 1.0, "INFO", "log", "app", f"vault: {REGISTERED}")]
    )
    run = await _page(client, "/run", dag_id="masked", run_id="r1")
    a = await _page(client, "/task", dag_id="masked", run_id="r1", task_id="a")
    b = await _page(client, "/task", dag_id="masked", run_id="r1", task_id="b")
    c = await _page(client, "/task", dag_id="masked", run_id="r1", task_id="c")
    for text in (run, a, b, c):
        _none_shown(text)
    assert "kept-visible-conf" in run
    assert "***" in run
    assert 'id="run-conf"' in run
    assert "kept-visible-rendered" in a
    assert 'id="rendered-fields"' in a
    assert 'id="error"' in a
    assert "ConnectionError: postgresql://u:***@h/d" in a
    assert "vault: ***" in a  # the stored log line
    assert 'id="result"' in b
    assert "1234" in b
    assert 'id="trigger-kwargs"' in c
    assert "kept-visible-kwargs" in c


# -- the CLI -------------------------------------------------------------------------------------


def _invoke(db_url: str, *args: str) -> Result:
    # The CLI registers the connection passwords of its environment at start.
    env = {
        "DEFERRAL_DATABASE_URL": db_url,
        "DEFERRAL_CONN_VAULT": f"https://reader:{REGISTERED}@vault.example",
    }
    return CliRunner().invoke(cli, list(args), env=env)


async def _cli(db_url: str, *args: str) -> str:
    result = await anyio.to_thread.run_sync(functools.partial(_invoke, db_url, *args))
    assert result.exit_code == 0, result.output
    return result.stdout


async def test_the_cli_masks_listings_show_and_json(scene: Scene, db_url: str) -> None:
    runs = json.loads(await _cli(db_url, "runs", "list", "--json"))
    tasks = json.loads(await _cli(db_url, "tasks", "list", "--json"))
    triggers = json.loads(await _cli(db_url, "triggers", "list", "--json"))
    shown = json.loads(await _cli(db_url, "triggers", "show", str(scene.trigger_id), "--json"))
    texts = [
        await _cli(db_url, "tasks", "list", "--wide"),
        await _cli(db_url, "triggers", "list", "--wide"),
        await _cli(db_url, "triggers", "show", str(scene.trigger_id)),
    ]
    for text in [json.dumps(runs), json.dumps(tasks), json.dumps(triggers), json.dumps(shown)]:
        _none_shown(text)
    for text in texts:
        _none_shown(text)

    (run,) = runs
    assert run["conf"]["password"] == "***"
    assert run["conf"]["db"] == "postgresql://app:***@db.example:5432/x"
    assert run["conf"]["libpq"] == "host=db.example password='***' dbname=x"
    assert run["conf"]["callback"] == "https://hooks.example/cb?token=***&page=1"
    assert run["conf"]["headers"] == {
        "X-Api-Key": "***",
        "Ocp-Apim-Subscription-Key": "***",
        "Api-Key": "***",
    }
    assert run["conf"]["pwd"] == "***"
    assert run["conf"]["note"] == "kept-visible-conf"
    by_id = {t["task_id"]: t for t in tasks}
    assert by_id["a"]["rendered"]["env"] == {"API_TOKEN": "***", "REGION": "kept-visible-rendered"}
    assert "the vault said ***" in by_id["a"]["error"]  # registered from DEFERRAL_CONN_VAULT
    assert by_id["b"]["result"] == {
        "access_token": "***",
        "next": "https://api.example/x?token=***",
        "rows": 1234,
    }
    assert triggers[0]["kwargs"] == shown["kwargs"]
    assert shown["kwargs"] == {
        "url": "https://svc:***@jobs.example/x",
        "headers": {"X-Api-Key": "***", "Accept": "kept-visible-kwargs"},
        "pwd": "***",
        "poll": 5,
    }


# -- stored logs: a real engine's task and trigger lines ------------------------------------------

#: Known to the engine (as a connection password would be) before the task runs.
ENGINE_SECRET = "engine-known-secret-0001"


class LeakyTrigger(BaseTrigger):
    """Logs and prints secrets, then fires with some in its event."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_masking_surfaces.LeakyTrigger", {"api_key": self.api_key})

    async def run(self) -> Any:
        self.log.info("polling with X-Api-Key: %s and %s", self.api_key, ENGINE_SECRET)
        print(f"trigger printed https://u:trig-pw-0001@h/x?token={self.api_key}")
        yield TriggerEvent({"token": "event-tok-0001", "rows": 7})


class Leaky(BaseOperator):
    def execute(self, context: Context) -> None:
        logging.getLogger("myproj.leaky").info("vault gave %s", ENGINE_SECRET)
        print("connecting host=db password=task-pw-0001 dbname=x")
        self.defer(trigger=LeakyTrigger("trig-key-0002"), method_name="done")

    def done(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        logging.getLogger("myproj.leaky").warning("event %s", json.dumps(event))
        return {"password": "result-pw-0001", "rows": event["rows"]}


LOG_SECRETS = [
    ENGINE_SECRET, "trig-pw-0001", "trig-key-0002", "event-tok-0001", "task-pw-0001",
    "result-pw-0001",
]  # fmt: skip


async def test_stored_task_and_trigger_lines_are_masked(
    store: Store, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # (INFO lines are logged as in a worker's or triggerer's process, whose logging is at
    # INFO: this process's level depends on the tests before this one.)
    caplog.set_level(logging.INFO)
    masking.register_secret(ENGINE_SECRET)
    with DAG(dag_id="leaky") as dag:
        Leaky(task_id="t")
    async with run_engine(store, dags=[dag]) as engine:
        tis = await engine.run_dag(dag)
    assert tis["t"]["state"] == "success", tis
    logs = await store.task_logs("leaky", "run1", "t")
    (trigger_id,) = logs.trigger_ids
    trigger_logs = await store.trigger_logs(trigger_id)
    task_text = "\n".join(line.message for line in logs.lines)
    trigger_text = "\n".join(line.message for line in trigger_logs.lines)
    # What was stored (read back from the database as it is) holds no secret ...
    _none_shown(task_text + trigger_text, LOG_SECRETS)
    assert "vault gave ***" in task_text
    assert "password=***" in task_text
    assert '"token": "***"' in task_text
    assert "X-Api-Key: ***" in trigger_text
    assert "https://u:***@h/x?token=***" in trigger_text
    # ... and the commands that read it, in a process that knows none of the secrets, show none.
    masking.forget_secrets()
    for args in (["tasks", "logs", "leaky", "run1", "t"], ["triggers", "logs", str(trigger_id)]):
        out = await _cli(db_url, *args)
        assert "***" in out
        _none_shown(out, LOG_SECRETS)
    listed = json.loads(await _cli(db_url, "tasks", "list", "--json"))
    assert listed[0]["result"] == {"password": "***", "rows": 7}


def _fails_with_secrets() -> None:
    raise RuntimeError(f"vault gave {ENGINE_SECRET} for postgresql://u:raised-pw-0001@h/d")


async def test_a_stored_error_is_masked_by_the_process_that_raised_it(store: Store) -> None:
    # The worker knows the secret; whoever reads the error later need not.
    masking.register_secret(ENGINE_SECRET)
    with DAG(dag_id="raises") as dag:
        PythonOperator(task_id="t", python_callable=_fails_with_secrets)
    async with run_engine(store, dags=[dag]) as engine:
        tis = await engine.run_dag(dag)
    assert tis["t"]["state"] == "failed", tis
    (row,) = await store.list_task_instances(dag_id="raises")
    assert row.error is not None
    assert "RuntimeError: vault gave *** for postgresql://u:***@h/d" in row.error
    _none_shown(row.error, [ENGINE_SECRET, "raised-pw-0001"])


# -- deferral tasks test -------------------------------------------------------------------------

TASK_TEST_DAG = """
import logging
from engine import DAG
from operators.base import BaseOperator
from triggers.base import BaseTrigger, TriggerEvent

log = logging.getLogger(__name__)


class KeyedTrigger(BaseTrigger):
    def __init__(self, url, headers):
        self.url, self.headers = url, headers

    def serialize(self):
        return ("leakydag.KeyedTrigger", {"url": self.url, "headers": self.headers})

    async def run(self):
        self.log.info("polling %s with %s", self.url, self.headers)
        yield TriggerEvent({"access_token": "tt-event-0001", "rows": 3})


class Submit(BaseOperator):
    def execute(self, context):
        log.info("the vault said %s", "tt-conn-pw-0001")
        print("dsn: host=h password='tt pw 0002' dbname=x")
        self.defer(
            trigger=KeyedTrigger(
                "https://svc:tt-url-pw-0003@jobs.example/x",
                {"Ocp-Apim-Subscription-Key": "tt-key-0004"},
            ),
            method_name="done",
        )

    def done(self, context, event):
        log.info("resumed with %s", event)
        return {"token": "tt-result-0005", "rows": event["rows"]}


with DAG(dag_id="leakydag"):
    Submit(task_id="submit")
"""
TASK_TEST_SECRETS = [
    "tt-event-0001", "tt-conn-pw-0001", "tt pw 0002", "tt-url-pw-0003", "tt-key-0004",
    "tt-result-0005",
]  # fmt: skip


@pytest.mark.subprocess
@pytest.mark.parametrize("as_json", [True, False], ids=["json", "text"])
def test_tasks_test_output_is_masked(admin_url: str, tmp_path: Path, as_json: bool) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "leakydag.py").write_text(textwrap.dedent(TASK_TEST_DAG))
    env = child_env(
        test_triggers=False,
        DATABASE_URL=admin_url,
        CONN_VAULT="https://reader:tt-conn-pw-0001@vault.example",
    )
    done = subprocess.run(
        [sys.executable, "-m", "engine", "tasks", "test", "leakydag", "submit", "--dags", str(dags)]
        + (["--json"] if as_json else []),
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done
    _none_shown(done.stdout + done.stderr, TASK_TEST_SECRETS)
    if as_json:
        report = json.loads(done.stdout)
        assert report["state"] == "success"
        assert report["result"] == {"token": "***", "rows": 3}
        assert report["resumes"][0]["event"] == {"access_token": "***", "rows": 3}
        (deferral,) = report["deferrals"]
        assert deferral["kwargs"] == {
            "url": "https://svc:***@jobs.example/x",
            "headers": {"Ocp-Apim-Subscription-Key": "***"},
        }
        messages = [line["message"] for line in report["log"]]
        assert "the vault said ***" in messages
    else:
        assert "the vault said ***" in done.stdout
        assert "password='***'" in done.stdout + done.stderr
