"""DAG files that fail to import are recorded in the database by the scheduler's scan, and
shown by plain ``deferral dags list`` (stderr, exit 1), ``dags list --json``
(``import_errors``) and a banner on every status page, until the file is fixed or removed."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine.dags.dagbag import DagBag
from engine.scheduler.dagsync import sync_dags
from engine.store import Store
from engine.web.app import make_app
from tests.helpers import wait_until
from tests.processes import Children, explained

pytestmark = pytest.mark.anyio

GOOD = """
    from engine import DAG
    from operators.python import PythonOperator

    with DAG("fine"):
        PythonOperator(task_id="a", python_callable=lambda: 1)
"""
BROKEN = "import no_such_module_anywhere\n"
#: A secret in an error's text (a database URL's password) is masked wherever it is shown.
SECRET = "s3cret-pw"
LEAKY = f'raise RuntimeError("cannot reach postgresql://app:{SECRET}@db/x")\n'


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def _listing(env: dict[str, str]) -> dict[str, Any]:
    done = await anyio.to_thread.run_sync(functools.partial(_cli, env, "dags", "list", "--json"))
    listing: dict[str, Any] = json.loads(done.stdout)
    return listing


@pytest.mark.subprocess
async def test_the_schedulers_scan_records_an_import_error_until_the_file_is_fixed(
    children: Children, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "fine.py").write_text(textwrap.dedent(GOOD))
    (dags / "broken.py").write_text(BROKEN)
    children.env.update(DEFERRAL_DAGS_FOLDER=str(dags), DEFERRAL_DAG_RESCAN_INTERVAL_S="0.2")
    # The CLI without the folder: what the database says, as on a machine without the files.
    cli_env = {k: v for k, v in children.env.items() if k != "DEFERRAL_DAGS_FOLDER"}
    broken = str((dags / "broken.py").resolve())

    async def files_failing() -> list[str]:
        return [e["fileloc"] for e in (await _listing(cli_env))["import_errors"]]

    async with explained(children):
        children.start("scheduler", name="scheduler")

        async def recorded() -> bool:
            return await files_failing() == [broken]

        await wait_until(recorded, what="the scan to record the import error")
        listing = await _listing(cli_env)
        assert [d["dag_id"] for d in listing["dags"]] == ["fine"]
        (error,) = listing["import_errors"]
        assert "ModuleNotFoundError: No module named 'no_such_module_anywhere'" in error["error"]
        assert error["since"]

        plain = await anyio.to_thread.run_sync(functools.partial(_cli, cli_env, "dags", "list"))
        assert plain.returncode == 1, plain.stderr
        assert "fine" in plain.stdout
        assert f"DAG file {broken} failed to import" in plain.stderr
        assert "No module named 'no_such_module_anywhere'" in plain.stderr

        (dags / "broken.py").write_text(LEAKY)  # another error: recorded in its place

        async def replaced() -> bool:
            errors = (await _listing(cli_env))["import_errors"]
            return bool(errors) and "RuntimeError" in errors[0]["error"]

        await wait_until(replaced, what="the changed error to be recorded")
        (error,) = (await _listing(cli_env))["import_errors"]
        assert SECRET not in error["error"]

        (dags / "broken.py").write_text(textwrap.dedent(GOOD).replace('"fine"', '"mended"'))

        async def cleared() -> bool:
            return await files_failing() == []

        await wait_until(cleared, what="the fixed file's error to go")
        plain = await anyio.to_thread.run_sync(functools.partial(_cli, cli_env, "dags", "list"))
        assert plain.returncode == 0, plain.stderr
        assert "failed to import" not in plain.stderr
        assert "mended" in plain.stdout


async def test_a_scan_writes_an_unchanged_error_once_and_drops_removed_files(
    store: Store, tmp_path: Path
) -> None:
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / "broken.py").write_text(BROKEN)
    (dags / "other.py").write_text(BROKEN)
    bag = DagBag(dags)
    await sync_dags(store, bag)
    first = {e.fileloc: e for e in await store.import_errors()}
    assert set(first) == {str((dags / n).resolve()) for n in ("broken.py", "other.py")}
    # Rescanned unchanged: nothing written (the row keeps when it was first seen).
    folder = str(bag.folder)
    assert await store.record_import_errors(folder, bag.import_errors) == (0, 0)
    await sync_dags(store, bag)
    assert {e.fileloc: e.since for e in await store.import_errors()} == {
        path: row.since for path, row in first.items()
    }
    (dags / "other.py").unlink()
    await sync_dags(store, bag)
    assert [e.fileloc for e in await store.import_errors()] == [str((dags / "broken.py").resolve())]
    # A file still importing keeps its row as it was (its outcome is not known yet).
    written, gone = await store.record_import_errors(folder, {}, [str(dags / "broken.py")])
    assert (written, gone) == (0, 0)
    assert len(await store.import_errors()) == 1


async def test_every_page_shows_a_banner_while_a_file_fails_to_import(
    store: Store, tmp_path: Path
) -> None:
    folder = str(tmp_path / "dags")
    broken = f"{folder}/broken.py"
    app = make_app(store)
    async with TestClient(TestServer(app)) as client:
        for path in ("/fleet", "/dags", "/triggers", "/audit"):
            text = await (await client.get(path)).text()
            assert "failed to import" not in text, path

        traceback = (
            "Traceback (most recent call last):\n"
            f'  File "{broken}", line 1, in <module>\n'
            f"RuntimeError: cannot reach postgresql://app:{SECRET}@db/x\n"
        )
        await store.record_import_errors(folder, {broken: traceback})
        for path in ("/fleet", "/dags", "/triggers", "/audit"):
            response = await client.get(path)
            text = await response.text()
            assert response.status == 200, text
            assert 'id="import-errors"' in text, path
            assert "1 DAG file(s) failed to import" in text, path
            assert broken in text
            assert "RuntimeError: cannot reach postgresql://app:" in text
            assert SECRET not in text

        await store.record_import_errors(folder, {})  # the file was fixed
        text = await (await client.get("/dags")).text()
        assert "failed to import" not in text
