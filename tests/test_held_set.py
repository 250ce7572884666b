"""The held set's invariant (engine/triggerer/held.py), on its own: the lease check compares a
count of owned rows read by one statement with the held set as it is when the reply comes,
and must call neither a claim nor an outcome in flight a fault, and must see a leak or a loss.

The database is modelled here by the set of rows this triggerer owns; every step the
triggerer takes is one of the steps the real code takes, in the same order (a claim commits
rows, then they are taken in; an outcome's write is in flight, commits, then settles).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.triggerer.held import HeldSet, Verdict


class _Model:
    def __init__(self) -> None:
        self.held = HeldSet()
        self.owned: set[int] = set()  # the database's rows owned by this triggerer
        self.unstarted: list[int] = []  # claimed and committed, not yet taken in
        self.claiming = False
        self.writing: list[int] = []  # outcomes in the write in flight
        self.committed = False  # that write committed (rows deleted), not yet settled
        self._next = 1

    # -- the steps the triggerer takes ----------------------------------------------------------

    def claim_commits(self) -> None:
        self.claiming = True
        for _ in range(2):
            self.owned.add(self._next)
            self.unstarted.append(self._next)
            self._next += 1

    def claim_starts(self) -> None:
        for trigger_id in self.unstarted:
            self.held.take(trigger_id, 1, "t")
        self.unstarted.clear()
        self.claiming = False

    def write_begins(self) -> None:
        if not self.writing:
            self.writing = [tid for tid in self.held.triggers][:2]

    def write_commits(self) -> None:
        if self.writing and not self.committed:
            self.owned.difference_update(self.writing)
            self.committed = True

    def write_settles(self) -> None:
        if self.committed:
            for trigger_id in self.writing:
                self.held.settle(trigger_id, 1)
            self.writing, self.committed = [], False

    def step(self, name: str) -> None:
        getattr(self, name)()

    def verdict_of(self, before: list[str], between: list[str]) -> Verdict:
        """Mark, take ``before`` steps, read the count, take ``between`` steps, judge."""
        for name in before:
            self.step(name)
        mark = self.held.mark()
        owned = len(self.owned)
        for name in between:
            self.step(name)
        return self.held.verdict(owned, mark, in_flight=len(self.writing), claiming=self.claiming)


_STEPS = st.sampled_from(
    ["claim_commits", "claim_starts", "write_begins", "write_commits", "write_settles"]
)


@settings(max_examples=300, deadline=None)
@given(before=st.lists(_STEPS, max_size=30), between=st.lists(_STEPS, max_size=10))
def test_claims_and_writes_in_flight_are_never_called_a_fault(
    before: list[str], between: list[str]
) -> None:
    assert _Model().verdict_of(before, between) is Verdict.CONSISTENT


def _quiet(model: _Model) -> None:
    for name in ["claim_commits", "claim_starts", "claim_commits", "claim_starts"]:
        model.step(name)


def test_a_trigger_owned_but_running_nowhere_is_unheld() -> None:
    model = _Model()
    _quiet(model)
    model.held.drop(next(iter(model.held.triggers)))  # lost in memory, as a bug would
    assert model.verdict_of([], []) is Verdict.UNHELD


def test_an_unheld_trigger_is_not_judged_while_a_claim_is_in_progress() -> None:
    model = _Model()
    _quiet(model)
    model.held.drop(next(iter(model.held.triggers)))
    assert model.verdict_of(["claim_commits"], []) is Verdict.CONSISTENT
    assert model.verdict_of(["claim_starts"], []) is Verdict.UNHELD


def test_a_trigger_held_but_no_longer_owned_is_lost() -> None:
    model = _Model()
    _quiet(model)
    model.owned.discard(next(iter(model.held.triggers)))  # adopted elsewhere, or deleted
    assert model.verdict_of([], []) is Verdict.LOST


def test_a_let_go_trigger_between_count_and_verdict_is_not_unheld() -> None:
    model = _Model()
    _quiet(model)
    mark = model.held.mark()
    owned = len(model.owned)  # read while still held ...
    trigger_id = next(iter(model.held.triggers))
    model.owned.discard(trigger_id)
    model.held.drop(trigger_id)  # ... let go of before the reply came
    assert model.held.verdict(owned, mark, in_flight=0, claiming=False) is Verdict.CONSISTENT


def test_settle_ignores_an_outcome_of_an_earlier_run() -> None:
    """A trigger claimed again under a new fence is a new run: an old outcome does not end it."""
    held = HeldSet()
    held.take(7, 1, "t")
    held.take(7, 2, "t")
    assert not held.settle(7, 1)
    assert 7 in held
    assert held.settle(7, 2)
    assert 7 not in held
    assert (held.taken, held.let_go, held.peak) == (2, 1, 1)


def test_letting_go_at_capacity_makes_room() -> None:
    woken: list[bool] = []
    held = HeldSet(on_room=lambda: woken.append(True))
    held.take(1, 1, "t")
    held.take(2, 1, "t")
    held.settle(1, 1)
    assert woken == []  # the last claim did not stop at capacity
    held.full = True
    held.drop(2)
    assert woken == [True]
