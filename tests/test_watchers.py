"""Asset watchers on the triggerer: their trigger rows follow the DAGs' declarations, their
events are written with their cursor in one fenced statement, they survive a graceful stop, a
fault (restarted with backoff, shown by `assets list`) and a SIGKILL of their triggerer
without losing or repeating an outside event they had recorded."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

from engine import DAG, Asset, AssetWatcher
from engine.cli import cli
from engine.scheduler.dagrecord import record_dags
from engine.store import Store
from engine.store.models import WatcherItem, WatcherState
from engine.testing import run_engine
from engine.triggerer import Triggerer
from engine.triggerer.watching import WatcherOutbox, backoff_s
from operators.python import PythonOperator
from tests.helpers import wait_until
from tests.triggerer_faults import Spawn, spawn
from tests.triggers_for_tests import FailingEventTrigger, NulEventTrigger
from triggers.base import BaseEventTrigger, decode_value, encode_value
from triggers.events import DirectoryTrigger

__all__ = ["spawn"]  # the fixture

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    # The triggerers under test run uvloop; one backend keeps these tests short.
    return ("asyncio", {"use_uvloop": True})


def _dag(dag_id: str, asset: str, watchers: dict[str, BaseEventTrigger]) -> DAG:
    declared = Asset(asset, watchers=[AssetWatcher(n, trigger=t) for n, t in watchers.items()])
    with DAG(dag_id, schedule=[declared]) as dag:
        PythonOperator(task_id="t", python_callable=lambda: None)
    return dag


async def _declare(store: Store, dag: DAG) -> None:
    await record_dags(store, [dag])  # (which syncs the watchers' trigger rows)


async def _state(store: Store, name: str) -> WatcherState:
    [state] = [w for w in await store.watcher_states() if w.name == name]
    return state


async def _events(store: Store, asset: str) -> list[dict[str, Any]]:
    """The asset's events' extras, oldest first."""
    return [e.extra for e in reversed(await store.asset_events(asset, limit=10_000))]


def _put(folder: Path, name: str) -> None:
    tmp = folder / f".{name}.tmp"
    tmp.write_text(name)
    os.replace(tmp, folder / name)


@contextlib.asynccontextmanager
async def _triggerer(store: Store, **options: Any) -> AsyncIterator[Triggerer]:
    triggerer = Triggerer(store, poll_interval_s=0.2, lease_s=2.0, **options)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await tg.start(triggerer.run)
            try:
                yield triggerer
            finally:
                triggerer.stop()


# -- the trigger rows follow the declarations -------------------------------------------------


async def test_each_watcher_of_an_active_dag_runs_as_one_trigger_row(
    store: Store, tmp_path: Path
) -> None:
    a, b = DirectoryTrigger(str(tmp_path / "a")), DirectoryTrigger(str(tmp_path / "b"))
    await _declare(store, _dag("consumer", "orders", {"files_a": a, "files_b": b}))
    first = {w.name: w.trigger_id for w in await store.watcher_states()}
    assert set(first) == {"files_a", "files_b"}
    assert None not in first.values()
    triggers = {t.id for t in await store.list_triggers()}
    assert set(first.values()) <= triggers

    # Recorded again as it is (its kwargs encrypted anew): the same rows run on.
    changed = _dag("consumer", "orders", {"files_a": a, "files_b": b})
    changed.description = "changed, so it is written again"
    await _declare(store, changed)
    assert {w.name: w.trigger_id for w in await store.watcher_states()} == first
    # Nobody waits on a watcher's row, yet the orphan sweep leaves it.
    await store.delete_orphan_triggers(0)
    assert set(first.values()) <= {t.id for t in await store.list_triggers()}

    # One watcher's trigger changes: it gets a new row and starts without a cursor.
    await store._pool.execute(
        "UPDATE deferral_asset_watchers SET cursor = $1", encode_value({"before": 1})
    )
    await _declare(
        store,
        _dag("consumer", "orders", {"files_a": a, "files_b": DirectoryTrigger(str(tmp_path))}),
    )
    now = {w.name: w for w in await store.watcher_states()}
    assert now["files_a"].trigger_id == first["files_a"]
    assert now["files_a"].cursor is not None
    assert now["files_b"].trigger_id not in (None, first["files_b"])
    assert now["files_b"].cursor is None
    assert first["files_b"] not in {t.id for t in await store.list_triggers()}

    # A watcher no longer declared stops; with no active DAG using the asset, all do.
    await _declare(store, _dag("consumer", "orders", {"files_a": a}))
    assert [w.name for w in await store.watcher_states()] == ["files_a"]
    await store._pool.execute("UPDATE deferral_dags SET is_active = false")
    await store.sync_watchers()
    assert [w.trigger_id for w in await store.watcher_states()] == [None]
    assert {t.id for t in await store.list_triggers()} == set()


async def test_watcher_writes_are_fenced_and_written_once(store: Store, tmp_path: Path) -> None:
    await _declare(store, _dag("consumer", "orders", {"files": DirectoryTrigger(str(tmp_path))}))
    first = await store.register_triggerer("host", 1, 10, 30.0)
    [row] = (await store.claim_triggers(first, 10)).claimed
    [claimed] = await store.claimed_watchers(first, [row.id])
    assert (claimed.asset, claimed.name, claimed.cursor) == ("orders", "files", None)

    def item(seq: int, fence: int = row.fence, **kw: Any) -> WatcherItem:
        return WatcherItem(
            trigger_id=row.id,
            fence=fence,
            extra={"n": seq},
            cursor=encode_value(seq),
            has_cursor=True,
            seq=seq,
            **kw,
        )

    assert await store.record_watcher_events(first, [item(1), item(2)]) == {row.id}
    # The same batch again (its reply lost): nothing is written twice, and the trigger is
    # still this triggerer's (no "no longer owns it" for a batch written already).
    assert await store.record_watcher_events(first, [item(1), item(2)]) == {row.id}
    await store.record_watcher_events(first, [item(1), item(2), item(3)])
    assert [e["n"] for e in await _events(store, "orders")] == [1, 2, 3]
    state = await _state(store, "files")
    assert (state.events, decode_value(state.cursor or b"")) == (3, 3)
    # A checkpoint moves the cursor and records no event.
    await store.record_watcher_events(
        first, [WatcherItem(trigger_id=row.id, fence=row.fence, is_event=False,
                            cursor=encode_value("cp"), has_cursor=True, seq=4)]
    )  # fmt: skip
    assert len(await _events(store, "orders")) == 3

    # Another triggerer adopts it: the first one's writes change nothing any more.
    await store.release_triggerer(first)
    second = await store.register_triggerer("host", 2, 10, 30.0)
    [again] = (await store.claim_triggers(second, 10)).claimed
    assert again.fence == row.fence + 1
    [adopted] = await store.claimed_watchers(second, [again.id])
    assert decode_value(adopted.cursor or b"") == "cp"
    assert await store.record_watcher_events(first, [item(5)]) == set()
    # (Nor may anyone else, even with the current fence.)
    assert await store.record_watcher_events(first, [item(5, fence=again.fence)]) == set()
    assert await store.record_watcher_events(second, [item(1, fence=again.fence)]) == {row.id}
    assert [e["n"] for e in await _events(store, "orders")] == [1, 2, 3, 1]


# -- on a triggerer -----------------------------------------------------------------------------


async def test_a_directory_watcher_resumes_after_its_triggerer_stops_without_loss_or_repeat(
    store: Store, tmp_path: Path
) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "old").write_text("there before the watcher")
    await _declare(store, _dag("consumer", "files", {"in": DirectoryTrigger(str(folder))}))

    async def recorded(n: int) -> bool:
        return len(await _events(store, "files")) >= n

    async def started() -> bool:
        return (await _state(store, "in")).cursor is not None  # its first look is stored

    async with _triggerer(store) as first:
        await wait_until(started, what="the watcher's first look")
        _put(folder, "a")
        _put(folder, "b")
        await wait_until(lambda: recorded(2), what="a and b recorded")
        assert first.recorded == 2
    _put(folder, "c")  # while no triggerer runs
    async with _triggerer(store):
        await wait_until(lambda: recorded(3), what="c recorded by the next triggerer")
        _put(folder, "d")
        await wait_until(lambda: recorded(4), what="d recorded")
    names = [e["name"] for e in await _events(store, "files")]
    assert names == ["a", "b", "c", "d"]
    assert {e.source_kind for e in await store.asset_events("files")} == {"watcher"}
    assert {e.source_name for e in await store.asset_events("files")} == {"in"}


async def test_a_raising_watcher_is_restarted_with_backoff_and_shown(
    store: Store, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="engine.triggerer")
    await _declare(
        store, _dag("consumer", "orders", {"broken": FailingEventTrigger("no such queue")})
    )

    async def restarted_twice() -> bool:
        return (await _state(store, "broken")).restarts >= 2

    async with _triggerer(store) as triggerer:
        await wait_until(restarted_twice, what="two restarts")
        [asset] = await store.list_assets()
        [shown] = asset.watchers
        assert shown["name"] == "broken"
        assert shown["state"] in ("restarting", "running")
        assert shown["triggerer_id"] == triggerer.id
        assert shown["triggerer"].endswith(f":{os.getpid()}")
        assert shown["restarts"] >= 2
        assert "RuntimeError: no such queue" in shown["last_error"]
        state = await _state(store, "broken")
        assert state.retry_at is not None
        assert state.last_error_at is not None
        # The backoff doubles with each fault in a row (the delay written with the fault).
        delay = (state.retry_at - state.last_error_at).total_seconds()
        assert delay == backoff_s(state.restarts)
        # The command line shows it too.
        listed = await anyio.to_thread.run_sync(
            lambda: CliRunner().invoke(
                cli, ["assets", "list", "--json"], env={"DEFERRAL_DATABASE_URL": db_url}
            )
        )
        assert listed.exit_code == 0, listed.output
        [[watcher]] = [a["watchers"] for a in json.loads(listed.output)]
        assert watcher["restarts"] >= 2
        assert "no such queue" in watcher["last_error"]
        table = await anyio.to_thread.run_sync(
            lambda: CliRunner().invoke(
                cli, ["assets", "list", "--wide"], env={"DEFERRAL_DATABASE_URL": db_url}
            )
        )
        assert "last error: RuntimeError: no such queue" in table.output, table.output
    assert backoff_s(1) < backoff_s(2) < backoff_s(3)
    assert await _events(store, "orders") == []
    # Each start's log line counts the restarts made by then.
    counts = [
        int(r.getMessage().rsplit(": ", 1)[1].rstrip(")"))
        for r in caplog.records
        if "started (restarts so far:" in r.getMessage()
    ]
    assert counts[:2] == [0, 1]


async def test_a_watched_file_triggers_the_downstream_run_with_its_event(
    store: Store, tmp_path: Path
) -> None:
    """End to end: a file lands, the watcher records an asset event, the scheduler makes an
    asset-triggered run whose task sees the event's extra; `assets list` shows the watcher."""
    folder = tmp_path / "in"
    folder.mkdir()
    seen: list[list[dict[str, Any]]] = []

    def look(**context: Any) -> None:
        seen.append([e.extra for evs in context["triggering_asset_events"].values() for e in evs])

    landing = Asset(
        "landing", watchers=[AssetWatcher("csv", DirectoryTrigger(str(folder), "*.csv"))]
    )
    with DAG("load_landing", schedule=[landing]) as dag:
        PythonOperator(task_id="look", python_callable=look)
    async with run_engine(store, dags=[dag], poll_interval_s=0.2) as engine:
        await engine.add_dag(dag)
        await wait_until(lambda: _started(store, "csv"), what="the watcher's first look")
        _put(folder, "orders.csv")

        async def ran() -> bool:
            runs = await store.list_runs(dag_id="load_landing")
            return len(runs) == 1 and runs[0].state == "success"

        await wait_until(ran, what="the asset-triggered run")
        [asset] = await store.list_assets()
        [shown] = asset.watchers
        assert (shown["name"], shown["state"], shown["events"]) == ("csv", "running", 1)
    [[extra]] = seen
    assert (extra["name"], extra["path"]) == ("orders.csv", str(folder / "orders.csv"))
    [run] = await store.list_runs(dag_id="load_landing")
    assert run.run_type == "asset_triggered"


