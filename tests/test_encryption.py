"""Encryption at rest: what the database holds, wrong keys, online rotation, key settings, and
errors that name kwargs without their values."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import signal
import stat
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from click.testing import CliRunner

import engine.security.keys
from engine import DAG
from engine.cli import cli
from engine.config import Settings, load_settings
from engine.security.keys import (
    MARKER,
    Keyring,
    MissingKeyError,
    generate_key,
    keyring_from_settings,
)
from engine.store import Deferral, Store, TaskOutcome, TriggerOutcome
from engine.store.session import TriggererSession
from engine.testing import run_engine
from operators.base import BaseOperator, Context
from operators.python import PythonOperator
from tests.conftest import REPO
from tests.helpers import child_env, wait_until
from tests.triggers_for_tests import FileTrigger, NeverTrigger, release_file
from triggers.base import (
    BaseTrigger,
    TriggerEvent,
    TriggerSerializationError,
    encode_value,
    validate_trigger,
)

pytestmark = pytest.mark.anyio

SECRET = "sk_live_9f8e7d6c5b4a39281706"


def _noop() -> None:
    return None


@contextlib.asynccontextmanager
async def keyed_store(db_url: str, *keys: str) -> AsyncIterator[Store]:
    store = await Store.connect(db_url, pool_size=2, migrate=False, keyring=Keyring(keys))
    try:
        yield store
    finally:
        await store.close()


async def _raw(db_url: str, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(db_url)
    try:
        return list(await conn.fetch(sql))
    finally:
        await conn.close()


async def _one_deferred_task(store: Store, tag: str) -> tuple[int, int]:
    """A run of one task, claimed and deferred on a trigger whose kwargs hold the secret, with
    resume kwargs holding it too. Returns (worker id, task instance id)."""
    with DAG(dag_id=f"enc_{tag}") as dag:
        PythonOperator(task_id="t", python_callable=_noop)
    await store.upsert_dag(dag.dag_id, "x.py", dag.serialize_tasks(), None)
    await store.create_dag_run(dag.dag_id, "r1", logical_date=await store.now())
    worker = await store.register_worker("test", 1, 1)
    (ti,) = (await store.claim_tasks(worker, 1)).claimed
    trigger = validate_trigger(NeverTrigger(f"{tag}:{SECRET}"))
    deferral = Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name="resume",
        method_kwargs=encode_value({"token": SECRET}),
        timeout_s=None,
    )
    assert await store.defer_task(ti.id, worker, deferral)
    return worker, ti.id


# -- what the database holds ----------------------------------------------------------------


async def test_kwargs_events_and_results_are_ciphertext_in_the_database(
    store: Store, db_url: str
) -> None:
    worker, ti_id = await _one_deferred_task(store, "at_rest")
    secret = SECRET.encode()
    (trig,) = await _raw(db_url, "SELECT kwargs, dedup_key FROM deferral_triggers")
    (ti,) = await _raw(db_url, "SELECT next_kwargs FROM deferral_task_instances")
    for value in (trig["kwargs"], ti["next_kwargs"]):
        assert value.startswith(MARKER)
        assert secret not in value
    # The dedup key is keyed: not the plain sha256 anyone could recompute from guessed kwargs.
    plain = validate_trigger(NeverTrigger(f"at_rest:{SECRET}"))
    assert trig["dedup_key"] != plain.dedup_key
    assert trig["dedup_key"] != hashlib.sha256(plain.kwargs).hexdigest()

    # The triggerer gets plaintext kwargs; the event it writes is sealed again.
    me = await store.register_triggerer("test", 1, 10, 60.0)
    (claimed,) = (await store.claim_triggers(me, 10)).claimed
    assert claimed.kwargs == plain.kwargs
    event = encode_value({"token": SECRET})
    fired = await store.fire_triggers(
        me,
        [TriggerOutcome(trigger_id=claimed.id, fence=claimed.fence, kind="event", payload=event)],
    )
    assert (fired.accepted, len(fired.moved)) == ({claimed.id}, 1)
    (ti,) = await _raw(db_url, "SELECT next_event, next_kwargs FROM deferral_task_instances")
    assert ti["next_event"].startswith(MARKER)
    assert secret not in ti["next_event"]

    # The worker gets plaintext resume kwargs and event; the result it writes is sealed.
    (resumed,) = (await store.claim_tasks(worker, 1)).claimed
    assert (resumed.next_kwargs, resumed.next_event) == (encode_value({"token": SECRET}), event)
    result = encode_value(f"done with {SECRET}")
    await store.finish_tasks(
        [TaskOutcome(ti_id=ti_id, worker_id=worker, try_number=1, kind="success", result=result)]
    )
    (ti,) = await _raw(db_url, "SELECT result FROM deferral_task_instances")
    assert ti["result"].startswith(MARKER)
    assert secret not in ti["result"]
    (listed,) = await store.list_task_instances()
    assert listed.result == result


async def test_resume_kwargs_of_none_are_stored_as_nothing(store: Store, db_url: str) -> None:
    """A deferral without resume kwargs (``encode_value({})``) has nothing to encrypt: null is
    stored, and the resume reads it as no kwargs (the resumed method gets only its event)."""
    with DAG(dag_id="enc_no_kwargs") as dag:
        PythonOperator(task_id="t", python_callable=_noop)
    await store.upsert_dag(dag.dag_id, "x.py", dag.serialize_tasks(), None)
    await store.create_dag_run(dag.dag_id, "r1", logical_date=await store.now())
    worker = await store.register_worker("test", 1, 1)
    (ti,) = (await store.claim_tasks(worker, 1)).claimed
    trigger = validate_trigger(NeverTrigger("no_kwargs"))
    deferral = Deferral(
        classpath=trigger.classpath,
        kwargs=trigger.kwargs,
        dedup_key=trigger.dedup_key,
        method_name="resume",
        method_kwargs=encode_value({}),
        timeout_s=None,
    )
    assert await store.defer_task(ti.id, worker, deferral)
    (row,) = await _raw(db_url, "SELECT next_kwargs, next_method FROM deferral_task_instances")
    assert (row["next_kwargs"], row["next_method"]) == (None, "resume")
    (trig,) = await _raw(db_url, "SELECT kwargs FROM deferral_triggers")
    assert trig["kwargs"].startswith(MARKER)  # (the trigger's own kwargs are sealed as ever)

    me = await store.register_triggerer("test", 1, 10, 60.0)
    (claimed,) = (await store.claim_triggers(me, 10)).claimed
    event = encode_value({"token": SECRET})
    outcome = TriggerOutcome(
        trigger_id=claimed.id, fence=claimed.fence, kind="event", payload=event
    )
    assert (await store.fire_triggers(me, [outcome])).accepted == {claimed.id}
    (resumed,) = (await store.claim_tasks(worker, 1)).claimed
    assert (resumed.next_method, resumed.next_kwargs, resumed.next_event) == ("resume", None, event)


# -- a key that opens nothing ---------------------------------------------------------------


class Deferrer(BaseOperator):
    def __init__(self, *, path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path

    def execute(self, context: Context) -> Any:
        self.defer(trigger=FileTrigger(self.path), method_name="resume", kwargs={"token": SECRET})

    def resume(self, context: Context, event: Any = None, token: str = "") -> Any:
        assert token == SECRET
        return event["text"]


def _file_dag(dag_id: str, paths: list[str]) -> DAG:
    with DAG(dag_id=dag_id) as dag:
        for i, path in enumerate(paths):
            Deferrer(task_id=f"w{i}", path=path)
    return dag


async def _wait_deferred(store: Store, dag_id: str, n: int) -> None:
    async def deferred() -> bool:
        return len(await store.list_task_instances(dag_id=dag_id, state="deferred")) == n

    await wait_until(deferred, what=f"{n} task(s) of {dag_id} to defer")


async def test_a_trigger_no_key_opens_fails_its_task_and_the_triggerer_runs_on(
    db_url: str, tmp_path: Path
) -> None:
    key_a, key_c = generate_key(), generate_key()
    sealed_with_a = str(tmp_path / "a")
    async with keyed_store(db_url, key_a) as store_a:
        dag_a = _file_dag("under_a", [sealed_with_a])
        async with run_engine(store_a, triggerer=False) as engine:
            await engine.start_run(dag_a)
            await _wait_deferred(store_a, "under_a", 1)

    release_file(sealed_with_a, "never read")
    async with keyed_store(db_url, key_c) as store_c, run_engine(store_c) as engine:
        out = await engine.finish("under_a", "run1")
        assert out["w0"]["state"] == "failed"
        assert "fernet_key" in out["w0"]["error"]
        assert SECRET not in out["w0"]["error"]
        # The same triggerer (and worker) still serve triggers they can open.
        path = str(tmp_path / "c")
        release_file(path, "fired under c")
        out = await engine.run_dag(_file_dag("under_c", [path]))
        assert out["w0"]["state"] == "success"
        assert out["w0"]["result"] == encode_value("fired under c")


async def test_a_resume_no_key_opens_fails_the_try_with_the_setting_named(
    store: Store, db_url: str
) -> None:
    worker, _ = await _one_deferred_task(store, "resume")
    me = await store.register_triggerer("test", 1, 10, 60.0)
    (claimed,) = (await store.claim_triggers(me, 10)).claimed
    outcome = TriggerOutcome(
        trigger_id=claimed.id, fence=claimed.fence, kind="event", payload=encode_value(1)
    )
    await store.fire_triggers(me, [outcome])
    async with keyed_store(db_url, generate_key()) as other:
        claim = await other.claim_tasks(worker, 1)
    # Refused, not written: the worker writes the failure as it writes every outcome.
    assert (claim.claimed, claim.next_in) == ([], 0.0)
    (refused,) = claim.refused
    assert (refused.kind, refused.worker_id, refused.try_number) == ("failed", worker, 1)
    assert (await store.list_task_instances())[0].state == "running"
    await store.finish_tasks(claim.refused)
    (ti,) = await store.list_task_instances()
    assert ti.state == "failed"
    assert "fernet_key" in ti.error
    assert SECRET not in ti.error


async def test_a_worker_without_the_key_fails_a_resume_it_cannot_open(
    store: Store, db_url: str
) -> None:
    await _one_deferred_task(store, "resume_worker")
    me = await store.register_triggerer("test", 1, 10, 60.0)
    (claimed,) = (await store.claim_triggers(me, 10)).claimed
    outcome = TriggerOutcome(
        trigger_id=claimed.id, fence=claimed.fence, kind="event", payload=encode_value(1)
    )
    await store.fire_triggers(me, [outcome])
    async with (
        keyed_store(db_url, generate_key()) as other,
        run_engine(other, triggerer=False) as engine,
    ):
        ti = await engine.wait_for_state("enc_resume_worker", "t", "failed", run_id="r1")
    assert "cannot resume" in ti["error"]
    assert "fernet_key" in ti["error"]
    assert SECRET not in ti["error"]


async def test_a_trigger_no_key_opens_is_refused_by_the_claim(store: Store, db_url: str) -> None:
    await _one_deferred_task(store, "refused_trigger")
    async with keyed_store(db_url, generate_key()) as other:
        me = await other.register_triggerer("test", 1, 10, 60.0)
        claim = await other.claim_triggers(me, 10)
    assert claim.claimed == []
    (refused,) = claim.refused
    assert refused.classpath == "tests.triggers_for_tests.NeverTrigger"
    assert refused.outcome.kind == "failed"
    assert "fernet_key" in (refused.outcome.error or "")
    assert SECRET not in (refused.outcome.error or "")
    # Nothing written yet: the triggerer writes the failure through its outbox.
    (ti,) = await store.list_task_instances()
    assert ti.state == "deferred"
    fired = await store.fire_triggers(me, [refused.outcome])
    assert fired.accepted == {refused.outcome.trigger_id}
    assert [m.state for m in fired.moved] == ["failed"]


async def test_the_lease_connection_seals_the_payloads_it_writes(store: Store, db_url: str) -> None:
    """The triggerer's lease connection writes outcomes through the store's one fenced write,
    payloads sealed with the keys it is given (it used to write them as they came)."""
    await _one_deferred_task(store, "session")
    session = TriggererSession(db_url, timeout_s=10.0, keyring=store.keyring)
    await session.connect()
    try:
        me = await session.register("test", 1, 10, 60.0)
        (claimed,) = (await store.claim_triggers(me, 10)).claimed
        result = encode_value(f"ended with {SECRET}")
        outcome = TriggerOutcome(
            trigger_id=claimed.id, fence=claimed.fence, kind="success", payload=result
        )
        assert await session.fail_triggers(me, [outcome]) == {claimed.id}
    finally:
        await session.close()
    (row,) = await _raw(db_url, "SELECT result FROM deferral_task_instances")
    assert row["result"].startswith(MARKER)
    assert SECRET.encode() not in row["result"]
    (ti,) = await store.list_task_instances()
    assert (ti.state, ti.result) == ("success", result)


# -- rotation, online -------------------------------------------------------------------------


def _triggerer(db_url: str, keys: str, log: Path) -> subprocess.Popen[bytes]:
    env = child_env(DATABASE_URL=db_url, FERNET_KEY=keys, TRIGGERER_POLL_INTERVAL_S="0.2")
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "engine", "triggerer"], cwd=REPO, env=env, stdout=out, stderr=out
        )


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True})])
async def test_rotation_runs_online_and_a_triggerer_with_only_the_new_key_fires(
    db_url: str, tmp_path: Path, procs: list[subprocess.Popen[bytes]], anyio_backend: Any
) -> None:
    """Defer with key A; run a triggerer on [B, A] and rotate while it holds the triggers;
    stop it; a triggerer and a worker with only B then fire and resume every task."""
    key_a, key_b = generate_key(), generate_key()
    paths = [str(tmp_path / f"f{i}-{uuid.uuid4().hex[:6]}") for i in range(3)]
    dag = _file_dag("rotated", paths)
    async with keyed_store(db_url, key_a) as store_a, run_engine(store_a, triggerer=False) as e:
        await e.start_run(dag)
        await _wait_deferred(store_a, "rotated", 3)

    async with keyed_store(db_url, key_b, key_a) as store_ba:

        async def owners() -> set[int | None]:
            return {t.triggerer_id for t in await store_ba.list_triggers()}

        first = _triggerer(db_url, f"{key_b},{key_a}", tmp_path / "t1.log")
        procs.append(first)

        async def held() -> bool:
            return None not in await owners()

        await wait_until(held, what="the [B, A] triggerer to hold the triggers")
        counts = await store_ba.rotate_keys(batch_size=2)
        # 3 trigger kwargs and 3 resume kwargs, rewritten while the triggerer runs.
        assert counts == {"rewritten": 6, "current": 0, "changed": 0, "unreadable": 0}
        assert (await store_ba.rotate_keys())["current"] == 6
        first.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(first.wait, 30) == 0

    only_b = Keyring([key_b])
    for row in await _raw(
        db_url,
        "SELECT kwargs AS v FROM deferral_triggers UNION ALL "
        "SELECT next_kwargs FROM deferral_task_instances",
    ):
        assert only_b.is_current(row["v"])

    async with keyed_store(db_url, key_b) as store_b:
        second = _triggerer(db_url, key_b, tmp_path / "t2.log")
        procs.append(second)

        async def held_by_second() -> bool:
            rows = await store_b.list_triggers()
            return len(rows) == 3 and all(r.triggerer_id is not None for r in rows)

        await wait_until(held_by_second, what="the B-only triggerer to hold the triggers")
        for path in paths:
            release_file(path, f"fired {Path(path).name}")
        async with run_engine(store_b, triggerer=False) as engine:
            await engine.add_dag(dag)
            out = await engine.finish("rotated", "run1")
    assert out["__run__"]["state"] == "success", (tmp_path / "t2.log").read_text()
    for i, path in enumerate(paths):
        assert out[f"w{i}"]["result"] == encode_value(f"fired {Path(path).name}")


def test_keys_rotate_command_reports_what_it_did(db_url: str) -> None:
    key_a, key_b = generate_key(), generate_key()

    async def defer_under_a() -> None:
        async with keyed_store(db_url, key_a) as store:
            await _one_deferred_task(store, "cli")

    anyio.run(defer_under_a)
    env = {"DEFERRAL_DATABASE_URL": db_url, "DEFERRAL_FERNET_KEY": f"{key_b},{key_a}"}
    result = CliRunner().invoke(cli, ["keys", "rotate"], env=env)
    assert result.exit_code == 0, result.output
    assert "re-encrypted 2," in result.output
    env["DEFERRAL_FERNET_KEY"] = generate_key()
    result = CliRunner().invoke(cli, ["keys", "rotate"], env=env)
    assert result.exit_code == 1
    assert "unreadable with these keys 2" in result.output


# -- settings -------------------------------------------------------------------------------


def test_the_embedded_default_creates_a_private_key_file_once(tmp_path: Path) -> None:
    settings = load_settings({"DEFERRAL_HOME": str(tmp_path)})
    first = keyring_from_settings(settings)
    path = tmp_path / "fernet.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = keyring_from_settings(settings)
    assert again.decrypt(first.encrypt(b"x")) == b"x"


def test_an_external_database_without_a_key_refuses_to_start(tmp_path: Path) -> None:
    settings = load_settings({"DEFERRAL_DATABASE_URL": "postgresql://nowhere/x"})
    with pytest.raises(MissingKeyError, match=r"fernet_key.*deferral keys generate"):
        keyring_from_settings(settings)


def test_insecure_dev_stores_plaintext_and_warns(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine.security.keys, "_warned_insecure", False)
    settings = load_settings(
        {"DEFERRAL_DATABASE_URL": "postgresql://nowhere/x", "DEFERRAL_INSECURE_DEV": "true"}
    )
    with caplog.at_level(logging.WARNING, logger="engine.security.keys"):
        keyring = keyring_from_settings(settings)
        keyring_from_settings(settings)
    assert not keyring.encrypts
    assert keyring.encrypt(b"x") == b"x"
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "plaintext" in caplog.text


def test_commands_refuse_an_external_database_without_a_key(db_url: str) -> None:
    env = {"DEFERRAL_DATABASE_URL": db_url, "DEFERRAL_FERNET_KEY": ""}
    result = CliRunner().invoke(cli, ["tasks", "list"], env=env)
    assert result.exit_code == 2
    assert "fernet_key" in result.output
    assert "deferral keys generate" in result.output
    result = CliRunner().invoke(cli, ["--insecure-dev", "tasks", "list"], env=env)
    assert result.exit_code == 0, result.output


def test_a_bad_key_is_a_clear_error_that_does_not_echo_it() -> None:
    bad = "not-a-key-" + SECRET
    settings = load_settings({"DEFERRAL_FERNET_KEY": f"{generate_key()},{bad}"})
    with pytest.raises(Exception, match="key #2 is not a Fernet key") as info:
        keyring_from_settings(settings)
    assert SECRET not in str(info.value)
    assert SECRET not in repr(settings)


def test_keys_generate_prints_a_key_or_writes_a_private_file(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["keys", "generate"])
    assert result.exit_code == 0
    Keyring([result.output.strip()])  # a valid key
    path = tmp_path / "k"
    assert CliRunner().invoke(cli, ["keys", "generate", "--file", str(path)]).exit_code == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert CliRunner().invoke(cli, ["keys", "generate", "--file", str(path)]).exit_code == 2


# -- errors name kwargs, never their values ---------------------------------------------------


class LossyTrigger(BaseTrigger):
    """Serializes a token it changed: the rebuilt trigger serializes differently."""

    def __init__(self, token: str, region: str = "eu") -> None:
        self.token = token
        self.region = region

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}.LossyTrigger", {"token": self.token + "!", "region": self.region})

    async def run(self) -> Any:
        yield TriggerEvent(None)


def test_a_round_trip_error_names_the_kwargs_but_shows_no_value() -> None:
    with pytest.raises(TriggerSerializationError, match="does not survive") as info:
        validate_trigger(LossyTrigger(SECRET))
    message = str(info.value)
    assert "token" in message
    assert "region" not in message
    assert SECRET not in message
    assert SECRET not in repr(LossyTrigger(SECRET))


def test_an_unserializable_kwarg_is_named_without_its_value() -> None:
    class Holder:
        def __repr__(self) -> str:
            return SECRET

    class Bad(LossyTrigger):
        def serialize(self) -> tuple[str, dict[str, Any]]:
            return (f"{__name__}.LossyTrigger", {"token": Holder()})

    with pytest.raises(TriggerSerializationError, match="kwarg 'token'") as info:
        validate_trigger(Bad(SECRET))
    assert SECRET not in str(info.value)


def test_the_settings_repr_hides_the_key_and_the_database_password() -> None:
    settings = Settings(
        database_url="postgresql://app:s3cret-pw@db.example:5432/deferral", fernet_key="k3y"
    )
    shown = repr(settings)
    assert "s3cret-pw" not in shown
    assert "k3y" not in shown
    assert "postgresql://app:***@db.example:5432/deferral" in shown


def test_a_fresh_home_hands_its_children_a_key_file_that_exists(tmp_path: Path) -> None:
    # A benchmark started its processes from a home no command had used yet: they were told
    # to read <home>/fernet.key, which nobody had written.
    settings = Settings(home=str(tmp_path / "home"))
    env = engine.security.keys.child_key_env(settings)
    key_file = Path(env["DEFERRAL_FERNET_KEY_FILE"])
    assert key_file.exists()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    child = Settings(home=str(tmp_path / "home"), fernet_key_file=str(key_file))
    assert keyring_from_settings(child).encrypt(b"x") != b"x"


def test_the_dedup_key_is_the_documented_hmac_and_the_same_for_every_call() -> None:
    """security.md: h1: + HMAC-SHA256(HMAC(primary key, "deferral dedup v1"), classpath NUL
    kwargs). The keyed HMAC object is copied per value: a copy must not carry one value's
    bytes into the next."""
    raw = generate_key()
    ring = Keyring([raw])
    derived = hmac.new(base64.urlsafe_b64decode(raw), b"deferral dedup v1", "sha256").digest()
    for classpath, kwargs in [("a.B", b"\x80"), ("a.B", b"\x81"), ("c.D", b""), ("a.B", b"\x80")]:
        want = hmac.new(derived, classpath.encode() + b"\0" + kwargs, hashlib.sha256).hexdigest()
        assert ring.dedup_key(classpath, kwargs, "unkeyed") == "h1:" + want
    assert Keyring([]).dedup_key("a.B", b"", "unkeyed") == "unkeyed"
