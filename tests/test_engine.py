"""The whole path in one process: worker, triggerer and scheduler on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine import DAG
from engine.store import Store, TaskInstance, TriggerOutcome
from engine.store.downstream import settle
from engine.testing import run_engine
from engine.worker.worker import Worker
from operators.base import BaseOperator, Context, SkipTask
from operators.python import PythonOperator
from tests.helpers import fired_summary, wait_until
from tests.triggers_for_tests import (
    CLEANUPS,
    RUNS,
    EndTrigger,
    FileTrigger,
    NeverTrigger,
    RaisingTrigger,
    SilentTrigger,
    WaitTrigger,
    release_file,
)
from triggers.base import BaseTrigger, decode_value, encode_value

pytestmark = pytest.mark.anyio

#: Calls of operator methods in this process, by "<tag>:<method>". Operators are deep-copied
#: for each execution, so the counter lives at module level, keyed by a tag unique to a test.
CALLS: Counter[str] = Counter()


def _tag() -> str:
    return uuid.uuid4().hex


def _result(ti: dict[str, Any] | TaskInstance) -> Any:
    """The decoded result of a task instance (the harness's dict or the store's row)."""
    raw = ti.result if isinstance(ti, TaskInstance) else ti["result"]
    return None if raw is None else decode_value(raw)


class Deferrer(BaseOperator):
    """Defers to the trigger ``make_trigger()`` builds; the resumed method returns what it got.

    ``execute`` sets an attribute on the instance before deferring: the resumed method runs on
    a fresh instance and must not see it.
    """

    def __init__(
        self,
        *,
        tag: str,
        trigger: BaseTrigger,
        defer_kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.tag = tag
        self.trigger = trigger
        self.defer_kwargs = defer_kwargs
        self.timeout = timeout

    def execute(self, context: Context) -> Any:
        CALLS[f"{self.tag}:execute"] += 1
        self.leaked = "set before deferring"
        self.defer(
            trigger=self.trigger,
            method_name="resume",
            kwargs=self.defer_kwargs,
            timeout=self.timeout,
        )

    def resume(self, context: Context, event: Any = None, **kwargs: Any) -> Any:
        CALLS[f"{self.tag}:resume"] += 1
        return {
            "event": event,
            "kwargs": kwargs,
            "leaked": getattr(self, "leaked", None),
            "try_number": context["try_number"],
        }


class AsyncDeferrer(BaseOperator):
    """``async def`` execute and resume, both on the worker's loop."""

    def __init__(self, *, tag: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tag = tag

    async def execute(self, context: Context) -> Any:
        asyncio.get_running_loop()  # raises unless on the loop
        CALLS[f"{self.tag}:execute"] += 1
        self.defer(trigger=WaitTrigger(0.05, {"n": 7}), method_name="resume", kwargs={"factor": 3})

    async def resume(self, context: Context, event: Any, factor: int) -> Any:
        asyncio.get_running_loop()
        CALLS[f"{self.tag}:resume"] += 1
        await asyncio.sleep(0)
        return event["n"] * factor


def _ok() -> str:
    return "ok"


def _boom() -> None:
    raise ValueError("boom in the task")


def _skip() -> None:
    raise SkipTask("nothing to do")


# -- the main path -----------------------------------------------------------------------------


async def test_defer_fire_resume_then_downstream_and_the_run_succeeds(store: Store) -> None:
    tag = _tag()
    with DAG(dag_id="main_path") as dag:
        wait = Deferrer(
            task_id="wait",
            tag=tag,
            trigger=WaitTrigger(0.05, {"order": 42}),
            defer_kwargs={"note": "kept"},
        )
        load = PythonOperator(task_id="load", python_callable=_ok)
        wait >> load
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["__run__"]["state"] == "success"
    assert tis["wait"]["state"] == "success"
    assert _result(tis["wait"]) == {
        "event": {"order": 42},
        "kwargs": {"note": "kept"},
        "leaked": None,
        "try_number": 1,
    }
    assert tis["wait"]["try_number"] == 1
    assert tis["wait"]["trigger_id"] is None
    assert tis["wait"]["next_method"] is None
    assert tis["load"]["state"] == "success"
    assert _result(tis["load"]) == "ok"
    assert CALLS[f"{tag}:execute"] == 1
    assert CALLS[f"{tag}:resume"] == 1
    assert await store.list_triggers() == []


async def test_an_async_execute_defers_and_resumes_on_the_loop(store: Store) -> None:
    tag = _tag()
    with DAG(dag_id="async_exec") as dag:
        AsyncDeferrer(task_id="a", tag=tag)
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["a"]["state"] == "success", tis["a"]["error"]
    assert _result(tis["a"]) == 21
    assert CALLS[f"{tag}:execute"] == 1
    assert CALLS[f"{tag}:resume"] == 1


def _thread_name() -> str:
    return "main" if threading.current_thread() is threading.main_thread() else "worker-thread"


class AsyncNoDefer(BaseOperator):
    async def execute(self, context: Context) -> Any:
        await asyncio.sleep(0)
        return {"on_loop": asyncio.get_running_loop().is_running(), "thread": _thread_name()}


async def test_a_sync_execute_runs_in_a_thread_and_an_async_one_on_the_loop(store: Store) -> None:
    with DAG(dag_id="sync_async") as dag:
        PythonOperator(task_id="sync", python_callable=_thread_name)
        AsyncNoDefer(task_id="async")
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["__run__"]["state"] == "success"
    assert _result(tis["sync"]) == "worker-thread"
    assert _result(tis["async"]) == {"on_loop": True, "thread": "main"}


# -- failures ----------------------------------------------------------------------------------


async def test_a_failing_task_stores_its_traceback_and_fails_the_run(store: Store) -> None:
    with DAG(dag_id="failing") as dag:
        bad = PythonOperator(task_id="bad", python_callable=_boom)
        after = PythonOperator(task_id="after", python_callable=_ok)
        later = PythonOperator(task_id="later", python_callable=_ok)
        bad >> after >> later
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["__run__"]["state"] == "failed"
    assert tis["bad"]["state"] == "failed"
    assert tis["bad"]["error"].startswith("Traceback (most recent call last)")
    assert "ValueError: boom in the task" in tis["bad"]["error"]
    assert "_boom" in tis["bad"]["error"]
    assert tis["bad"]["try_number"] == 1
    assert tis["after"]["state"] == "upstream_failed"
    assert tis["later"]["state"] == "upstream_failed"
    assert tis["after"]["try_number"] == 0


def _nul_boom() -> None:
    raise ValueError("bad byte \x00 in the message")


def _surrogate_boom() -> None:
    raise FileNotFoundError("no such file: " + b"caf\xff".decode("utf-8", "surrogateescape"))


async def test_an_error_with_a_nul_character_is_stored_escaped(store: Store) -> None:
    """PostgreSQL text holds neither NUL nor a lone surrogate: errors carrying them (from a
    task, from a trigger) are stored escaped, and the tasks written in the same batches are
    not affected."""
    with DAG(dag_id="nul_errors") as dag:
        PythonOperator(task_id="task_nul", python_callable=_nul_boom)
        PythonOperator(task_id="task_surrogate", python_callable=_surrogate_boom)
        Deferrer(task_id="trigger_nul", tag=_tag(), trigger=RaisingTrigger("gone \x00 away"))
        for i in range(3):
            PythonOperator(task_id=f"fine{i}", python_callable=_ok)
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert "ValueError: bad byte \\x00 in the message" in tis["task_nul"]["error"]
    assert "RuntimeError: gone \\x00 away" in tis["trigger_nul"]["error"]
    assert "no such file: caf\\udcff" in tis["task_surrogate"]["error"]
    assert {tis[f"fine{i}"]["state"] for i in range(3)} == {"success"}


class FlakyTask(BaseOperator):
    """Fails until its try ``succeed_on``."""

    def __init__(self, *, succeed_on: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.succeed_on = succeed_on

    def execute(self, context: Context) -> Any:
        if context["try_number"] < self.succeed_on:
            raise RuntimeError(f"flaky on try {context['try_number']}")
        return f"ok on try {context['try_number']}"


async def test_retries_then_success(store: Store) -> None:
    with DAG(dag_id="retry_ok") as dag:
        FlakyTask(task_id="flaky", succeed_on=3, retries=2, retry_delay=0)
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["__run__"]["state"] == "success"
    assert tis["flaky"]["state"] == "success"
    assert tis["flaky"]["try_number"] == 3
    assert _result(tis["flaky"]) == "ok on try 3"
    assert tis["flaky"]["error"] is None


async def test_retries_run_out(store: Store) -> None:
    with DAG(dag_id="retry_out") as dag:
        FlakyTask(task_id="flaky", succeed_on=99, retries=1, retry_delay=0)
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["flaky"]["state"] == "failed"
    assert tis["flaky"]["try_number"] == 2
    assert "RuntimeError: flaky on try 2" in tis["flaky"]["error"]


async def test_a_trigger_that_raises_fails_its_task(store: Store) -> None:
    tag = _tag()
    with DAG(dag_id="trigger_raises") as dag:
        Deferrer(task_id="t", tag=tag, trigger=RaisingTrigger("the remote API is gone"))
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["__run__"]["state"] == "failed"
    assert tis["t"]["state"] == "failed"
    assert "RaisingTrigger raised" in tis["t"]["error"]
    assert "RuntimeError: the remote API is gone" in tis["t"]["error"]
    assert CALLS[f"{tag}:resume"] == 0
    assert await store.list_triggers() == []


async def test_a_trigger_error_uses_the_tasks_retries(store: Store) -> None:
    tag = _tag()
    with DAG(dag_id="trigger_raises_retry") as dag:
        Deferrer(
            task_id="t",
            tag=tag,
            trigger=RaisingTrigger("transient"),
            retries=1,
            retry_delay=0,
        )
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["t"]["state"] == "failed"
    assert tis["t"]["try_number"] == 2
    assert CALLS[f"{tag}:execute"] == 2
    assert CALLS[f"{tag}:resume"] == 0


async def test_a_trigger_that_returns_without_an_event_fails_its_task(store: Store) -> None:
    tag = _tag()
    with DAG(dag_id="trigger_silent") as dag:
        Deferrer(task_id="t", tag=tag, trigger=SilentTrigger(tag))
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["t"]["state"] == "failed"
    assert "returned without yielding an event" in tis["t"]["error"]
    assert CALLS[f"{tag}:resume"] == 0


async def test_a_deferral_timeout_fails_the_task_without_a_worker_hop(store: Store) -> None:
    tag = _tag()
    with DAG(dag_id="timeout") as dag:
        waits = Deferrer(task_id="t", tag=tag, trigger=NeverTrigger(tag), timeout=0.05)
        after = PythonOperator(task_id="after", python_callable=_ok)
        waits >> after
    async with run_engine(store) as engine:
        engine.scheduler.timeout_backstop_grace_s = 3600.0  # the triggerer's timer must do it
        tis = await engine.run_dag(dag)
        # The trigger nobody waits on any more is stopped, and its cleanup runs.
        await wait_until(lambda: _async_true(CLEANUPS[tag] == 1), what="trigger cleanup")
    assert tis["t"]["state"] == "failed"
    assert tis["t"]["error"].startswith("deferral timed out")
    assert tis["t"]["trigger_id"] is None
    assert tis["t"]["try_number"] == 1
    assert tis["after"]["state"] == "upstream_failed"
    assert CALLS[f"{tag}:execute"] == 1
    assert CALLS[f"{tag}:resume"] == 0
    assert RUNS[tag] == 1
    assert await store.list_triggers() == []


async def _async_true(value: bool) -> bool:
    return value


# -- exactly once ------------------------------------------------------------------------------


async def _deferred(store: Store, dag_id: str, task_id: str) -> TaskInstance | None:
    for ti in await store.list_task_instances(dag_id=dag_id):
        if ti.task_id == task_id and ti.state == "deferred":
            return ti
    return None


async def test_a_duplicate_event_resumes_the_task_once(store: Store) -> None:
    """The test is the triggerer: it claims the trigger and writes its event twice."""
    tag = _tag()
    with DAG(dag_id="dupe_event") as dag:
        Deferrer(task_id="t", tag=tag, trigger=NeverTrigger(tag))
    async with run_engine(store, triggerer=False) as engine:
        await engine.start_run(dag)

        async def is_deferred() -> bool:
            return await _deferred(store, "dupe_event", "t") is not None

        await wait_until(is_deferred, what="the task to defer")
        me = await store.register_triggerer("test", 1, 10, 60.0)
        (claimed,) = (await store.claim_triggers(me, 10)).claimed
        outcome = TriggerOutcome(
            trigger_id=claimed.id, fence=claimed.fence, kind="event", payload=encode_value("once")
        )
        accepted, moved = fired_summary(await store.fire_triggers(me, [outcome]))
        assert (accepted, moved) == ({claimed.id}, 1)
        again = fired_summary(await store.fire_triggers(me, [outcome]))
        assert again == (set(), 0)

        async def finished() -> bool:
            (ti,) = await store.list_task_instances(dag_id="dupe_event")
            return bool(ti.state == "success")

        await wait_until(finished, what="the resumed task to finish")
        # After the resume ran, the same event once more changes nothing either.
        assert fired_summary(await store.fire_triggers(me, [outcome])) == (set(), 0)
    (ti,) = await store.list_task_instances(dag_id="dupe_event")
    assert _result(ti)["event"] == "once"
    assert CALLS[f"{tag}:resume"] == 1
    assert CALLS[f"{tag}:execute"] == 1


async def test_the_same_outcome_twice_in_one_batch_moves_the_task_once(store: Store) -> None:
    tag = _tag()
    with DAG(dag_id="dupe_batch") as dag:
        Deferrer(task_id="t", tag=tag, trigger=NeverTrigger(tag))
    async with run_engine(store, triggerer=False) as engine:
        await engine.start_run(dag)

        async def is_deferred() -> bool:
            return await _deferred(store, "dupe_batch", "t") is not None

        await wait_until(is_deferred, what="the task to defer")
        me = await store.register_triggerer("test", 1, 10, 60.0)
        (claimed,) = (await store.claim_triggers(me, 10)).claimed
        outcome = TriggerOutcome(
            trigger_id=claimed.id, fence=claimed.fence, kind="event", payload=encode_value(1)
        )
        accepted, moved = fired_summary(await store.fire_triggers(me, [outcome, outcome]))
        assert accepted == {claimed.id}
        assert moved == 1

        async def finished() -> bool:
            (ti,) = await store.list_task_instances(dag_id="dupe_batch")
            return bool(ti.state == "success")

        await wait_until(finished, what="the resumed task to finish")
    assert CALLS[f"{tag}:resume"] == 1


async def test_an_event_with_a_stale_fence_changes_nothing(store: Store) -> None:
    """A triggerer that lost a trigger (released, adopted elsewhere) cannot write its event."""
    tag = _tag()
    with DAG(dag_id="stale_fence") as dag:
        Deferrer(task_id="t", tag=tag, trigger=NeverTrigger(tag))
    async with run_engine(store, triggerer=False) as engine:
        await engine.start_run(dag)

        async def is_deferred() -> bool:
            return await _deferred(store, "stale_fence", "t") is not None

        await wait_until(is_deferred, what="the task to defer")
        old = await store.register_triggerer("old", 1, 10, 60.0)
        (first,) = (await store.claim_triggers(old, 10)).claimed
        assert await store.release_triggerer(old) == 1
        new = await store.register_triggerer("new", 2, 10, 60.0)
        (second,) = (await store.claim_triggers(new, 10)).claimed
        assert second.id == first.id
        assert second.fence > first.fence

        stale = TriggerOutcome(
            trigger_id=first.id, fence=first.fence, kind="event", payload=encode_value("old")
        )
        # Neither the old owner (no longer owner) nor the new owner with the old token may write.
        assert fired_summary(await store.fire_triggers(old, [stale])) == (set(), 0)
        assert fired_summary(await store.fire_triggers(new, [stale])) == (set(), 0)
        ti = await _deferred(store, "stale_fence", "t")
        assert ti is not None
        assert ti.trigger_id == first.id

        fresh = TriggerOutcome(
            trigger_id=second.id, fence=second.fence, kind="event", payload=encode_value("new")
        )
        assert fired_summary(await store.fire_triggers(new, [fresh])) == ({second.id}, 1)

        async def finished() -> bool:
            (ti,) = await store.list_task_instances(dag_id="stale_fence")
            return bool(ti.state == "success")

        await wait_until(finished, what="the resumed task to finish")
    (ti,) = await store.list_task_instances(dag_id="stale_fence")
    assert _result(ti)["event"] == "new"
    assert CALLS[f"{tag}:resume"] == 1


# -- the slot is free while the task waits -----------------------------------------------------


async def test_the_worker_slot_is_free_while_its_task_is_deferred(
    store: Store, tmp_path: Path
) -> None:
    tag = _tag()
    release = tmp_path / "release"
    with DAG(dag_id="free_slot") as dag:
        # Higher priority: the single slot takes the waiter first.
        Deferrer(task_id="waiter", tag=tag, trigger=FileTrigger(str(release)), priority_weight=10)
        PythonOperator(task_id="other", python_callable=_ok)
    async with run_engine(store, slots=1) as engine:
        await engine.start_run(dag)

        async def other_done() -> bool:
            tis = {ti.task_id: ti for ti in await store.list_task_instances(dag_id="free_slot")}
            return bool(tis["other"].state == "success")

        await wait_until(other_done, what="the second task to run in the freed slot")
        tis = {ti.task_id: ti for ti in await store.list_task_instances(dag_id="free_slot")}
        # The waiter still waits (its file does not exist yet), and it held the slot first.
        assert tis["waiter"].state == "deferred"
        assert tis["waiter"].first_try_at < tis["other"].started_at
        assert engine.worker.peak_running == 1

        release_file(release, "go")
        state = await _run_state(store, "free_slot")
    assert state == "success"
    tis = {ti.task_id: ti for ti in await store.list_task_instances(dag_id="free_slot")}
    assert _result(tis["waiter"])["event"] == {"path": str(release), "text": "go"}
    assert CALLS[f"{tag}:resume"] == 1


async def _run_state(store: Store, dag_id: str, run_id: str = "run1") -> str:
    from engine.client.runs import wait_for_run

    return await wait_for_run(store, dag_id, run_id, 30.0)


# -- task-end events ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "state", "downstream"),
    [
        ("success", "success", "success"),
        ("failed", "failed", "upstream_failed"),
        ("skipped", "skipped", "skipped"),
    ],
)
async def test_a_task_end_event_ends_the_task_without_a_worker_hop(
    store: Store, kind: str, state: str, downstream: str
) -> None:
    tag = _tag()
    with DAG(dag_id=f"end_{kind}") as dag:
        t = Deferrer(task_id="t", tag=tag, trigger=EndTrigger(kind, {"why": kind}))
        after = PythonOperator(task_id="after", python_callable=_ok)
        t >> after
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["t"]["state"] == state
    assert tis["after"]["state"] == downstream
    assert CALLS[f"{tag}:execute"] == 1
    assert CALLS[f"{tag}:resume"] == 0
    assert tis["t"]["try_number"] == 1
    if kind == "success":
        assert _result(tis["t"]) == {"why": "success"}
        assert tis["__run__"]["state"] == "success"
    if kind == "failed":
        assert "failed the task" in tis["t"]["error"]
        assert "{'why': 'failed'}" in tis["t"]["error"]
        assert tis["__run__"]["state"] == "failed"
    if kind == "skipped":
        assert tis["__run__"]["state"] == "success"


async def test_a_failed_event_uses_the_tasks_retries(store: Store) -> None:
    tag = _tag()
    with DAG(dag_id="end_failed_retry") as dag:
        Deferrer(task_id="t", tag=tag, trigger=EndTrigger("failed"), retries=1, retry_delay=0)
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["t"]["state"] == "failed"
    assert tis["t"]["try_number"] == 2
    assert CALLS[f"{tag}:execute"] == 2


# -- trigger rules -----------------------------------------------------------------------------

#: task_id -> (trigger_rule, upstream task ids, expected state)
_RULES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "as_ok": ("all_success", ("ok", "ok2"), "success"),
    "as_fail": ("all_success", ("ok", "bad"), "upstream_failed"),
    "as_skip": ("all_success", ("ok", "skip"), "skipped"),
    "nf_skip": ("none_failed", ("ok", "skip"), "success"),
    "nf_fail": ("none_failed", ("ok", "bad"), "upstream_failed"),
    "ad_mixed": ("all_done", ("ok", "bad", "skip"), "success"),
    "os_one": ("one_success", ("bad", "ok"), "success"),
    "os_none_fail": ("one_success", ("bad", "skip"), "upstream_failed"),
    "os_none_skip": ("one_success", ("skip", "skip2"), "skipped"),
    "af_all": ("all_failed", ("bad",), "success"),
    "af_not": ("all_failed", ("ok", "bad"), "skipped"),
    "of_one": ("one_failed", ("ok", "bad"), "success"),
    "of_none": ("one_failed", ("ok",), "skipped"),
    "od_fail": ("one_done", ("bad",), "success"),
    "nfmos_skips": ("none_failed_min_one_success", ("skip", "skip2"), "skipped"),
    "nfmos_ok": ("none_failed_min_one_success", ("ok", "skip"), "success"),
    "ns_skip": ("none_skipped", ("ok", "skip"), "skipped"),
    "ns_fail": ("none_skipped", ("ok", "bad"), "success"),
    "ask_all": ("all_skipped", ("skip", "skip2"), "success"),
    "always_fail": ("always", ("bad",), "success"),
    # Second level: an upstream_failed upstream counts as failed, a skipped one as skipped.
    "as_after_uf": ("all_success", ("as_fail",), "upstream_failed"),
    "ad_after_uf": ("all_done", ("as_fail",), "success"),
    "nf_after_skip": ("none_failed", ("as_skip",), "success"),
}


