"""Stored logs are bounded whatever a task or a trigger prints: lines per second per trigger or
try, a total per try and per trigger (one ``N lines dropped`` line past it), a length per line
(cut, saying how much), and the memory a process holds for lines waiting to be written.

The sink's rules on a real store first, then real worker and triggerer processes running a
thread task, an async task, an isolated task (child process) and a trigger that each print
200,000 lines and a few huge ones."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine.store import LogLine, Store
from engine.usercode.logsink import LINE_OVERHEAD, LogLimits, LogSink
from tests.processes import Children, explained, process_env

pytestmark = pytest.mark.anyio

#: A note the sink stores in place of dropped lines.
DROPPED = re.compile(r"^(\d+) lines dropped \((.*)\)$")


def _notes(lines: list[LogLine]) -> list[tuple[int, str]]:
    found = [DROPPED.match(line.message) for line in lines if line.logger == "deferral"]
    return [(int(m.group(1)), m.group(2)) for m in found if m is not None]


def _user(lines: list[LogLine]) -> list[LogLine]:
    return [line for line in lines if line.logger != "deferral"]


async def _task_lines(store: Store, *key: Any) -> list[LogLine]:
    lines: list[LogLine] = []
    after = 0
    while True:
        page = await store.task_logs(*key, after_seq=after, limit=10_000)
        lines += page.lines
        if not page.lines:
            return lines
        after = page.next_seq


async def _trigger_lines(store: Store, trigger_id: int) -> list[LogLine]:
    lines: list[LogLine] = []
    after = 0
    while True:
        page = await store.trigger_logs(trigger_id, after_seq=after, limit=10_000)
        lines += page.lines
        if not page.lines:
            return lines
        after = page.next_seq


# -- the sink's rules -----------------------------------------------------------------------


async def test_a_try_keeps_its_lines_per_second_however_many_lines_wait(store: Store) -> None:
    # No periodic write comes (an hour apart; 1,000 lines per write), while the writer runs:
    # a thread printing 20,000 lines leaves the newest 1,000 and one line saying how many
    # went. (1,000 lines waiting used to wake the writer, which wrote them and made room.)
    sink = LogSink(store, "task", flush_interval_s=3600, buffer_lines=1000)
    sink.open()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(sink.run)
            token = sink.bind_task(1, "d", "r", "t", 1, fresh=True)
            try:
                await anyio.to_thread.run_sync(lambda: [print(f"line {n}") for n in range(20_000)])
            finally:
                sink.unbind(token)
            tg.cancel_scope.cancel()
        await sink.flush()
        token = sink.bind_task(1, "d", "r", "t", 1)
        try:
            print("the next second")
        finally:
            sink.unbind(token)
        await sink.flush_keys([(1, 1)])
    finally:
        await sink.close()
    lines = await _task_lines(store, "d", "r", "t", 1)
    assert [line.message for line in lines] == [
        "19000 lines dropped (more than 1000 lines in a second: setting log_max_lines_per_s)",
        *(f"line {n}" for n in range(19_000, 20_000)),
        "the next second",
    ]


async def test_past_its_total_a_try_stores_nothing_more_and_one_line_says_how_many_went(
    store: Store,
) -> None:
    sink = LogSink(store, "task", limits=LogLimits(max_try_bytes=1000))
    sink.open()
    try:
        token = sink.bind_task(1, "d", "r", "t", 1, fresh=True)
        try:
            for n in range(25):
                print(f"{n:02} " + "x" * 97)  # 100 bytes
            await sink.flush()  # (a periodic write: no note yet, the try goes on)
            for n in range(25, 30):
                logging.getLogger("user").warning("%02d %s", n, "y" * 97)
        finally:
            sink.unbind(token)
        await sink.flush_keys([(1, 1)])  # the try ends: its note
        sink.end((1, 1))
        await sink.flush()
    finally:
        await sink.close()
    lines = await _task_lines(store, "d", "r", "t", 1)
    assert [line.message[:2] for line in _user(lines)] == [f"{n:02}" for n in range(10)]
    assert sum(len(line.message.encode()) for line in _user(lines)) == 1000
    assert _notes(lines) == [
        (20, "this try's log reached its limit of 1000 bytes: setting log_max_try_bytes")
    ]
    assert lines[-1].level == "WARNING"


async def test_a_try_s_total_counts_what_other_workers_stored_for_it(store: Store) -> None:
    limits = LogLimits(max_try_bytes=1000)
    first, second = LogSink(store, "task", limits=limits), LogSink(store, "task", limits=limits)
    for sink in (first, second):
        sink.open()
    try:
        token = first.bind_task(1, "d", "r", "t", 1, fresh=True)
        try:
            for n in range(8):
                print(f"{n:02} " + "a" * 97)
        finally:
            first.unbind(token)
        first.end((1, 1))
        await first.flush()
        # Resumed on another worker: 200 bytes are left of the try's total.
        token = second.bind_task(1, "d", "r", "t", 1)
        try:
            for n in range(8, 13):
                print(f"{n:02} " + "b" * 97)
        finally:
            second.unbind(token)
        await second.flush_keys([(1, 1)])
    finally:
        for sink in (first, second):
            await sink.close()
    lines = await _task_lines(store, "d", "r", "t", 1)
    assert [line.message[:2] for line in _user(lines)] == [f"{n:02}" for n in range(10)]
    assert [n for n, _ in _notes(lines)] == [3]


async def test_long_lines_are_cut_saying_how_many_bytes_went(store: Store) -> None:
    sink = LogSink(store, "trigger", limits=LogLimits(max_line_bytes=1000))
    sink.open()
    try:
        token = sink.bind_trigger(7)
        try:
            print("h" * 1_000_000)
            logging.getLogger("user").warning("é" * 1000)  # 2 bytes each
            for _ in range(3):  # one line in three prints
                print("p" * 700, end="")
            print()
            print("q" * 5000, end="")  # never ended: a line of its own at the end
        finally:
            sink.unbind(token)
        sink.end(7)
        await sink.flush()
    finally:
        await sink.close()
    messages = [line.message for line in await _trigger_lines(store, 7)]
    assert messages == [
        "h" * 1000 + " [... 999000 bytes cut]",
        "é" * 500 + " [... 1000 bytes cut]",
        "p" * 1000 + " [... 1100 bytes cut]",
        "q" * 1000 + " [... 4000 bytes cut]",
    ]


async def test_the_lines_a_process_holds_stay_within_its_buffer(store: Store) -> None:
    limits = LogLimits(max_line_bytes=1000, buffer_bytes=20 * (100 + LINE_OVERHEAD))
    sink = LogSink(store, "task", limits=limits)
    sink.open()
    held: list[int] = []
    try:
        for ti in (1, 2, 3):
            token = sink.bind_task(ti, "d", "r", f"t{ti}", 1, fresh=True)
            try:
                for n in range(30):
                    print(f"{n:02} " + "z" * 97)
                    held.append(sink._pending)
            finally:
                sink.unbind(token)
        await sink.flush()
    finally:
        await sink.close()
    assert max(held) <= limits.buffer_bytes
    for ti, stored in ((1, 20), (2, 0), (3, 0)):
        lines = await _task_lines(store, "d", "r", f"t{ti}", 1)
        assert len(_user(lines)) == stored
        ((dropped, why),) = _notes(lines)
        assert dropped == 30 - stored
        assert "log buffer was full" in why


# -- real processes -------------------------------------------------------------------------

LINES = 200_000
HUGE = 1 << 20
MAX_LINE = 4096
TOTAL = 256 << 10

FLOOD_DAG = f"""
import asyncio

