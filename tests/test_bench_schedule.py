"""The schedule benchmark runs end to end on a few DAGs and reports the shape the docs
promise (figures are measured by the benchmark, never asserted here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks.cli import bench


@pytest.mark.subprocess
def test_schedule_reports_delays_and_cpu(
    admin_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", admin_url)
    out = tmp_path / "schedule.json"
    result = CliRunner().invoke(
        bench,
        ["schedule", "--dags", "3", "--duration", "1", "--out", str(out)],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["dags"], data["schedule"]) == (3, "* * * * *")
    assert set(data["schedule_delay_ms"]) == {"p50", "p99", "max"}
    assert set(data["cpu"]) == {"scheduler", "worker"}
    assert set(data["cpu"]["scheduler"]) == {"cpu_s", "cpu_s_per_minute", "percent_of_a_core"}
    assert isinstance(data["runs_expected"], int)