async def test_trigger_rules_with_failed_and_skipped_upstreams(store: Store) -> None:
    with DAG(dag_id="rules") as dag:
        tasks: dict[str, BaseOperator] = {
            "ok": PythonOperator(task_id="ok", python_callable=_ok),
            "ok2": PythonOperator(task_id="ok2", python_callable=_ok),
            "bad": PythonOperator(task_id="bad", python_callable=_boom),
            "skip": PythonOperator(task_id="skip", python_callable=_skip),
            "skip2": PythonOperator(task_id="skip2", python_callable=_skip),
        }
        for task_id, (rule, _, _) in _RULES.items():
            tasks[task_id] = PythonOperator(task_id=task_id, python_callable=_ok, trigger_rule=rule)
        for task_id, (_, upstream, _) in _RULES.items():
            [tasks[u] for u in upstream] >> tasks[task_id]
    async with run_engine(store, slots=8) as engine:
        tis = await engine.run_dag(dag)
    got = {task_id: tis[task_id]["state"] for task_id in _RULES}
    expected = {task_id: state for task_id, (_, _, state) in _RULES.items()}
    assert got == expected
    assert tis["bad"]["state"] == "failed"
    assert tis["skip"]["state"] == "skipped"
    # A leaf ended upstream_failed, so the run failed.
    assert tis["__run__"]["state"] == "failed"