from engine import DAG
from operators.base import BaseOperator
from operators.python import PythonOperator
from triggers.base import BaseTrigger, TriggerEvent

LINES = {LINES}
HUGE = {HUGE}


def flood():
    for _ in range(3):
        print("H" * HUGE)
    for n in range(LINES):
        print(f"line {{n:>7}} of the flood")


class AsyncFlood(BaseOperator):
    async def execute(self, context):
        flood()


class FloodTrigger(BaseTrigger):
    def serialize(self):
        return ("flood_dag.FloodTrigger", {{}})

    async def run(self):
        for _ in range(3):
            print("H" * HUGE)
        for n in range(LINES):
            self.log.info("line %7d of the flood", n)
            if n % 1000 == 0:
                await asyncio.sleep(0)  # (a trigger shares the loop)
        yield TriggerEvent("flooded")


class DefersToAFlood(BaseOperator):
    def execute(self, context):
        self.defer(trigger=FloodTrigger(), method_name="done")

    def done(self, context, event):
        return event


with DAG("flood"):
    PythonOperator(task_id="thread", python_callable=flood)
    AsyncFlood(task_id="async")
    PythonOperator(task_id="isolated", python_callable=flood, isolation="process")
    DefersToAFlood(task_id="deferred")
"""


def _cli(env: dict[str, str], *args: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "engine", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _check_flood(lines: list[LogLine], what: str) -> None:
    """What a flood left: the huge lines cut, flood lines up to the total, one note."""
    user = _user(lines)
    huge = [line for line in user if line.message.startswith("H")]
    flood = [line for line in user if re.fullmatch(r"line +\d+ of the flood", line.message)]
    assert len(huge) + len(flood) == len(user), (what, [line.message[:80] for line in user])
    assert [line.message for line in huge] == [
        "H" * MAX_LINE + f" [... {HUGE - MAX_LINE} bytes cut]"
    ] * 3, what
    assert [int(line.message.split()[1]) for line in flood] == list(range(len(flood))), what
    assert 0 < sum(len(line.message.encode()) for line in user) <= TOTAL, what
    kind = "trigger" if what == "trigger" else "try"
    assert _notes(lines) == [
        (
            3 + LINES - len(user),
            f"this {kind}'s log reached its limit of 256 KiB: setting log_max_{kind}_bytes",
        )
    ], what


@pytest.mark.subprocess
@pytest.mark.timeout(600)
# (One loop: the engine runs in processes of its own.)
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True})])
async def test_floods_from_threads_async_tasks_child_processes_and_triggers_are_bounded(
    db_url: str, tmp_path: Path, children: Children, store: Store
) -> None:
    folder = tmp_path / "dags"
    folder.mkdir()
    (folder / "flood_dag.py").write_text(textwrap.dedent(FLOOD_DAG))
    env = process_env(db_url, tmp_path, folder)
    env.update(
        DEFERRAL_LOG_MAX_TRY_BYTES=str(TOTAL),
        DEFERRAL_LOG_MAX_TRIGGER_BYTES=str(TOTAL),
        DEFERRAL_LOG_MAX_LINE_BYTES=str(MAX_LINE),
        # (Out of the way: the counts below do not depend on how fast the lines come.)
        DEFERRAL_LOG_MAX_LINES_PER_S="10000000",
        DEFERRAL_LOG_BUFFER_BYTES=str(64 << 20),
    )
    children.env = env
    async with explained(children):
        children.start("worker", name="worker")
        children.start("triggerer", name="triggerer")
        children.start("scheduler", name="scheduler")
        _cli(env, "dags", "trigger", "flood", "--run-id", "r1", "--wait", cwd=tmp_path)
    listed = json.loads(_cli(env, "tasks", "list", "--dag", "flood", "--json", cwd=tmp_path))
    assert {ti["task_id"]: ti["state"] for ti in listed} == dict.fromkeys(
        ("thread", "async", "isolated", "deferred"), "success"
    )
    for task_id in ("thread", "async", "isolated"):
        _check_flood(await _task_lines(store, "flood", "r1", task_id, 1), task_id)
    (trigger_id,) = (await store.task_logs("flood", "r1", "deferred", 1)).trigger_ids
    _check_flood(await _trigger_lines(store, trigger_id), "trigger")
