"""The claims benchmark runs end to end on a tiny backlog and reports the shape the docs
promise (figures are measured by the benchmark, never asserted here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks.cli import bench


def test_claims_reports_admissions_and_claim_latency(
    admin_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", admin_url)
    out = tmp_path / "claims.json"
    result = CliRunner().invoke(
        bench,
        [
            "claims", "--tasks", "60", "--pools", "3", "--workers", "2", "--slots", "2",
            "--batch", "4", "--out", str(out),
        ],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["tasks"], data["pools"], data["slots_per_pool"]) == (60, 3, 2)
    assert (data["workers"], data["batch"]) == (2, 4)
    # Every task was claimed once and ended at once; a claim never took more than its batch.
    assert data["task_states"] == {"success": 60}
    assert data["claim_statements"] >= 60 / 4
    assert isinstance(data["admissions_per_s"], int | float)
    assert set(data["claim_latency_ms"]) == {"p50", "p99", "max"}
    # The test server's user is a superuser: the time inside the function is reported.
    assert data["claim_function_in_database"]["calls"] >= data["claim_statements"]


def test_claims_refuses_a_backlog_that_is_not_whole_runs() -> None:
    result = CliRunner().invoke(bench, ["claims", "--tasks", "1500"])
    assert result.exit_code == 2
    assert "multiple of 1,000" in result.output
