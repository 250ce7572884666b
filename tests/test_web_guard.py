"""The status page against other sites, over HTTP (aiohttp's client and server on a socket):
every response forbids framing (pages, error pages, static files, aiohttp's own 404 and 405),
and an action's ``next`` leads only to a page of this site, whatever a browser would make of
it (tabs and newlines it drops, ``\\`` it reads as ``/``, schemes, encodings, user info)."""

from __future__ import annotations

import datetime as dt
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urljoin, urlsplit

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engine import DAG
from engine.store import Store
from engine.web.app import make_app
from engine.web.guard import local_path
from operators.python import PythonOperator

pytestmark = pytest.mark.anyio

TOKEN = "t0ken-for-guard-tests"
DAG_ID = "guarded"
DAG_PAGE = "/dag?" + urlencode({"dag_id": DAG_ID})
TASK_PAGE = "/task?" + urlencode({"dag_id": DAG_ID, "run_id": "r1", "task_id": "a"})

#: ``next`` values that a browser would follow to another site (or that are no page path).
HOSTILE = [
    "/\t/example.com",
    "/\n/example.com",
    "/\r\n/example.com",
    "/\r/example.com",
    "\t//example.com",
    " //example.com",
    "\x00//example.com",
    "/\x0b/example.com",
    "/\x7f/example.com",
    "//example.com",
    "//example.com/dag",
    "///example.com",
    "/\\example.com",
    "\\/example.com",
    "\\\\example.com",
    "/\\/example.com",
    "/%09/example.com",
    "/%0a/example.com",
    "/%2F/example.com",
    "/%2f%2fexample.com",
    "/%5Cexample.com",
    "%2F%2Fexample.com",
    "https:example.com",
    "https:/example.com",
    "https://example.com/",
    "http://127.0.0.1@example.com/",
    "//user:pass@example.com/",
    "/@example.com",
    "javascript:alert(1)",
    "JaVaScRiPt:alert(1)",
    "data:text/html,<script>alert(1)</script>",
    "example.com",
    "dag?dag_id=x",
    "/\u3002example.com",
    "/\uff0f/example.com",
    "/dag/../\\example.com",
    "",
    "/" + "a" * 5000,
]


