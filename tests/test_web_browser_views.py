"""The status page's views (issue 23) in a real headless browser (Debian's chromium, driven by
Playwright), served by the status page's application in the test's own event loop over the
`views` scene of tests/test_web_views.py: the grid over 60 runs reaches the oldest run by its
pager's links, a click on a cell opens that task's try, the try selector shows try 1's log,
the graph draws its arrows, the Gantt view draws a run's spans, and the searches' forms
filter without JavaScript.

Skipped only where chromium is absent outside CI; in CI (``CI`` set) a missing browser fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from aiohttp import web

from engine.web.app import make_app
from tests.helpers import WAIT_S, free_port
from tests.test_web_views import DAY, HOUR, Views, views  # noqa: F401 (the scene's fixture)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

if CHROMIUM is None and not os.environ.get("CI"):
    pytest.skip("chromium is not installed (apt-get install chromium)", allow_module_level=True)

pytestmark = pytest.mark.anyio

#: Playwright's waits (milliseconds).
WAIT_MS = int(WAIT_S * 1000)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the browser runs in a thread beside the server's event loop


@pytest.fixture
async def base(views: Views) -> AsyncIterator[str]:  # noqa: F811 (the imported fixture)
    """The status page over the scene, on a local port; 57 more runs of "grid" (r4 to r60,
    scheduled an hour apart) make 60."""
    for n in range(4, 61):
        start = DAY + (n - 1) * HOUR
        await views.store.create_dag_run(
            "grid",
            f"r{n}",
            logical_date=start,
            run_type="scheduled",
            data_interval=(start, start + HOUR),
        )
    runner = web.AppRunner(make_app(views.store))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def _page(**options: Any) -> Iterator[Any]:
    assert CHROMIUM is not None, "chromium is not installed (CI installs it: .ci/run)"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(**options)
            page.set_default_timeout(WAIT_MS)
            yield page
        finally:
            browser.close()


async def _in_browser(check: Callable[[], None]) -> None:
    """Run the browser's part in a thread: the server answers in this event loop meanwhile."""
    await asyncio.to_thread(check)


async def test_the_grid_reaches_the_oldest_run_and_a_click_opens_its_try(base: str) -> None:
    def check() -> None:
        with _page() as page:
            page.goto(f"{base}/dag?dag_id=grid")
            pager = page.locator("#runs-pager")
            assert "runs 1 to 25 of 60" in pager.inner_text()
            heads = page.locator("#dag-grid th.run-head a")
            assert str(heads.first.get_attribute("href")).endswith("run_id=r60")  # newest first
            # Page by page to the oldest run, following the pager's links as a user would.
            page.locator("#runs-pager a", has_text="next").first.click()
            page.wait_for_url("**run_page=2**")
            assert "runs 26 to 50 of 60" in page.locator("#runs-pager").inner_text()
            page.locator("#runs-pager a", has_text="last").first.click()
            page.wait_for_url("**run_page=3**")
            assert "runs 51 to 60 of 60" in page.locator("#runs-pager").inner_text()
            assert str(heads.last.get_attribute("href")).endswith("run_id=r1")
            # r1's extract cell: the task page of that try.
            row = page.locator("#dag-grid tr", has=page.locator("th.task", has_text="extract"))
            row.locator("a.cell").last.click()
            page.wait_for_url("**/task?**")
            assert "run_id=r1" in page.url
            assert "task_id=extract" in page.url
            assert "extract" in page.locator("h1").inner_text()
            assert "try 1" in page.locator("#tries").inner_text()

    await _in_browser(check)


async def test_the_try_selector_shows_try_ones_log(base: str) -> None:
    def check() -> None:
        with _page() as page:
            page.goto(f"{base}/task?dag_id=grid&run_id=r3&task_id=extract")
            assert "try two's line" in page.locator("#log").inner_text()
            page.locator("#tries a", has_text="try 1").click()
            page.wait_for_url("**try=1**")
            assert "try one's line" in page.locator("#log").inner_text()
            assert "try two's line" not in page.content()
            assert "an earlier try" in page.locator("#earlier-try").inner_text()
            assert "first try failed" in page.locator("#error").inner_text()
            page.locator("#earlier-try a").click()
            page.wait_for_url(lambda url: "try=" not in url)
            assert "try two's line" in page.locator("#log").inner_text()

    await _in_browser(check)


async def test_the_graph_draws_arrows_and_the_deferred_task_apart(base: str) -> None:
    def check() -> None:
        with _page() as page:
            page.goto(f"{base}/dag?dag_id=grid&until=2026-01-01T02:30")  # r1..r3: r3
            svg = page.locator("#dag-graph svg.graph")
            edges = svg.locator("path.edge")
            assert edges.count() == 1  # extract >> load
            assert edges.first.get_attribute("marker-end") == "url(#arrow)"
            assert svg.locator("marker#arrow").count() == 1
            box = edges.first.bounding_box()
            assert box is not None
            assert box["width"] > 0  # drawn, from one column to the next
            assert "extract → load" in edges.first.locator("title").text_content()
            # wait is deferred in r3: its box is drawn dashed, unlike the others.
            deferred = svg.locator("g.node.state-deferred rect")
            running = svg.locator("g.node.state-running rect")
            dash = deferred.evaluate("e => getComputedStyle(e).strokeDasharray")
            assert dash not in ("", "none")
            assert running.evaluate("e => getComputedStyle(e).strokeDasharray") != dash

    await _in_browser(check)


async def test_the_gantt_view_draws_a_runs_spans(base: str) -> None:
    def check() -> None:
        with _page() as page:
            page.goto(f"{base}/run?dag_id=grid&run_id=r3")
            page.locator("#gantt-link").click()
            page.wait_for_url("**/gantt?**")
            bars = page.locator("svg rect.span")
            assert bars.count() >= 3
            titles = " ".join(
                bars.nth(i).locator("title").text_content() or "" for i in range(bars.count())
            )
            assert "deferred" in titles
            assert "running" in titles

    await _in_browser(check)


async def test_the_searches_filter_without_javascript(base: str) -> None:
    def check() -> None:
        with _page(java_script_enabled=False) as page:
            page.goto(f"{base}/dag?dag_id=grid")
            page.select_option("#run-filter select[name=run_type]", "backfill")
            page.locator("#run-filter button[type=submit]").click()
            page.wait_for_url("**run_type=backfill**")
            assert "runs 1 to 1 of 1" in page.locator("#runs-pager").inner_text()
            page.goto(f"{base}/dags")
            page.fill("input[name=name]", "oth")
            page.locator("input[name=name]").press("Enter")
            page.wait_for_url("**name=oth**")
            listed = page.locator("#dags a[href^='/dag?']").all_inner_texts()
            assert "other" in listed
            assert "grid" not in listed

    await _in_browser(check)
