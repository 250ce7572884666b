"""The authoring contract: defer() validation, TaskDeferred, trigger round trips, the graph."""

from __future__ import annotations

import datetime as dt
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import DAG
from engine.dags.dag import DagCycleError
from engine.store import Store
from engine.testing import run_engine
from operators.base import BaseOperator, Context, TaskDeferred, TriggerSerializationError
from operators.python import PythonOperator
from tests.helpers import utcnow
from tests.triggers_for_tests import (
    ClasspathTrigger,
    DriftTrigger,
    EchoTrigger,
    HoldsTrigger,
    WaitTrigger,
)
from triggers.base import (
    BaseTrigger,
    TriggerEvent,
    decode_value,
    import_trigger_class,
    rebuild_trigger,
    validate_trigger,
)
from triggers.temporal import DateTimeTrigger, TimeDeltaTrigger

T = "tests.triggers_for_tests"


class Deferrer(BaseOperator):
    """Defers to whatever trigger a test builds; resumes by returning the event."""

    def __init__(self, *, make_trigger: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.make_trigger = make_trigger

    def execute(self, context: Context) -> Any:
        self.defer(trigger=self.make_trigger(), method_name="resume")

    def resume(self, context: Context, event: Any = None) -> Any:
        return event


def _op(make_trigger: Any = None) -> Deferrer:
    return Deferrer(task_id="t", make_trigger=make_trigger)


@pytest.fixture
def open_socket() -> Iterator[socket.socket]:
    sock = socket.socket()
    try:
        yield sock
    finally:
        sock.close()


# -- defer() refuses what cannot reach a triggerer ------------------------------------------


def test_defer_with_a_lambda_in_kwargs_is_a_serialization_error() -> None:
    with pytest.raises(TriggerSerializationError, match=r"kwarg 'value' .* cannot be serialized"):
        _op().defer(trigger=HoldsTrigger(lambda: 1), method_name="resume")


def test_defer_with_a_socket_in_kwargs_is_a_serialization_error(
    open_socket: socket.socket,
) -> None:
    with pytest.raises(TriggerSerializationError, match=r"kwarg 'value' .* cannot be serialized"):
        _op().defer(trigger=HoldsTrigger(open_socket), method_name="resume")


def test_a_live_object_nested_in_kwargs_is_refused() -> None:
    with pytest.raises(TriggerSerializationError, match="cannot be serialized"):
        validate_trigger(HoldsTrigger({"ok": [1, 2, {"inner": object()}]}))


@pytest.mark.parametrize(
    ("classpath", "message"),
    [
        ("no_such_module_xyz.Trigger", r"cannot be imported: module 'no_such_module_xyz'"),
        (f"{T}.Missing", r"has no attribute 'Missing'"),
        (f"{T}.NotATrigger", r"not a BaseTrigger subclass"),
        ("datetime.datetime", r"not a BaseTrigger subclass"),
        ("__main__.MyTrigger", r"points into __main__"),
        ("NoDots", r"must be a dotted import path 'module.name'"),
    ],
)
def test_defer_with_a_bad_classpath_is_a_serialization_error(classpath: str, message: str) -> None:
    with pytest.raises(TriggerSerializationError, match=message):
        _op().defer(trigger=ClasspathTrigger(classpath), method_name="resume")


def test_a_trigger_that_does_not_rebuild_equal_is_refused() -> None:
    with pytest.raises(TriggerSerializationError, match="does not survive a round trip"):
        validate_trigger(DriftTrigger(1))


def test_defer_refuses_a_method_name_the_operator_lacks() -> None:
    with pytest.raises(TriggerSerializationError, match="does not name a method"):
        _op().defer(trigger=WaitTrigger(0.0), method_name="no_such_method")


def test_defer_refuses_resume_kwargs_that_are_not_plain_data() -> None:
    with pytest.raises(TriggerSerializationError, match=r"defer\(kwargs=...\) must be plain data"):
        _op().defer(trigger=WaitTrigger(0.0), method_name="resume", kwargs={"f": print})


@pytest.mark.parametrize("name", ["event", "context"])
def test_defer_refuses_resume_kwargs_the_resume_call_passes_itself(name: str) -> None:
    # The resumed method is called as method(context, event=payload, **kwargs): a kwarg of
    # either name would be silently replaced by the payload, or break the call at resume time.
    with pytest.raises(TriggerSerializationError, match=f"'{name}'"):
        _op().defer(trigger=WaitTrigger(0.0), method_name="resume", kwargs={name: 1})


def test_defer_refuses_a_non_trigger() -> None:
    with pytest.raises(TriggerSerializationError, match="not a BaseTrigger instance"):
        _op().defer(trigger="not a trigger", method_name="resume")  # type: ignore[arg-type]


def test_defer_raises_task_deferred_carrying_the_validated_trigger() -> None:
    with pytest.raises(TaskDeferred) as info:
        _op().defer(
            trigger=WaitTrigger(0.5, {"a": 1}),
            method_name="resume",
            kwargs={"k": "v"},
            timeout=dt.timedelta(seconds=3),
        )
    deferred = info.value
    assert deferred.trigger.classpath == f"{T}.WaitTrigger"
    assert decode_value(deferred.trigger.kwargs) == {"delay_s": 0.5, "payload": {"a": 1}}
    assert deferred.method_name == "resume"
    assert deferred.kwargs == {"k": "v"}
    assert deferred.timeout_s == 3.0


def test_task_deferred_is_not_an_exception() -> None:
    assert issubclass(TaskDeferred, BaseException)
    assert not issubclass(TaskDeferred, Exception)

    def user_code() -> str:
        try:
            _op().defer(trigger=WaitTrigger(0.0), method_name="resume")
        except Exception:
            return "swallowed"

    with pytest.raises(TaskDeferred):
        user_code()


# -- inside a running task: the task fails cleanly and nothing is written --------------------

pytest_anyio = pytest.mark.anyio


class LambdaDeferrer(BaseOperator):
    def execute(self, context: Context) -> Any:
        self.defer(trigger=HoldsTrigger(lambda: 1), method_name="resume")

    def resume(self, context: Context, event: Any = None) -> Any:  # pragma: no cover
        return "must not resume"


class SocketDeferrer(BaseOperator):
    def execute(self, context: Context) -> Any:
        with socket.socket() as sock:
            self.defer(trigger=HoldsTrigger(sock), method_name="resume")

    def resume(self, context: Context, event: Any = None) -> Any:  # pragma: no cover
        return "must not resume"


class UnimportableDeferrer(BaseOperator):
    async def execute(self, context: Context) -> Any:
        self.defer(trigger=ClasspathTrigger("no_such_module_xyz.Trigger"), method_name="resume")

    def resume(self, context: Context, event: Any = None) -> Any:  # pragma: no cover
        return "must not resume"


@pytest_anyio
@pytest.mark.parametrize(
    ("operator", "message"),
    [
        (LambdaDeferrer, "cannot be serialized"),
        (SocketDeferrer, "cannot be serialized"),
        (UnimportableDeferrer, "cannot be imported: module 'no_such_module_xyz'"),
    ],
)
async def test_a_bad_deferral_in_a_running_task_fails_it_and_writes_nothing(
    store: Store, operator: type[BaseOperator], message: str
) -> None:
    with DAG(dag_id="bad_defer") as dag:
        task = operator(task_id="bad", retries=0)
        after = PythonOperator(task_id="after", python_callable=lambda: "ran")
        task >> after
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["__run__"]["state"] == "failed"
    bad = tis["bad"]
    assert bad["state"] == "failed"
    assert "TriggerSerializationError" in bad["error"]
    assert message in bad["error"]
    assert bad["trigger_id"] is None
    assert bad["next_method"] is None
    assert bad["try_number"] == 1
    assert tis["after"]["state"] == "upstream_failed"
    assert await store.list_triggers() == []


class SwallowingDeferrer(BaseOperator):
    """Wraps defer() in ``except Exception``, as user code often does."""

    def execute(self, context: Context) -> Any:
        try:
            self.defer(trigger=WaitTrigger(0.05, "fired"), method_name="resume")
        except Exception:
            return "swallowed"

    def resume(self, context: Context, event: Any = None) -> Any:
        return f"resumed with {event}"


@pytest_anyio
async def test_except_exception_in_execute_cannot_swallow_a_deferral(store: Store) -> None:
    with DAG(dag_id="swallow") as dag:
        SwallowingDeferrer(task_id="t")
    async with run_engine(store) as engine:
        tis = await engine.run_dag(dag)
    assert tis["t"]["state"] == "success"
    assert decode_value(tis["t"]["result"]) == "resumed with fired"


# -- round trips ------------------------------------------------------------------------------


def _round_trip(trigger: BaseTrigger) -> BaseTrigger:
    stored = validate_trigger(trigger)
    rebuilt = rebuild_trigger(stored.classpath, decode_value(stored.kwargs))
    again = validate_trigger(rebuilt)
    assert again == stored
    return rebuilt


def test_datetime_trigger_round_trips() -> None:
    moment = dt.datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    rebuilt = _round_trip(DateTimeTrigger(moment, end_from_trigger=True))
    assert isinstance(rebuilt, DateTimeTrigger)
    assert rebuilt.moment == moment
    assert rebuilt.moment.tzinfo is not None
    assert rebuilt.end_from_trigger is True


def test_time_delta_trigger_is_stored_as_the_equivalent_datetime_trigger() -> None:
    before = utcnow()
    trigger = TimeDeltaTrigger(dt.timedelta(minutes=5))
    stored = validate_trigger(trigger)
    assert stored.classpath == "triggers.temporal.DateTimeTrigger"
    rebuilt = _round_trip(trigger)
    assert isinstance(rebuilt, DateTimeTrigger)
    assert rebuilt.moment - before >= dt.timedelta(minutes=5)
    assert TimeDeltaTrigger(1.5).moment > before  # seconds are accepted too


def test_datetime_trigger_refuses_a_naive_moment() -> None:
    with pytest.raises(ValueError, match="no time zone"):
        DateTimeTrigger(dt.datetime(2030, 1, 1))


def test_import_trigger_class_finds_built_ins() -> None:
    assert import_trigger_class("triggers.temporal.DateTimeTrigger") is DateTimeTrigger


class _ExitsOnInit(BaseTrigger):
    def __init__(self, code: int) -> None:
        raise SystemExit(code)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_contracts._ExitsOnInit", {"code": 1})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(None)


def test_a_trigger_module_or_init_that_exits_is_a_serialization_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Importing a trigger's module and building it run user code: a SystemExit or
    KeyboardInterrupt there fails that trigger (and its tasks), never the process."""
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(7)\n")
    (tmp_path / "interrupts_on_import.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TriggerSerializationError, match="SystemExit: 7"):
        import_trigger_class("exits_on_import.Anything")
    with pytest.raises(TriggerSerializationError, match="KeyboardInterrupt"):
        import_trigger_class("interrupts_on_import.Anything")
    with pytest.raises(TriggerSerializationError, match="SystemExit: 1"):
        rebuild_trigger("tests.test_contracts._ExitsOnInit", {"code": 1})


def test_identical_triggers_share_a_dedup_key_and_different_ones_do_not() -> None:
    a = validate_trigger(WaitTrigger(1.0, {"x": 1, "y": 2}))
    b = validate_trigger(WaitTrigger(1.0, {"y": 2, "x": 1}))
    c = validate_trigger(WaitTrigger(1.0, {"x": 1, "y": 3}))
    assert a.dedup_key == b.dedup_key
    assert a.dedup_key != c.dedup_key


_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.datetimes(timezones=st.just(dt.UTC)),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=40, database=None, deadline=None)
@given(data=_plain)
def test_plain_kwargs_round_trip(data: Any) -> None:
    stored = validate_trigger(EchoTrigger(data))
    rebuilt = rebuild_trigger(stored.classpath, decode_value(stored.kwargs))
    assert isinstance(rebuilt, EchoTrigger)
    assert rebuilt.data == data
    assert validate_trigger(rebuilt) == stored


@settings(max_examples=50, database=None, deadline=None)
@given(
    items=st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**63), min_size=2, max_size=6)
)
def test_dedup_key_ignores_dict_order(items: dict[str, int]) -> None:
    reordered = dict(reversed(list(items.items())))
    assert (
        validate_trigger(EchoTrigger(items)).dedup_key
        == validate_trigger(EchoTrigger(reordered)).dedup_key
    )


@given(big=st.integers(min_value=2**64))
@settings(max_examples=20, database=None, deadline=None)
def test_integers_msgpack_cannot_hold_are_refused(big: int) -> None:
    with pytest.raises(TriggerSerializationError, match="cannot be serialized"):
        validate_trigger(EchoTrigger(big))


# -- the graph --------------------------------------------------------------------------------


def _noop() -> None:
    return None


def _task(task_id: str, **kwargs: Any) -> PythonOperator:
    return PythonOperator(task_id=task_id, python_callable=_noop, **kwargs)


def test_shift_operators_accept_lists() -> None:
    with DAG(dag_id="shapes"):
        a, b, c, d, e, f = (_task(x) for x in "abcdef")
        a >> [b, c] >> d
        d << e
        [e, f] << a
    assert a.downstream_task_ids == {"b", "c", "e", "f"}
    assert b.upstream_task_ids == {"a"}
    assert c.upstream_task_ids == {"a"}
    assert d.upstream_task_ids == {"b", "c", "e"}
    assert e.downstream_task_ids == {"d"}
    assert f.upstream_task_ids == {"a"}
    assert f.downstream_task_ids == set()


def test_shift_returns_the_right_hand_side_for_chains() -> None:
    with DAG(dag_id="chain"):
        a, b, c = _task("a"), _task("b"), _task("c")
        assert (a >> b) is b
        assert (c << b) is b
        assert ([a] >> c) is c


def test_shifting_a_non_task_is_a_type_error() -> None:
    with DAG(dag_id="bad_edge"):
        a = _task("a")
        with pytest.raises(TypeError, match="cannot set"):
            a >> ["not a task"]


def test_a_cycle_is_detected_and_named() -> None:
    with DAG(dag_id="loop") as dag:
        a, b, c, d = (_task(x) for x in "abcd")
        d >> a >> b >> c >> a
    with pytest.raises(DagCycleError, match=r"cycle through a, b, c"):
        dag.validate()


def test_a_self_loop_is_a_cycle() -> None:
    with DAG(dag_id="self_loop") as dag:
        a = _task("a")
        a >> a
    with pytest.raises(DagCycleError, match="cycle through a"):
        dag.validate()


def test_an_edge_to_a_task_outside_the_dag_is_refused() -> None:
    outsider = _task("outsider")
    with DAG(dag_id="edge_out") as dag:
        a = _task("a")
        a >> outsider
    with pytest.raises(ValueError, match="'outsider', which is not in this DAG"):
        dag.validate()


def test_a_valid_dag_validates() -> None:
    with DAG(dag_id="diamond") as dag:
        a, b, c, d = (_task(x) for x in "abcd")
        a >> [b, c] >> d
    dag.validate()
    leaves = {t["task_id"] for t in dag.serialize_tasks() if t["is_leaf"]}
    assert leaves == {"d"}


@pytest.mark.parametrize("task_id", ["", "has space", "x" * 251, "slash/no", "-lead"])
def test_bad_task_ids_are_refused(task_id: str) -> None:
    with pytest.raises(ValueError, match="task_id"):
        _task(task_id)


def test_a_non_string_task_id_is_refused() -> None:
    with pytest.raises(ValueError, match="task_id"):
        _task(42)  # type: ignore[arg-type]


def test_an_unknown_trigger_rule_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown trigger_rule 'all_sucess'.*none_failed"):
        _task("t", trigger_rule="all_sucess")


def test_negative_retries_are_refused() -> None:
    with pytest.raises(ValueError, match="retries"):
        _task("t", retries=-1)


def test_a_duplicate_task_id_in_a_dag_is_refused() -> None:
    with DAG(dag_id="dupe"):
        _task("a")
        with pytest.raises(ValueError, match="already has a task 'a'"):
            _task("a")


def test_a_bad_dag_id_is_refused() -> None:
    with pytest.raises(ValueError, match="dag_id"):
        DAG(dag_id="no spaces allowed")


class Collector(BaseOperator):
    """State that a run could change in place: a nested list and a dict."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[list[int]] = [[1]]
        self.options = {"when": dt.datetime(2026, 1, 1, tzinfo=dt.UTC), "tags": {"a"}}
        self.name = "collector"


class CustomCopy(Collector):
    def __deepcopy__(self, memo: dict[int, Any]) -> CustomCopy:
        clone = CustomCopy(task_id=self.task_id)
        clone.name = "made by __deepcopy__"
        return clone


def test_fresh_copy_is_a_deep_copy_that_shares_the_dag() -> None:
    with DAG(dag_id="copies") as dag:
        first = Collector(task_id="first")
        second = Collector(task_id="second")
        first >> second
    copy_ = second.fresh_copy()
    assert type(copy_) is Collector
    assert copy_ is not second
    assert copy_.dag is dag
    assert copy_.__dict__ == second.__dict__
    copy_.seen[0].append(2)
    copy_.options["tags"].add("b")  # type: ignore[attr-defined]
    copy_.upstream_task_ids.add("other")
    assert second.seen == [[1]]
    assert second.options["tags"] == {"a"}
    assert second.upstream_task_ids == {"first"}


def test_fresh_copy_copies_flat_containers_as_deepcopy_does() -> None:
    """Lists, sets and dicts of plain values (copied without deepcopy) are the copy's own; a
    value two attributes share stays one value in the copy; what deepcopy would copy inside
    a container (a list in a tuple) is still copied."""
    with DAG(dag_id="flat_copies"):
        op = Collector(task_id="op")
    shared = [1, 2]
    op.first, op.second = shared, shared  # type: ignore[attr-defined]
    op.labels = {"x", "y"}  # type: ignore[attr-defined]
    op.frozen = frozenset({"a"})  # type: ignore[attr-defined]
    op.pair = ("k", 1)  # type: ignore[attr-defined]
    op.nested = ("k", [1])  # type: ignore[attr-defined]
    op.counts = {"a": 1}  # type: ignore[attr-defined]
    copy_ = op.fresh_copy()
    assert copy_.__dict__ == op.__dict__
    assert copy_.first is copy_.second  # type: ignore[attr-defined]
    copy_.first.append(3)  # type: ignore[attr-defined]
    copy_.labels.add("z")  # type: ignore[attr-defined]
    copy_.counts["b"] = 2  # type: ignore[attr-defined]
    copy_.nested[1].append(2)  # type: ignore[attr-defined]
    copy_.inlets.append("in")
    assert op.first == [1, 2]
    assert op.second is op.first
    assert op.labels == {"x", "y"}  # type: ignore[attr-defined]
    assert op.counts == {"a": 1}  # type: ignore[attr-defined]
    assert op.nested == ("k", [1])  # type: ignore[attr-defined]
    assert op.inlets == []
    assert copy_.pair == ("k", 1)
    assert copy_.frozen == frozenset({"a"})


def test_fresh_copy_honours_a_custom_deepcopy() -> None:
    with DAG(dag_id="custom_copies"):
        op = CustomCopy(task_id="op")
    assert op.fresh_copy().name == "made by __deepcopy__"  # type: ignore[attr-defined]


class CopyByGetattr(Collector):
    """Answers ``__deepcopy__`` through ``__getattr__``, which deepcopy consults."""

    def __getattr__(self, name: str) -> Any:
        if name == "__deepcopy__":

            def made(memo: dict[int, Any]) -> Collector:
                clone = Collector(task_id=self.task_id)
                clone.name = "made through __getattr__"
                return clone

            return made
        raise AttributeError(name)


def test_fresh_copy_defers_to_deepcopy_when_getattr_may_answer() -> None:
    with DAG(dag_id="getattr_copies"):
        op = CopyByGetattr(task_id="op")
    assert op.fresh_copy().name == "made through __getattr__"  # type: ignore[attr-defined]
