"""The events benchmark runs end to end with a few watchers and reports the shape the docs
promise (figures are measured by the benchmark, never asserted here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks.cli import bench


def test_events_reports_event_to_asset_event_latency(
    admin_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", admin_url)
    out = tmp_path / "events.json"
    result = CliRunner().invoke(
        bench,
        ["events", "--watchers", "5", "--rate", "20", "--duration", "1", "--out", str(out)],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["watchers"], data["events_sent"]) == (5, 20)
    # Every event was recorded, once.
    assert (data["events_recorded"], data["events_repeated"]) == (20, 0)
    assert set(data["event_to_asset_event_ms"]) == {"p50", "p99", "max"}
    # Each event reached a downstream run (queued events collapse into one run).
    assert data["events_reaching_a_run"] == 20
    assert 1 <= data["downstream_runs"] <= 20
    assert set(data["event_to_first_task_started_ms"]) == {"p50", "p99", "max"}
    assert isinstance(data["transactions_per_event"], int | float)


def test_events_compares_with_polling_sensors(
    admin_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", admin_url)
    out = tmp_path / "events.json"
    result = CliRunner().invoke(
        bench,
        [
            "events",
            "--watchers",
            "4",
            "--rate",
            "20",
            "--duration",
            "1",
            "--compare-sensors",
            "0.2,0.5",
            "--out",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["events_recorded"] == 20
    # One sensor run per poll interval, in the order given, each beside the watchers' figures.
    assert [s["poke_interval_s"] for s in data["sensors"]] == [0.2, 0.5]
    for sensors in data["sensors"]:
        # As many sensors as watchers, one event each, and each sensor's task resumed.
        assert (sensors["sensors"], sensors["events_sent"]) == (4, 4)
        assert sensors["events_reaching_a_task"] == 4
        assert set(sensors["event_to_sensor_resumed_ms"]) == {"p50", "p99", "max"}
        # Arming and waiting both cost transactions, and the per-event figure counts both.
        assert sensors["transactions_arming"] > 0
        assert sensors["transactions_waiting"] > 0
        total = sensors["transactions_arming"] + sensors["transactions_waiting"]
        assert sensors["transactions_per_event"] == round(total / 4, 3)
        # The engine's background (heartbeats, polls) is measured without events.
        assert sensors["background_transactions_per_s"] > 0
    assert data["background_transactions_per_s"] > 0


def test_events_rejects_a_bad_poll_interval() -> None:
    for bad in ("5,x", "0", "-1"):
        result = CliRunner().invoke(bench, ["events", "--compare-sensors", bad])
        assert result.exit_code == 2, result.output
        assert "--compare-sensors" in result.output
