"""The runnable examples in docs/ run, and the tutorial's code is the code of those files."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engine.dags.dagbag import DagBag, add_to_sys_path
from engine.store import Store
from engine.testing import run_engine
from tests.helpers import wait_until
from tests.sensor_helpers import http_server, task_instance

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "docs" / "examples"


@pytest.fixture
def examples() -> Any:
    add_to_sys_path(EXAMPLES)
    import job_api
    import submit_and_wait

    return submit_and_wait, job_api


def test_the_trigger_check_script_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "check_trigger.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "hello: ok" in done.stdout


def test_the_example_dag_folder_loads() -> None:
    bag = DagBag(EXAMPLES)
    dags = bag.collect()
    assert bag.import_errors == {}
    assert "submit_and_wait" in dags


@pytest.mark.anyio
@pytest.mark.parametrize("outcome", ["done", "failed"])
async def test_submit_and_wait_end_to_end(
    store: Store, examples: Any, outcome: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    submit_and_wait, job_api = examples
    from engine import DAG

    async with http_server(job_api.make_app()) as base:
        monkeypatch.setenv("DEFERRAL_CONN_JOBS_API", base)
        with DAG(dag_id="jobs") as dag:
            train = submit_and_wait.SubmitJob(
                task_id="train", command="train", duration_s=None, poll_interval=0.02
            )
            submit_and_wait.report(train.output)
        async with run_engine(store, slots=1) as engine:
            await engine.start_run(dag)

            async def deferred() -> bool:
                return (await task_instance(store, "jobs", "train")).state == "deferred"

            await wait_until(deferred, what="the task to defer")

            # The only slot is free while the job runs (the worker lets go of the task just
            # after the deferral is committed).
            async def slot_free() -> bool:
                return not engine.worker.running

            await wait_until(slot_free, what="the worker slot to be free")
            async with aiohttp.ClientSession() as session:
                url = f"{base}/jobs/job-1/finish"
                async with session.post(url, json={"state": outcome}) as response:
                    assert response.status == 200
            tis = await engine.finish("jobs")
    train = tis["train"]
    if outcome == "done":
        from triggers.base import decode_value

        assert train["state"] == "success"
        assert decode_value(train["result"]) == "train: ok"
        # The TaskFlow task after it got the resumed method's return value.
        assert decode_value(tis["report"]["result"]).endswith(": train: ok")
    else:
        assert train["state"] == "failed"
        assert "job job-1 failed" in train["error"]


def _tutorial_blocks() -> list[tuple[str, str]]:
    text = (REPO / "docs" / "tutorial.md").read_text()
    pattern = re.compile(r"<!-- from: (\S+) -->\s*```(?:python|py)\n(.*?)```", re.DOTALL)
    return pattern.findall(text)


def test_the_tutorial_quotes_its_runnable_files_verbatim() -> None:
    blocks = _tutorial_blocks()
    assert len(blocks) >= 4
    for path, code in blocks:
        source = (REPO / path).read_text()
        # ruff formats the markdown too, dedenting a quoted method: compare at any indent.
        block = textwrap.dedent(code).strip()
        found = any(textwrap.indent(block, " " * n) in source for n in (0, 4, 8))
        assert found, f"tutorial block drifted from {path}:\n{code}"


@pytest.mark.anyio
async def test_the_harness_example_runs(store: Store, tmp_path: Path) -> None:
    """docs/examples/engine_in_a_test.py, as the how-to shows it: drain, then a state wait."""
    add_to_sys_path(EXAMPLES)
    import engine_in_a_test

    await engine_in_a_test.check_pipeline(store, tmp_path / "ready")


def test_the_async_trigger_tests_of_the_how_to_pass() -> None:
    """docs/examples/_tests/test_job_trigger.py, run by pytest as a user would run it: async
    tests on anyio's plugin, the anyio_backend fixture, a trigger's log records."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(EXAMPLES / "_tests" / "test_job_trigger.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout, done.stdout


def test_the_example_dags_folder_skips_the_tests_folder() -> None:
    bag = DagBag(EXAMPLES)
    assert not any("_tests" in str(path) for path in bag.files())
