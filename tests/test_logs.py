"""Log lines carry the ids of what emitted them: a trigger's lines name its trigger, a task's
lines name the task instance."""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Callable

import msgspec
import pytest

from engine import DAG
from engine.runtime import logs
from engine.store import Store
from engine.testing import run_engine
from tests.log_triggers import ChattyOperator

pytestmark = pytest.mark.anyio


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[str, dict[str, object]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.getMessage(), dict(logs.bound())))


async def test_trigger_and_task_log_lines_carry_their_ids(store: Store) -> None:
    capture = _Capture()
    logging.getLogger("tests.log_triggers").addHandler(capture)
    logging.getLogger("tests.log_triggers").setLevel(logging.INFO)
    try:
        with DAG(dag_id="chatty") as dag:
            ChattyOperator(task_id="talk")
        async with run_engine(store) as engine:
            tis = await engine.run_dag(dag)
    finally:
        logging.getLogger("tests.log_triggers").removeHandler(capture)
    assert tis["__run__"]["state"] == "success"
    by_message = dict(capture.lines)
    trigger_ids = by_message["hello from the trigger talk"]
    assert trigger_ids["classpath"] == "tests.log_triggers.ChattyTrigger"
    assert isinstance(trigger_ids["trigger"], int)
    for message in ("hello from execute", "hello from the resumed method"):
        ids = by_message[message]
        assert (ids["dag"], ids["run"], ids["task"], ids["attempt"]) == (
            "chatty",
            "run1",
            "talk",
            1,
        )


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_formatters_print_the_bound_ids(fmt: str) -> None:
    stream = io.StringIO()
    logs.configure_logging("INFO", fmt)
    root = logging.getLogger()
    handler = next(h for h in root.handlers if getattr(h, "_deferral", False))
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    try:
        with logs.binding(trigger=42, classpath="a.B"):
            logging.getLogger("x").info("fired")
    finally:
        root.removeHandler(handler)
    line = stream.getvalue().strip()
    if fmt == "json":
        doc = msgspec.json.decode(line)
        assert (doc["msg"], doc["trigger"], doc["classpath"]) == ("fired", 42, "a.B")
    else:
        assert "[trigger=42 classpath=a.B] fired" in line


def _lines(level: str, emit: Callable[[], None]) -> list[str]:
    stream = io.StringIO()
    root = logging.getLogger()
    saved = {name: logging.getLogger(name).level for name in logs.LIBRARY_LOGGERS}
    logs.configure_logging(level, "text")
    handler = next(h for h in root.handlers if getattr(h, "_deferral", False))
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    try:
        emit()
    finally:
        root.removeHandler(handler)
        for name, old in saved.items():
            logging.getLogger(name).setLevel(old)
    return stream.getvalue().splitlines()


def test_text_lines_name_no_source_file_or_line() -> None:
    def emit() -> None:
        logging.getLogger("engine.worker").info("claimed 3 task(s)")
        logging.getLogger("engine.triggerer").error("it failed")

    lines = _lines("INFO", emit)
    assert len(lines) == 2, lines
    assert lines[0].endswith(" engine.worker claimed 3 task(s)"), lines
    for line in lines:
        assert not re.search(r"\w+\.py:\d+", line), line


def test_library_lines_below_warning_are_left_out_except_at_debug() -> None:
    def emit() -> None:
        for name in ("asyncpg.pool", "aiohttp.client", "matplotlib.font_manager", "asyncio"):
            logging.getLogger(name).info("library chatter from %s", name)
        logging.getLogger("asyncpg").warning("a library warning")
        logging.getLogger("mydags.orders").info("user code speaks")

    lines = _lines("INFO", emit)
    assert not [line for line in lines if "library chatter" in line], lines
    assert any("a library warning" in line for line in lines), lines
    assert any("user code speaks" in line for line in lines), lines
    debug = _lines("DEBUG", emit)
    assert len([line for line in debug if "library chatter" in line]) == 4, debug


def test_json_lines_carry_the_process_and_a_tasks_ids_as_fields() -> None:
    stream = io.StringIO()
    logs.configure_logging("INFO", "json")
    root = logging.getLogger()
    handler = next(h for h in root.handlers if getattr(h, "_deferral", False))
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    try:
        with logs.binding(dag="d", run="r1", task="t", attempt=2):
            logging.getLogger("engine.worker").info("succeeded")
    finally:
        root.removeHandler(handler)
    doc = msgspec.json.decode(stream.getvalue().strip())
    assert (doc["dag"], doc["run"], doc["task"], doc["attempt"]) == ("d", "r1", "t", 2)
    assert doc["process"] == logs.process_name()
    assert doc["pid"] == os.getpid()
    assert (doc["level"], doc["logger"], doc["msg"]) == ("info", "engine.worker", "succeeded")
