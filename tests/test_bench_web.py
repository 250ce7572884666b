"""The web benchmark runs end to end on a small history and reports the shape the docs
promise: every page answered 200 and was timed (figures are measured by the benchmark, never
asserted here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks.cli import bench


def test_web_times_every_page_over_a_history(
    admin_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", admin_url)
    out = tmp_path / "web.json"
    result = CliRunner().invoke(
        bench,
        ["web", "--runs", "60", "--tasks", "3", "--repeat", "2", "--out", str(out)],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["runs"], data["tasks_per_run"], data["task_instances"]) == (60, 3, 180)
    assert sum(data["task_states"].values()) == 180
    pages = {p["page"]: p for p in data["pages"]}
    assert {"grid, newest runs", "grid, oldest runs", "Gantt", "task, try 1", "pool's tasks"} <= (
        set(pages)
    )
    for page in pages.values():
        assert set(page["ms"]) == {"p50", "p99", "max"}
        assert page["bytes"] > 0
    # The oldest page of the grid is the third (60 runs, 25 a page).
    assert "run_page=3" in pages["grid, oldest runs"]["path"]


def test_web_refuses_a_dag_too_wide() -> None:
    result = CliRunner().invoke(bench, ["web", "--tasks", "5000"])
    assert result.exit_code == 2
    assert "--tasks" in result.output