async def test_a_run_whose_leaves_succeed_succeeds_despite_a_failed_inner_task(
    store: Store,
) -> None:
    with DAG(dag_id="cleanup_leaf") as dag:
        bad = PythonOperator(task_id="bad", python_callable=_boom)
        cleanup = PythonOperator(task_id="cleanup", python_callable=_ok, trigger_rule="all_done")
        bad >> cleanup
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["bad"]["state"] == "failed"
    assert tis["cleanup"]["state"] == "success"
    assert tis["__run__"]["state"] == "success"


# -- identical triggers ------------------------------------------------------------------------


async def test_identical_triggers_share_one_row_and_the_event_fans_out(
    store: Store, tmp_path: Path
) -> None:
    tag = _tag()
    release = tmp_path / "release"
    with DAG(dag_id="fan_out") as dag:
        waiters = [
            Deferrer(
                task_id=f"w{i}",
                tag=tag,
                trigger=FileTrigger(str(release)),
                defer_kwargs={"i": i},
            )
            for i in range(3)
        ]
        join = PythonOperator(task_id="join", python_callable=_ok)
        waiters >> join
    async with run_engine(store) as engine:
        await engine.start_run(dag)

        async def all_deferred() -> bool:
            tis = await store.list_task_instances(dag_id="fan_out", state="deferred")
            return len(tis) == 3

        await wait_until(all_deferred, what="three tasks to defer")
        triggers = await store.list_triggers()
        assert len(triggers) == 1
        assert triggers[0].waiting == 3
        tis = await store.list_task_instances(dag_id="fan_out", state="deferred")
        assert {ti.trigger_id for ti in tis} == {triggers[0].id}

        release_file(release, "all of you")
        state = await _run_state(store, "fan_out")
    assert state == "success"
    ended = {ti.task_id: ti for ti in await store.list_task_instances(dag_id="fan_out")}
    for i in range(3):
        assert _result(ended[f"w{i}"])["event"] == {"path": str(release), "text": "all of you"}
        assert _result(ended[f"w{i}"])["kwargs"] == {"i": i}
    assert ended["join"].state == "success"
    assert RUNS[str(release)] == 1
    assert CALLS[f"{tag}:resume"] == 3
    assert await store.list_triggers() == []