async def _started(store: Store, name: str) -> bool:
    return (await _state(store, name)).cursor is not None


# -- SIGKILL ------------------------------------------------------------------------------------


@pytest.mark.subprocess
async def test_no_event_lost_or_repeated_across_a_sigkill_of_the_triggerer(
    store: Store, tmp_path: Path, spawn: Spawn
) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    await _declare(store, _dag("consumer", "files", {"in": DirectoryTrigger(str(folder))}))
    written: list[str] = []

    def put(count: int) -> None:
        for _ in range(count):
            name = f"f{len(written):03d}"
            _put(folder, name)
            written.append(name)

    async def owner() -> int | None:
        return (await _state(store, "in")).triggerer_id

    async def recorded(n: int) -> bool:
        return len(await _events(store, "files")) >= n

    first = spawn(capacity=100, lease_s=1.5)

    async def watching() -> bool:
        state = await _state(store, "in")
        return state.triggerer_id is not None and state.cursor is not None

    await wait_until(watching, what="the first triggerer watching")
    held_by = await owner()
    put(20)
    await wait_until(lambda: recorded(5), what="some files recorded")
    second = spawn(capacity=100, lease_s=1.5)
    put(20)  # some of these are in flight in the first triggerer when it dies
    first.send_signal(signal.SIGKILL)
    await anyio.to_thread.run_sync(first.wait)
    put(20)  # while nobody watches

    async def adopted() -> bool:
        now = await owner()
        return now is not None and now != held_by

    await wait_until(adopted, what="the second triggerer adopting the watcher")
    put(20)
    await wait_until(lambda: recorded(len(written)), what="every file recorded")
    names = [e["name"] for e in await _events(store, "files")]
    assert sorted(names) == written  # each file once: none lost, none repeated
    assert second.poll() is None


