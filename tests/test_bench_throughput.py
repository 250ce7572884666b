"""The throughput benchmark runs end to end on a tiny N, both halves (the engine and the
pgqueuer reference), and reports coherent counts: every item done once, none lost (figures
are measured by the benchmark, never asserted here)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import asyncpg
import pytest
from click.testing import CliRunner

from benchmarks.cli import bench


@pytest.mark.subprocess
@pytest.mark.timeout(600)
def test_throughput_runs_both_engines_and_loses_nothing(
    admin_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEFERRAL_DATABASE_URL", admin_url)
    out = tmp_path / "throughput.json"
    result = CliRunner().invoke(
        bench,
        [
            "throughput", "--tasks", "30", "--cycles", "12", "--workers", "2", "--slots", "4",
            "--out", str(out),
        ],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert (data["n"], data["workers"], data["slots"], data["pgqueuer_batch_size"]) == (30, 2, 4, 2)
    tasks = data["engine"]["tasks"]
    assert (tasks["tasks"], tasks["succeeded"], tasks["lost"], tasks["run_more_than_once"]) == (
        30, 30, 0, 0,
    )  # fmt: skip
    assert tasks["tasks_per_s"] > 0
    assert set(tasks["claim_to_end_ms"]) == {"p50", "p99", "max"}
    assert set(tasks["cpu_ms_per_task"]) >= {"workers", "scheduler", "triggerer", "total"}
    cycles = data["engine"]["cycles"]
    assert (cycles["cycles"], cycles["succeeded"], cycles["resumed"]) == (12, 12, 12)
    assert (cycles["lost"], cycles["resumed_twice"]) == (0, 0)
    for key in ("cycles_per_s", "deferrals_per_s", "resumes_per_s"):
        assert cycles[key] > 0, key
    # Every cycle deferred before it resumed.
    assert cycles["defer_to_resume_ms"]["p50"] >= cycles["defer_to_fire_ms"]["p50"] >= 0
    pgq = data["pgqueuer"]
    assert (pgq["jobs"], pgq["succeeded"], pgq["lost"], pgq["left_in_queue"]) == (30, 30, 0, 0)
    assert pgq["run_more_than_once"] == 0
    assert pgq["settings"]["max_concurrent_tasks"] == 4
    assert pgq["jobs_per_s"] > 0
    assert data["ratio_deferral_to_pgqueuer"] == pytest.approx(
        tasks["tasks_per_s"] / pgq["jobs_per_s"], rel=0.01
    )
    assert "ratio deferral / pgqueuer" in result.output
    # Both databases were dropped: the server holds neither after the run.
    assert asyncio.run(_bench_databases(admin_url)) == []


async def _bench_databases(admin_url: str) -> list[str]:
    conn = await asyncpg.connect(admin_url)
    try:
        rows = await conn.fetch(
            "SELECT datname FROM pg_database WHERE datname LIKE 'bench\\_tput\\_%' "
            "OR datname LIKE 'bench\\_pgq\\_%'"
        )
    finally:
        await conn.close()
    return [r["datname"] for r in rows]


def test_throughput_without_pgqueuer_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # pgqueuer not importable, as in an install without the bench extra.
    monkeypatch.setitem(sys.modules, "pgqueuer", None)
    result = CliRunner().invoke(bench, ["throughput", "--tasks", "10"])
    assert result.exit_code == 2
    assert "pip install 'deferral[bench]'" in result.output
    assert "--no-pgqueuer" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "1500"], "multiple of 1,000"),
        (["--slots", "10", "--pgq-batch", "6"], "max_concurrent_tasks >= 2 x batch_size"),
        (["--sweep", "1000,x"], "comma-separated list"),
        (["--sweep", "0"], "positive"),
        (["--dsn", "localhost:5432"], "not a PostgreSQL URL"),
    ],
    ids=["not-whole-runs", "batch-over-half", "sweep-not-numbers", "sweep-zero", "dsn"],
)
def test_throughput_refuses_bad_input_before_running(args: list[str], message: str) -> None:
    result = CliRunner().invoke(bench, ["throughput", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_throughput_on_a_server_it_cannot_reach_says_so() -> None:
    result = CliRunner().invoke(
        bench,
        ["throughput", "--tasks", "10", "--dsn", "postgresql://nobody@/none?host=/nonexistent"],
    )
    assert result.exit_code == 1
    assert "cannot use the server of --dsn" in result.output
    assert "Traceback" not in result.output