@pytest.fixture
async def acting(store: Store) -> AsyncIterator[TestClient[Any, Any]]:
    """A page with actions enabled, on a DAG with one failed task (so both the pause and the
    mark actions have something to act on)."""
    with DAG(dag_id=DAG_ID) as dag:
        PythonOperator(task_id="a", python_callable=print)
    await store.upsert_dag(DAG_ID, "guarded.py", dag.serialize_tasks(), None)
    await store.create_dag_run(DAG_ID, "r1", logical_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    async with TestClient(TestServer(make_app(store, token=TOKEN))) as c:
        yield c


def _assert_unframeable(response: Any, what: str) -> None:
    assert response.headers.get("X-Frame-Options") == "DENY", what
    csp = response.headers.get("Content-Security-Policy", "")
    assert "frame-ancestors 'none'" in csp, (what, csp)
    assert response.headers.get("X-Content-Type-Options") == "nosniff", what


async def test_no_response_of_the_page_can_be_framed(acting: TestClient[Any, Any]) -> None:
    for path, status in (
        ("/fleet", 200),
        ("/dags", 200),
        (DAG_PAGE, 200),
        ("/run?" + urlencode({"dag_id": DAG_ID, "run_id": "r1"}), 200),
        (TASK_PAGE, 200),
        ("/triggers", 200),
        ("/audit", 200),
        ("/pools", 200),
        ("/dag?" + urlencode({"dag_id": "nope"}), 404),  # the site's error page
        ("/triggers?triggerer=x", 400),
        ("/no-such-page", 404),  # aiohttp's own
        ("/static/live.js", 200),
        ("/static/style.css", 200),
        ("/static/nope.js", 404),
        ("/", 302),
    ):
        response = await acting.get(path, allow_redirects=False)
        assert response.status == status, path
        _assert_unframeable(response, path)
    for path, status in (
        ("/actions/pause", 403),  # no token
        ("/fleet", 405),
    ):
        response = await acting.post(path, data={"dag_id": DAG_ID}, allow_redirects=False)
        assert response.status == status, path
        _assert_unframeable(response, f"POST {path}")
    response = await acting.post(
        "/actions/pause",
        data={"dag_id": DAG_ID, "paused": "1", "token": TOKEN, "next": "/dags"},
        allow_redirects=False,
    )
    assert (response.status, response.headers["Location"]) == (303, "/dags")
    _assert_unframeable(response, "an action's redirect")


def _same_site(location: str) -> bool:
    """Where a browser on http://site/ goes with ``location``, read as browsers read it
    (tabs and newlines dropped, ``\\`` as ``/``): still http://site/."""
    cleaned = "".join(c for c in location if c not in "\t\n\r").replace("\\", "/").lstrip()
    return urljoin("http://site/dags", cleaned).startswith("http://site/")


async def test_a_hostile_next_falls_back_to_the_page_acted_on(
    store: Store, acting: TestClient[Any, Any]
) -> None:
    for target in HOSTILE:
        response = await acting.post(
            "/actions/pause",
            data={"dag_id": DAG_ID, "paused": "0", "token": TOKEN, "next": target},
            allow_redirects=False,
        )
        assert response.status == 303, (target, await response.text())
        assert response.headers["Location"] == DAG_PAGE, target
    # The task actions fall back to the task's page (each mark a new state: marking a task
    # the state it is in changes nothing and is not audited).
    for target, state in (
        ("/\t/example.com", "failed"),
        ("/\n/example.com", "success"),
        ("//example.com", "failed"),
    ):
        response = await acting.post(
            "/actions/mark",
            data={
                **{"dag_id": DAG_ID, "run_id": "r1", "task_id": "a"},
                **{"state": state, "token": TOKEN, "next": target},
            },
            allow_redirects=False,
        )
        assert response.status == 303, target
        assert response.headers["Location"] == TASK_PAGE, target
    # Every action was taken (and audited): only the redirect was refused.
    assert len(await store.list_audit()) == len(HOSTILE) + 3


async def test_a_next_of_this_site_is_followed_rebuilt(acting: TestClient[Any, Any]) -> None:
    for target, location in (
        ("/dags", "/dags"),
        ("/", "/"),
        ("/triggers?classpath=tests.x&min_age_s=5", "/triggers?classpath=tests.x&min_age_s=5"),
        (TASK_PAGE, TASK_PAGE),
        ("/run?dag_id=a%20b&run_id=r%2F1#grid", "/run?dag_id=a+b&run_id=r%2F1"),
        ("/triggers?classpath=%3Cscript%3E", "/triggers?classpath=%3Cscript%3E"),
        ("/triggers?next=//example.com", "/triggers?next=%2F%2Fexample.com"),
    ):
        response = await acting.post(
            "/actions/pause",
            data={"dag_id": DAG_ID, "paused": "1", "token": TOKEN, "next": target},
            allow_redirects=False,
        )
        assert response.status == 303, target
        # (aiohttp writes the query in its own normal form: %2F and / are the same there.)
        assert _parsed(response.headers["Location"]) == _parsed(location), target
        # Followed, it is a page of the site.
        assert (await acting.get(location)).status in (200, 404), location


def _parsed(location: str) -> tuple[str, list[tuple[str, str]]]:
    parts = urlsplit(location)
    assert (parts.scheme, parts.netloc) == ("", ""), location
    return parts.path, parse_qsl(parts.query, keep_blank_values=True)


def test_every_path_accepted_stays_on_the_site() -> None:
    """The rule itself: whatever it accepts, a browser reads as a path of this site."""
    for target in HOSTILE:
        assert local_path(target) is None, target
    for raw in (
        "/x?a=\t//example.com",  # (refused: a raw tab, though only in the query)
        "/x/",
        "/x//y",
        "/x/%2e%2e",
    ):
        accepted = local_path(raw)
        assert accepted is None or _same_site(accepted), raw
    assert local_path("/x/") == "/x/"
    assert local_path("/x//y") is None