async def test_one_waiter_timing_out_leaves_the_others_waiting(
    store: Store, tmp_path: Path
) -> None:
    """Identical triggers, different deadlines: the earlier deadline ends only its own task."""
    tag = _tag()
    release = tmp_path / "release"
    with DAG(dag_id="shared_deadline") as dag:
        Deferrer(task_id="patient", tag=tag, trigger=FileTrigger(str(release)))
        Deferrer(task_id="hasty", tag=tag, trigger=FileTrigger(str(release)), timeout=0.05)
    async with run_engine(store) as engine:
        await engine.start_run(dag)

        async def hasty_failed() -> bool:
            tis = {t.task_id: t for t in await store.list_task_instances(dag_id=dag.dag_id)}
            return bool(tis["hasty"].state == "failed")

        await wait_until(hasty_failed, what="the hasty waiter to time out")
        tis = {t.task_id: t for t in await store.list_task_instances(dag_id=dag.dag_id)}
        assert tis["patient"].state == "deferred"
        assert tis["hasty"].error.startswith("deferral timed out")
        release_file(release, "late")
        state = await _run_state(store, dag.dag_id)
    assert state == "failed"  # "hasty" is a leaf and failed
    tis = {t.task_id: t for t in await store.list_task_instances(dag_id=dag.dag_id)}
    assert tis["patient"].state == "success"
    assert _result(tis["patient"])["event"] == {"path": str(release), "text": "late"}
    assert CALLS[f"{tag}:resume"] == 1