async def test_an_event_holding_nul_characters_is_recorded_without_a_restart(
    store: Store,
) -> None:
    # PostgreSQL's jsonb refuses NUL: the watcher writes the event with each NUL replaced by
    # U+FFFD (its cursor moved past it: dropping it would lose it), and counts no fault.
    await _declare(store, _dag("consumer", "orders", {"nul": NulEventTrigger()}))

    async def recorded() -> bool:
        return (await _state(store, "nul")).events >= 1 or (
            await _state(store, "nul")
        ).last_error is not None

    async with _triggerer(store):
        await wait_until(recorded, what="the event or its fault")
    state = await _state(store, "nul")
    assert (state.last_error, state.restarts) == (None, 0)
    assert await _events(store, "orders") == [{"body": "a\ufffdb", "k\ufffd": ["x\ufffd", 1]}]
    assert decode_value(state.cursor) == 1


async def test_an_event_that_cannot_be_stored_is_recorded_as_an_error_not_a_restart(
    store: Store,
) -> None:
    # The writer puts a fault in the place of an event it could not store; the trigger runs
    # on, so the fault shows as the watcher's last error with no restart and no backoff.
    await _declare(store, _dag("consumer", "orders", {"w": FailingEventTrigger("unused")}))
    triggerer = await store.register_triggerer("host", 1, 10, 30.0)
    [row] = (await store.claim_triggers(triggerer, 10)).claimed
    item = WatcherItem(
        trigger_id=row.id,
        fence=row.fence,
        extra={},
        is_event=True,
        cursor=None,
        has_cursor=False,
        seq=1,
    )
    fault = WatcherOutbox._substitute(item, ValueError("refused"))
    assert await store.watcher_failed(triggerer, fault)
    state = await _state(store, "w")
    assert state.last_error is not None
    assert "ValueError: refused" in state.last_error
    assert (state.restarts, state.retry_at) == (0, None)


