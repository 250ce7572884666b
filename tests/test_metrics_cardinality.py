"""Metrics labelled by trigger class stay bounded whatever the database holds: a class is a
label value of its own only when the allow-list admits it and its family has room (setting
``metrics_max_series``); every other is counted under ``other``. Whoever can write trigger
rows cannot blow up a scrape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.runtime.metrics import DEFAULT_MAX_SERIES, OTHER, Metrics
from engine.security.allow import TriggerAllowList
from tests.helpers import free_port, wait_until
from tests.processes import Children, explained
from tests.test_metrics import _get

#: The families labelled by trigger class.
BY_CLASS = (
    "deferral_trigger_starts",
    "deferral_trigger_events",
    "deferral_trigger_failures",
    "deferral_trigger_timeouts",
    "deferral_loop_blocked_seconds",
)


def _series(text: str) -> dict[str, dict[str, float]]:
    """Per family labelled by class: trigger class → value."""
    found: dict[str, dict[str, float]] = {name: {} for name in BY_CLASS}
    for family in text_string_to_metric_families(text):
        if family.name in found:
            for sample in family.samples:
                found[family.name][sample.labels["trigger_class"]] = sample.value
    return found


def test_classes_past_the_cap_or_refused_are_counted_under_other() -> None:
    m = Metrics(max_series=3, admit_class=TriggerAllowList(["triggers.*", "mine.*"]))
    m.count_by_class(m.trigger_starts, [f"triggers.t{i}.T" for i in range(5)] * 2)
    m.count_by_class(m.trigger_starts, ["evil.Shell", "os.system", "mine.A"])
    m.inc_by_class(m.trigger_failures, "evil.Shell")
    m.inc_by_class(m.trigger_failures, "triggers.t4.T")
    m.inc_by_class(m.loop_blocked, "unknown", 0.5)
    starts = _series(m.exposition().decode())["deferral_trigger_starts"]
    # The first three classes admitted keep their series (counted again later too); the
    # others, admitted or not, are summed under "other".
    assert starts == {
        "triggers.t0.T": 2,
        "triggers.t1.T": 2,
        "triggers.t2.T": 2,
        OTHER: 2 * 2 + 3,
    }
    # The cap is per family: failures has room for a class starts had no room for.
    series = _series(m.exposition().decode())
    assert series["deferral_trigger_failures"] == {OTHER: 1, "triggers.t4.T": 1}
    assert series["deferral_loop_blocked_seconds"] == {"unknown": 0.5}
    with pytest.raises(ValueError, match="max_series"):
        Metrics(max_series=0)


def test_a_class_counted_again_keeps_its_series_and_a_new_allow_list_applies() -> None:
    """inc_by_class keeps each class's labelled series (a triggerer counts every event): what
    it counts is what it counted before, and an allow-list set later re-labels the classes
    it had refused."""
    m = Metrics(max_series=3, admit_class=TriggerAllowList(["triggers.*"]))
    for _ in range(3):
        m.inc_by_class(m.trigger_events, "triggers.a.A")
        m.inc_by_class(m.trigger_events, "mine.B")
    m.inc_by_class(m.trigger_failures, "triggers.a.A", 2)
    series = _series(m.exposition().decode())
    assert series["deferral_trigger_events"] == {"triggers.a.A": 3, OTHER: 3}
    assert series["deferral_trigger_failures"] == {"triggers.a.A": 2}
    m.admit_classes(TriggerAllowList(["triggers.*", "mine.*"]))
    m.inc_by_class(m.trigger_events, "mine.B")
    m.inc_by_class(m.trigger_events, "triggers.a.A")
    series = _series(m.exposition().decode())
    assert series["deferral_trigger_events"] == {"triggers.a.A": 4, OTHER: 3, "mine.B": 1}


def test_classes_counted_under_other_are_not_kept_one_by_one() -> None:
    """The series kept for inc_by_class are bounded as the family's are: class names anyone
    can write (refused, or past the cap) do not each keep an entry."""
    m = Metrics(max_series=3, admit_class=TriggerAllowList(["triggers.*"]))
    for i in range(1000):
        m.inc_by_class(m.trigger_events, f"mine.C{i}")
        m.inc_by_class(m.trigger_events, f"triggers.t{i}.T")
    series = _series(m.exposition().decode())
    assert sum(series["deferral_trigger_events"].values()) == 2000
    assert len(series["deferral_trigger_events"]) <= 4
    assert len(m._by_class) <= 3


def test_the_setting_is_validated() -> None:
    from engine.config import ConfigError, load_settings

    assert load_settings({}).metrics_max_series == DEFAULT_MAX_SERIES == 100
    assert load_settings({"DEFERRAL_METRICS_MAX_SERIES": "7"}).metrics_max_series == 7
    with pytest.raises(ConfigError, match="metrics_max_series"):
        load_settings({"DEFERRAL_METRICS_MAX_SERIES": "0"})


#: Hostile rows: each a class of its own, refused by the default allow-list ...
REFUSED = 3000
#: ... or admitted by its pattern triggers.* (and failing at import).
ADMITTED = 2000


@pytest.mark.anyio
@pytest.mark.subprocess
async def test_thousands_of_hostile_trigger_rows_make_a_bounded_scrape(
    children: Children, db_url: str, tmp_path: Path
) -> None:
    """Trigger rows written straight into the table, as someone with access to it would,
    each naming a class of its own; a real triggerer claims and fails them all. Its /metrics
    keeps at most metrics_max_series classes per family, the rest under "other"."""
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute(
            "INSERT INTO deferral_triggers (classpath, kwargs, dedup_key) "
            "SELECT CASE WHEN i <= $1 THEN 'evil.m' || i || '.Shell' "
            "            ELSE 'triggers.nope' || i || '.T' END, "
            "       '\\x80'::bytea, md5('hostile' || i) "
            "FROM generate_series(1, $2) AS i",
            REFUSED,
            REFUSED + ADMITTED,
        )
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        children.start("triggerer", "--metrics-port", str(port), name="triggerer")

        async def scrape() -> tuple[int, str]:
            return await anyio.to_thread.run_sync(_get, base + "/metrics")

        async def all_failed() -> bool:
            status, text = await scrape()
            if status != 200:
                return False
            failures = _series(text)["deferral_trigger_failures"]
            if sum(failures.values()) != REFUSED + ADMITTED:
                return False
            # (Counted as they fail; written a batch at a time after.)
            return await conn.fetchval("SELECT count(*) FROM deferral_triggers") == 0

        async with explained(children):
            await wait_until(all_failed, timeout_s=120, what="every hostile trigger to fail")
    finally:
        await conn.close()
    status, text = await scrape()
    assert status == 200
    series = _series(text)
    for name in ("deferral_trigger_starts", "deferral_trigger_failures"):
        values: dict[str, Any] = series[name]
        assert sum(values.values()) == REFUSED + ADMITTED, name
        assert len(values) == DEFAULT_MAX_SERIES + 1, (name, len(values))  # and "other"
        # Refused classes are never a label; admitted ones until the cap.
        assert not [c for c in values if c.startswith("evil.")], name
        assert values[OTHER] == REFUSED + ADMITTED - DEFAULT_MAX_SERIES, name
    total = sum(len(v) for v in series.values())
    print(f"{total} series by class, /metrics {len(text):,} bytes")
    assert total <= len(BY_CLASS) * (DEFAULT_MAX_SERIES + 2)
    assert len(text) < 64_000
