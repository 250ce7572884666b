"""BashOperator gives its command a clean environment plus what the task asks for: the
worker's database URL and secrets never reach the command."""

from __future__ import annotations

import pytest

from engine import DAG
from engine.store import Store
from engine.testing import run_engine
from operators.bash import KEPT_ENV, BashOperator, clean_env
from triggers.base import decode_value

pytestmark = pytest.mark.anyio

#: Prints each variable's value, or "-" when it is not set; the last line is the task's result.
SHOW = (
    'printf "%s|%s|%s|%s|%s|%s\\n" "${DEFERRAL_DATABASE_URL--}" "${FAKE_SECRET--}" '
    '"${DEFERRAL_CONN_WAREHOUSE--}" "${GIVEN--}" "${PASSED--}" "${PATH:+path-set}"'
)


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a worker's environment holds in production: the database, a connection, a secret."""
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", "postgresql://app:dbpass@db/deferral")
    monkeypatch.setenv("DEFERRAL_CONN_WAREHOUSE", "postgresql://wh:whpass@wh/dw")
    monkeypatch.setenv("FAKE_SECRET", "hunter2")
    monkeypatch.setenv("PASSED", "from-worker")


async def _run(store: Store, **options: object) -> str:
    with DAG(dag_id="bash_env") as dag:
        BashOperator(task_id="show", bash_command=SHOW, **options)  # type: ignore[arg-type]
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["show"]["state"] == "success", tis["show"]["error"]
    result: str = decode_value(tis["show"]["result"])
    return result


@pytest.mark.usefixtures("worker_env")
async def test_the_database_url_and_secrets_do_not_reach_the_command(store: Store) -> None:
    assert await _run(store, env={"GIVEN": "yes"}) == "-|-|-|yes|-|path-set"


@pytest.mark.usefixtures("worker_env")
async def test_pass_env_names_worker_variables_the_command_may_see(store: Store) -> None:
    assert await _run(store, pass_env=["PASSED"]) == "-|-|-|-|from-worker|path-set"


@pytest.mark.usefixtures("worker_env")
async def test_append_env_false_gives_env_alone(store: Store) -> None:
    result = await _run(store, env={"GIVEN": "only", "PATH": "/usr/bin:/bin"}, append_env=False)
    assert result == "-|-|-|only|-|path-set"


def test_clean_env_keeps_the_documented_variables_only() -> None:
    environ = {
        "PATH": "/bin",
        "HOME": "/root",
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
        "DEFERRAL_DATABASE_URL": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
        "PYTHONPATH": "z",
    }
    assert clean_env(environ) == {"PATH": "/bin", "HOME": "/root", "LC_ALL": "C.UTF-8", "TZ": "UTC"}
    assert clean_env(environ, ["PYTHONPATH"])["PYTHONPATH"] == "z"
    assert "PATH" in KEPT_ENV