@pytest.mark.parametrize("why", ["not allowed", "cannot be imported"])
async def test_a_watcher_whose_trigger_cannot_start_here_shows_its_error_and_backs_off(
    store: Store, why: str
) -> None:
    # Known as a watcher by its row, not by its class: a class this triggerer may not run or
    # cannot import is the watcher's fault (shown, retried with backoff), its row kept.
    await _declare(store, _dag("consumer", "orders", {"w": FailingEventTrigger("unused")}))
    [before] = await store.watcher_states()
    options: dict[str, Any] = {}
    if why == "not allowed":
        options["allow"] = lambda classpath: "FailingEventTrigger" not in classpath
        expected = "FailingEventTrigger"
    else:
        await store._pool.execute(
            "UPDATE deferral_triggers SET classpath = 'tests.no_such_module.Gone'"
        )
        expected = "tests.no_such_module"

    async def failed_twice() -> bool:
        return (await _state(store, "w")).restarts >= 2

    async with _triggerer(store, **options):
        await wait_until(failed_twice, timeout_s=20, what="two recorded faults")
    state = await _state(store, "w")
    assert state.trigger_id == before.trigger_id
    assert state.last_error is not None
    assert expected in state.last_error
    assert state.retry_at is not None
    assert "unused" not in state.last_error  # (never built)


async def test_only_assets_that_schedule_an_active_unpaused_dag_run_their_watchers(
    store: Store, tmp_path: Path
) -> None:
    # A watcher is for a DAG that waits on its asset: an asset only written (a task's outlet)
    # runs none, nor one whose consumers are all paused; unpaused, it runs again.
    declared = Asset(
        "orders", watchers=[AssetWatcher("files", trigger=DirectoryTrigger(str(tmp_path)))]
    )
    with DAG("producer", schedule=None) as producer:
        PythonOperator(task_id="t", python_callable=lambda: None, outlets=[declared])
    await _declare(store, producer)
    [state] = await store.watcher_states()
    assert state.trigger_id is None
    assert await store.list_triggers() == []

    await _declare(store, _dag("consumer", "orders", {"files": DirectoryTrigger(str(tmp_path))}))
    assert (await _state(store, "files")).trigger_id is not None
    assert await store.set_dag_paused("consumer", True)
    await store.sync_watchers()
    assert (await _state(store, "files")).trigger_id is None
    assert await store.set_dag_paused("consumer", False)
    await store.sync_watchers()
    assert (await _state(store, "files")).trigger_id is not None