async def test_joining_a_running_trigger_with_an_earlier_deadline_is_enforced_by_the_triggerer(
    store: Store, tmp_path: Path
) -> None:
    """A task joins an identical trigger a triggerer already runs, with an earlier deadline
    than the trigger had: the triggerer's timer (not the scheduler's backstop) ends it."""
    tag = _tag()
    release, gate_file = tmp_path / "release", tmp_path / "gate"
    with DAG(dag_id="late_join") as dag:
        Deferrer(task_id="patient", tag=tag, trigger=FileTrigger(str(release)))
        gate = Deferrer(task_id="gate", tag=tag, trigger=FileTrigger(str(gate_file)))
        hasty = Deferrer(task_id="hasty", tag=tag, trigger=FileTrigger(str(release)), timeout=0.05)
        gate >> hasty
    async with run_engine(store) as engine:
        engine.scheduler.timeout_backstop_grace_s = 3600.0  # only the triggerer may end it
        await engine.start_run(dag)

        async def patient_trigger_running() -> bool:
            ti = await _deferred(store, "late_join", "patient")
            if ti is None:
                return False
            rows = [t for t in await store.list_triggers() if t.id == ti.trigger_id]
            return bool(rows and rows[0].triggerer_id is not None)

        await wait_until(patient_trigger_running, what="the shared trigger to be claimed")
        release_file(gate_file, "open")

        async def hasty_failed() -> bool:
            tis = {t.task_id: t for t in await store.list_task_instances(dag_id="late_join")}
            return bool(tis["hasty"].state == "failed")

        await wait_until(hasty_failed, timeout_s=10.0, what="the joined deadline to be enforced")
        tis = {t.task_id: t for t in await store.list_task_instances(dag_id="late_join")}
        assert tis["hasty"].error.startswith("deferral timed out")
        assert tis["patient"].state == "deferred"
        release_file(release, "done")
        state = await _run_state(store, "late_join")
    assert state == "failed"
    tis = {t.task_id: t for t in await store.list_task_instances(dag_id="late_join")}
    assert tis["patient"].state == "success"


