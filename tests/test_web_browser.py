"""The status page in a real headless browser: Debian's chromium (``.ci/run`` installs it),
driven by Playwright, on the pages of a running ``deferral standalone``: the Fleet, Task try,
Triggers and Run pages, their content, the live refresh (a task's state changes on the page
without a reload) and the page with JavaScript off. Screenshots go to the test's temp folder.

Skipped only where chromium is absent outside CI; in CI (``CI`` set) a missing browser fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from engine.store import Store
from tests.conftest import TEST_FERNET_KEY
from tests.helpers import WAIT_S, free_port
from tests.processes import Children, explained

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

if CHROMIUM is None and not os.environ.get("CI"):
    pytest.skip("chromium is not installed (apt-get install chromium)", allow_module_level=True)

pytestmark = pytest.mark.subprocess

#: Playwright's waits (milliseconds).
WAIT_MS = int(WAIT_S * 1000)

DAG_FILE = """
from engine import DAG
from operators.sensors import FileSensor

with DAG(dag_id="browser") as dag:
    FileSensor(task_id="wait", filepath={flag!r}, deferrable=True, poke_interval=0.2)
"""


async def _create_run(db_url: str) -> None:
    from engine.security.keys import Keyring

    store = await Store.connect(db_url, pool_size=1, keyring=Keyring([TEST_FERNET_KEY]))
    try:
        deadline = time.monotonic() + WAIT_S
        while "browser" not in {d.dag_id for d in await store.list_dags()}:
            assert time.monotonic() < deadline, "the scheduler did not record the DAG"
            await asyncio.sleep(0.05)
        await store.create_dag_run("browser", "r1", logical_date=await store.now())
    finally:
        await store.close()


@contextlib.contextmanager
def _chromium() -> Iterator[Any]:
    assert CHROMIUM is not None, "chromium is not installed (CI installs it: .ci/run)"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def _goto_when_up(page: Any, url: str) -> None:
    """Load ``url``, retrying while the webserver is not listening yet."""
    from playwright.sync_api import Error

    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            page.goto(url)
            return
        except Error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # the server is starting: look again


def test_the_pages_of_a_running_standalone_in_a_browser(
    children: Children, db_url: str, tmp_path: Path
) -> None:

    dags = tmp_path / "dags"
    dags.mkdir()
    flag = tmp_path / "go.flag"
    (dags / "browser_dag.py").write_text(DAG_FILE.format(flag=str(flag)))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    children.start(
        "standalone", "--dags", str(dags), "--webserver-port", str(port), name="standalone"
    )
    shots = tmp_path / "screenshots"
    shots.mkdir()
    task_page = f"{base}/task?" + urlencode(
        {"dag_id": "browser", "run_id": "r1", "task_id": "wait"}
    )

    async def run() -> None:
        async with explained(children):
            await _create_run(db_url)

    asyncio.run(run())  # (before the browser: Playwright's sync API runs a loop of its own)
    with _chromium() as browser:
        _browse(browser, base, task_page, flag, shots, children)
    assert f"status page: {base}/" in children.output()  # standalone printed its address
    assert {p.name for p in shots.iterdir()} >= {
        "fleet.png",
        "task-deferred.png",
        "triggers.png",
        "task-success.png",
        "run.png",
        "task-no-js.png",
    }


def _browse(
    browser: Any, base: str, task_page: str, flag: Path, shots: Path, children: Children
) -> None:
    from playwright.sync_api import expect

    try:
        page = browser.new_page()
        page.set_default_timeout(WAIT_MS)

        # Fleet: the three processes of the standalone, each with its host and pid.
        _goto_when_up(page, f"{base}/fleet")
        for table in ("#fleet-schedulers", "#fleet-workers", "#fleet-triggerers"):
            expect(page.locator(table)).to_contain_text(socket.gethostname(), timeout=WAIT_MS)
        expect(page.locator("#live-status")).to_contain_text("live")
        page.screenshot(path=str(shots / "fleet.png"), full_page=True)

        # Task try: deferred on the file trigger (the live refresh shows it once it is).
        page.goto(task_page)
        expect(page.locator("#task-state")).to_contain_text("deferred", timeout=WAIT_MS)
        expect(page.locator("#deferral")).to_contain_text("triggers.file.FileTrigger")
        expect(page.locator("#deferral")).to_contain_text(str(flag))
        page.screenshot(path=str(shots / "task-deferred.png"), full_page=True)

        # Triggers: the trigger counted under its class, the task among the oldest waits.
        page.goto(f"{base}/triggers")
        expect(page.locator("#trigger-classes")).to_contain_text("triggers.file.FileTrigger")
        expect(page.locator("#oldest-waits")).to_contain_text("browser / r1 / wait")
        page.screenshot(path=str(shots / "triggers.png"), full_page=True)

        # The live refresh: the file appears, the task resumes and succeeds, and the page
        # shows it without being reloaded (the mark set on this window survives).
        page.goto(task_page)
        expect(page.locator("#task-state")).to_contain_text("deferred")
        page.evaluate("window.__sameDocument = true")
        flag.write_text("go")
        expect(page.locator("#task-state")).to_contain_text("success", timeout=WAIT_MS)
        assert page.evaluate("window.__sameDocument === true"), "the page was reloaded"
        assert int(page.evaluate("document.body.dataset.refreshes || '0'")) >= 1
        page.screenshot(path=str(shots / "task-success.png"), full_page=True)

        # Run: the grid and the graph.
        page.goto(f"{base}/run?" + urlencode({"dag_id": "browser", "run_id": "r1"}))
        expect(page.locator("#grid")).to_contain_text("wait")
        expect(page.locator("#grid .sq.state-success")).to_have_count(1)
        expect(page.locator("svg.graph .node")).to_have_count(1)
        page.screenshot(path=str(shots / "run.png"), full_page=True)

        # JavaScript off: the same content, no live refresh.
        context = browser.new_context(java_script_enabled=False)
        still = context.new_page()
        still.goto(task_page)
        expect(still.locator("#task-state")).to_contain_text("success")
        expect(still.locator("#live-status")).to_contain_text("reload for fresh data")
        still.screenshot(path=str(shots / "task-no-js.png"), full_page=True)
        context.close()
    except BaseException:
        print(children.output())
        raise
