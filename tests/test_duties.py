"""The scheduler's housekeeping as named periodic duties (engine/scheduler/duties.py): one loop
runs whichever are due, each at its own interval, in order; a duty that fails stays due; a
running scheduler runs every duty, and log retention only when it is on."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import anyio
import pytest

from engine.scheduler.duties import DUTIES, Duty, DutyLoop, Housekeeper
from engine.scheduler.scheduler import Scheduler
from engine.store import Store
from tests.helpers import wait_until

pytestmark = pytest.mark.anyio


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _duty(
    calls: list[str],
    name: str,
    every_s: float,
    *,
    changed: int = 0,
    ends_runs: bool = False,
    fails: bool = False,
) -> Duty:
    async def run(_h: Housekeeper) -> int:
        calls.append(name)
        if fails:
            raise RuntimeError(f"{name} failed")
        return changed

    every: Callable[[Housekeeper], float] = lambda _h: every_s  # noqa: E731
    work: Callable[[Housekeeper], Awaitable[int]] = run
    return Duty(name, every, work, ends_runs=ends_runs)


async def test_due_duties_run_in_order_each_at_its_own_interval(store: Store) -> None:
    calls: list[str] = []
    clock = _Clock()
    loop = DutyLoop(
        [_duty(calls, "often", 1.0), _duty(calls, "seldom", 3.0), _duty(calls, "off", math.inf)],
        clock=clock,
    )
    h = Scheduler(store)
    assert await loop.run_due(h) == (["often", "seldom"], False)  # all due at the first round
    assert loop.due_in(h) == 1.0
    clock.now += 0.5
    assert await loop.run_due(h) == ([], False)
    clock.now += 0.5
    assert await loop.run_due(h) == (["often"], False)
    clock.now += 2.0
    assert await loop.run_due(h) == (["often", "seldom"], False)
    assert calls == ["often", "seldom", "often", "often", "seldom"]
    assert (loop.runs["often"], loop.runs["seldom"], loop.runs["off"], loop.rounds) == (3, 2, 0, 3)


async def test_a_duty_that_fails_ends_the_round_which_is_run_again_whole(store: Store) -> None:
    calls: list[str] = []
    clock = _Clock()
    failing = [True]

    async def flaky(_h: Housekeeper) -> int:
        calls.append("flaky")
        if failing[0]:
            raise ConnectionResetError("the database went away")
        return 0

    duties = [_duty(calls, "first", 10.0), Duty("flaky", lambda _h: 10.0, flaky)]
    loop = DutyLoop([*duties, _duty(calls, "last", 10.0)], clock=clock)
    h = Scheduler(store)
    with pytest.raises(ConnectionResetError):
        await loop.run_due(h)
    assert loop.rounds == 0
    failing[0] = False
    clock.now += 1.0
    assert await loop.run_due(h) == (["first", "flaky", "last"], False)
    assert calls == ["first", "flaky", "first", "flaky", "last"]
    assert loop.rounds == 1
    clock.now += 1.0
    assert await loop.run_due(h) == ([], False)  # the round completed: none due for 10 s


async def test_only_a_duty_that_may_end_runs_and_changed_something_says_so(store: Store) -> None:
    calls: list[str] = []
    clock = _Clock()
    h = Scheduler(store)
    quiet = DutyLoop([_duty(calls, "reaps nothing", 1.0, changed=0, ends_runs=True)], clock=clock)
    assert await quiet.run_due(h) == (["reaps nothing"], False)
    other = DutyLoop([_duty(calls, "frees triggers", 1.0, changed=4)], clock=clock)
    assert await other.run_due(h) == (["frees triggers"], False)
    reaps = DutyLoop([_duty(calls, "reaps", 1.0, changed=2, ends_runs=True)], clock=clock)
    assert await reaps.run_due(h) == (["reaps"], True)


def test_duty_names_are_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        DutyLoop([*DUTIES, DUTIES[0]])


@pytest.mark.parametrize("retention_days", [30.0, 0.0])
async def test_a_running_scheduler_runs_every_duty_and_log_retention_only_when_on(
    store: Store, retention_days: float
) -> None:
    scheduler = Scheduler(store, None, interval_s=0.05, log_retention_days=retention_days)
    scheduler.zombie_threshold_s = 0.2  # (read at each look: the trigger sweeps come often)
    every = {duty.name: duty.every_s(scheduler) for duty in DUTIES}
    often = {name for name, every_s in every.items() if every_s < 1.0}
    seldom = {name for name, every_s in every.items() if 1.0 <= every_s < math.inf}
    assert seldom == ({"fleet gauges", "log retention"} if retention_days else {"fleet gauges"})
    async with anyio.create_task_group() as tg:
        await tg.start(scheduler.run)

        async def ran() -> bool:
            runs = scheduler.duties.runs
            return all(runs[n] >= 3 for n in often) and all(runs[n] >= 1 for n in seldom)

        await wait_until(ran, what="every duty to run (the frequent ones three times)")
        scheduler.stop()
    assert scheduler.housekeeping_passes >= 3
    # The seldom ones ran at the first round only; log retention never, when it is off.
    assert {n: scheduler.duties.runs[n] for n in seldom} == dict.fromkeys(seldom, 1)
    assert scheduler.duties.runs["log retention"] == (1 if retention_days else 0)
