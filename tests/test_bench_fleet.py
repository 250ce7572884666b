"""The sensor-fleet benchmark runs end to end on a tiny fleet and reports the shape the docs
promise (figures are measured by the benchmark, never asserted here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks.cli import bench


def test_fleet_reports_every_mode(
    admin_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", admin_url)
    out = tmp_path / "fleet.json"
    result = CliRunner().invoke(
        bench,
        [
            "fleet",
            "--sensors",
            "6",
            "--slots",
            "2",
            "--mode",
            "all",
            "--window",
            "0.2",
            "--poke-interval",
            "0.05",
            "--compute-ms",
            "1",
            "--out",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["sensors"] == 6
    assert data["slots"] == 2
    assert data["pools"] is False
    assert set(data["modes"]) == {"poke", "reschedule", "deferrable"}
    for mode, figures in data["modes"].items():
        for key in (
            "makespan_s",
            "slot_seconds_waiting",
            "peak_slots_waiting",
            "db_statements_per_sensor",
        ):
            assert isinstance(figures[key], int | float), (mode, key)
        for key in ("compute_queue_delay_ms", "condition_to_downstream_ms"):
            assert set(figures[key]) >= {"p50", "p99"}, (mode, key)
        assert figures["sensor_states"] == {"success": 6}
    # A deferrable sensor gives its slot back after one check: never more than that.
    assert data["modes"]["deferrable"]["sensor_calls_on_workers"] == 6


def test_fleet_with_pools_runs_sensors_and_compute_in_their_pools(
    admin_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tasks name the pools 'sensors' and 'compute': were the pools not created first,
    # every task would fail at claim naming its missing pool.
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", admin_url)
    out = tmp_path / "fleet.json"
    result = CliRunner().invoke(
        bench,
        [
            "fleet", "--sensors", "4", "--slots", "2", "--mode", "deferrable", "--window", "0.2",
            "--poke-interval", "0.05", "--compute-ms", "1", "--pools", "--out", str(out),
        ],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["pools"] is True
    figures = data["modes"]["deferrable"]
    assert figures["sensor_states"] == {"success": 4}
    assert figures["compute_queue_delay_ms"]["p50"] is not None  # every compute task ran


def test_the_mapped_fleet_reports_its_fan_out(
    admin_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", admin_url)
    out = tmp_path / "mapped.json"
    result = CliRunner().invoke(
        bench,
        ["fleet", "--mapped", "--sensors", "5", "--slots", "2", "--window", "0.2",
         "--poke-interval", "0.05", "--out", str(out)],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["mapped"] is True
    figures = data["figures"]
    assert figures["instances"] == 5
    assert figures["sensors_succeeded"] == 5
    assert figures["run_state"] == "success"
    for key in (
        "upstream_end_to_all_deferred_s",
        "upstream_end_to_expanded_s",
        "slot_seconds_waiting",
        "db_statements_per_sensor",
    ):
        assert isinstance(figures[key], int | float), key
    # Each deferrable sensor checks once on a worker, then waits off it.
    assert figures["sensor_calls_on_workers"] == 5
