"""The status page against other sites, in a real headless browser (chromium, see
tests/test_web_browser.py) on a running ``deferral webserver --enable-actions``: a page of
another origin that frames the status page gets nothing shown, and an action whose ``next``
holds a tab (which the browser drops) brings the browser back to the site, not elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

import pytest

from engine import DAG
from engine.store import Store
from operators.python import PythonOperator
from tests.conftest import TEST_FERNET_KEY
from tests.helpers import free_port
from tests.processes import Children
from tests.test_web_browser import CHROMIUM, WAIT_MS, _chromium, _goto_when_up

if CHROMIUM is None:  # (test_web_browser skips, or in CI fails, at import without it)
    pytest.skip("chromium is not installed", allow_module_level=True)

pytestmark = pytest.mark.subprocess

TOKEN = "t0ken-for-the-browser"


async def _record_dag(db_url: str) -> None:
    from engine.security.keys import Keyring

    store = await Store.connect(db_url, pool_size=1, keyring=Keyring([TEST_FERNET_KEY]))
    try:
        with DAG(dag_id="framed") as dag:
            PythonOperator(task_id="a", python_callable=print)
        await store.upsert_dag("framed", "framed.py", dag.serialize_tasks(), None)
    finally:
        await store.close()


@contextlib.contextmanager
def _another_site(html: str) -> Iterator[str]:
    """An HTTP server of another origin (the loopback address, another port: Chromium refuses
    a public page's frames of a loopback one whatever the framed page says), serving
    ``html``; its address."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_another_site_cannot_frame_the_page_nor_be_redirected_to(
    children: Children, db_url: str, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    asyncio.run(_record_dag(db_url))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    children.env["DEFERRAL_WEBSERVER_TOKEN"] = TOKEN
    children.start("webserver", "--port", str(port), "--enable-actions", name="webserver")
    dag_page = f"{base}/dag?" + urlencode({"dag_id": "framed"})
    try:
        with _chromium() as browser:
            page = browser.new_page()
            page.set_default_timeout(WAIT_MS)
            _goto_when_up(page, dag_page)
            expect(page.locator("h1")).to_have_text("DAG framed")

            # A page of another origin frames the status page: the browser refuses to show
            # it there. (A control frame of that page's own shows the frames load.)
            framing = (
                f'<iframe name="status" src="{base}/fleet"'
                " onload=\"document.body.dataset.framed = 'loaded'\"></iframe>"
                '<iframe name="control" srcdoc="<h1>control</h1>"></iframe>'
            )
            with _another_site(framing) as attacker:
                page.goto(attacker)
                control = page.frame_locator("[name=control]").locator("h1")
                expect(control).to_have_text("control")
                # (The frame's load event fires for the refusal's error page too.)
                page.wait_for_function("document.body.dataset.framed === 'loaded'")
                framed = page.frame(name="status")
                assert framed is not None
                assert not framed.url.startswith(base), framed.url  # an error page instead
                assert "Fleet" not in framed.content(), "the status page was shown in a frame"
                page.screenshot(path=str(tmp_path / "framed.png"))

            # An action whose next holds a tab: the browser ends on the DAG's page.
            page.goto(dag_page)
            page.evaluate(
                "document.querySelector('form[action=\"/actions/pause\"] input[name=next]')"
                ".value = '/\\t/example.com'"
            )
            page.fill("form[action='/actions/pause'] input[name=token]", TOKEN)
            with page.expect_navigation():
                page.click("form[action='/actions/pause'] button")
            assert page.url == dag_page, page.url
            expect(page.locator("#dag-schedule")).to_contain_text("paused")
    except BaseException:
        print(children.output())
        raise
