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