class TwoStepDeferrer(BaseOperator):
    """Defers, and defers again from the resumed method before finishing."""

    def __init__(self, *, tag: str, fail_second_resume_on_try: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tag = tag
        self.fail_on = fail_second_resume_on_try

    def execute(self, context: Context) -> Any:
        CALLS[f"{self.tag}:execute"] += 1
        self.defer(trigger=WaitTrigger(0.01, "one"), method_name="step", kwargs={"seen": []})

    def step(self, context: Context, event: Any, seen: list[Any]) -> Any:
        CALLS[f"{self.tag}:step"] += 1
        self.defer(
            trigger=WaitTrigger(0.01, "two"), method_name="finish", kwargs={"seen": [*seen, event]}
        )

    def finish(self, context: Context, event: Any, seen: list[Any]) -> Any:
        CALLS[f"{self.tag}:finish"] += 1
        if context["try_number"] == self.fail_on:
            raise RuntimeError("the last step failed")
        return {"seen": [*seen, event], "try_number": context["try_number"]}


async def test_a_resumed_method_can_defer_again(store: Store) -> None:
    tag = _tag()
    with DAG(dag_id="two_steps") as dag:
        TwoStepDeferrer(task_id="t", tag=tag)
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["t"]["state"] == "success", tis["t"]["error"]
    assert _result(tis["t"]) == {"seen": ["one", "two"], "try_number": 1}
    assert [CALLS[f"{tag}:{m}"] for m in ("execute", "step", "finish")] == [1, 1, 1]


async def test_a_failure_after_a_resume_retries_from_execute(store: Store) -> None:
    tag = _tag()
    with DAG(dag_id="fail_after_resume") as dag:
        TwoStepDeferrer(task_id="t", tag=tag, fail_second_resume_on_try=1, retries=1, retry_delay=0)
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["t"]["state"] == "success", tis["t"]["error"]
    assert tis["t"]["try_number"] == 2
    assert _result(tis["t"]) == {"seen": ["one", "two"], "try_number": 2}
    assert [CALLS[f"{tag}:{m}"] for m in ("execute", "step", "finish")] == [2, 2, 2]


class Unstorable(BaseOperator):
    def execute(self, context: Context) -> Any:
        return object()


async def test_unrecoverable_outcomes_fail_the_task_with_a_clear_error(store: Store) -> None:
    with DAG(dag_id="unrecoverable") as dag:
        Unstorable(task_id="unstorable", retries=3, retry_delay=0)
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["unstorable"]["state"] == "failed"
    assert tis["unstorable"]["try_number"] == 1  # no retry can fix the code
    assert (
        "XCom 'return_value' cannot be stored as its value: the value is a builtins.object"
        in (tis["unstorable"]["error"])
    )


async def test_an_event_racing_the_deadline_moves_the_task_once(store: Store) -> None:
    """The event and the deadline arrive together: one of them ends the wait, never both."""
    tag = _tag()
    with DAG(dag_id="event_vs_deadline") as dag:
        Deferrer(task_id="t", tag=tag, trigger=NeverTrigger(tag), timeout=0)
    async with run_engine(store, triggerer=False) as engine:
        engine.scheduler.timeout_backstop_grace_s = 3600.0  # the test plays the triggerer
        await engine.start_run(dag)

        async def is_deferred() -> bool:
            return await _deferred(store, "event_vs_deadline", "t") is not None

        await wait_until(is_deferred, what="the task to defer")
        me = await store.register_triggerer("test", 1, 10, 60.0)
        (claimed,) = (await store.claim_triggers(me, 10)).claimed
        event = TriggerOutcome(
            trigger_id=claimed.id, fence=claimed.fence, kind="event", payload=encode_value("won")
        )
        moved: list[int] = []

        async def fire() -> None:
            fired = await store.fire_triggers(me, [event])
            await settle(store, fired.moved, woke=fired.woke)
            moved.append(len(fired.moved))

        async def time_out() -> None:
            timed_out = await store.timeout_deferrals([claimed.id])
            await settle(store, timed_out)
            moved.append(len(timed_out))

        async with anyio.create_task_group() as tg:
            tg.start_soon(fire)
            tg.start_soon(time_out)
        assert sorted(moved) == [0, 1]
        state = await _run_state(store, "event_vs_deadline")
    (ti,) = await store.list_task_instances(dag_id="event_vs_deadline")
    if state == "success":
        assert _result(ti)["event"] == "won"
        assert CALLS[f"{tag}:resume"] == 1
    else:
        assert ti.state == "failed"
        assert ti.error.startswith("deferral timed out")
        assert CALLS[f"{tag}:resume"] == 0


async def test_the_scheduler_ends_an_overdue_deferral_when_no_triggerer_runs(store: Store) -> None:
    tag = _tag()
    with DAG(dag_id="backstop") as dag:
        Deferrer(task_id="t", tag=tag, trigger=NeverTrigger(tag), timeout=0.01)
    async with run_engine(store, triggerer=False) as engine:
        engine.scheduler.timeout_backstop_grace_s = 0.0
        tis = await engine.run_dag(dag)
    assert tis["t"]["state"] == "failed"
    assert tis["t"]["error"].startswith("deferral timed out")
    assert RUNS[tag] == 0  # no triggerer ever ran it
    assert CALLS[f"{tag}:resume"] == 0


def _echo_context(conf: dict[str, Any], run_id: str, try_number: int) -> dict[str, Any]:
    return {"conf": conf, "run_id": run_id, "try_number": try_number}


async def test_the_run_conf_and_ids_reach_the_task(store: Store) -> None:
    with DAG(dag_id="conf") as dag:
        PythonOperator(task_id="echo", python_callable=_echo_context)
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag, run_id="nightly", conf={"region": "eu", "n": 2})
    assert _result(tis["echo"]) == {
        "conf": {"region": "eu", "n": 2},
        "run_id": "nightly",
        "try_number": 1,
    }


async def test_two_workers_run_and_resume_every_task_exactly_once(store: Store) -> None:
    """Workers competing for the same tasks (claims with SKIP LOCKED) never run one twice."""
    tag = _tag()
    n = 24
    with DAG(dag_id="contention") as dag:
        for i in range(n):
            Deferrer(task_id=f"t{i}", tag=f"{tag}{i}", trigger=WaitTrigger(0.01, i))
    async with run_engine(store, slots=3) as engine:
        second = Worker(store, engine.dagbag, slots=3, poll_interval_s=0.5, heartbeat_s=1.0)
        async with anyio.create_task_group() as tg:
            await tg.start(second.run)
            tis = await engine.run_dag(dag)
            second.stop()
    assert tis["__run__"]["state"] == "success"
    for i in range(n):
        assert _result(tis[f"t{i}"])["event"] == i
        assert CALLS[f"{tag}{i}:execute"] == 1
        assert CALLS[f"{tag}{i}:resume"] == 1
    assert engine.worker.finished > 0
    assert second.finished > 0  # both took part
