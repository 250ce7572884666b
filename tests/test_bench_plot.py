"""Benchmark figures: ``--plot`` without matplotlib is a usage error naming the ``plot`` extra
before any run starts, and ``bench plot`` draws a saved result of either benchmark."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks.cli import bench
from tests.helpers import REPO_ROOT, child_env

#: Runs the CLI with ``import matplotlib`` failing, as without the ``plot`` extra.
_WITHOUT_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; "
    "from engine.cli import main; sys.argv[0] = 'deferral'; main()"
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _without_matplotlib(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_MATPLOTLIB, *args],
        cwd=tmp_path,
        # A database no run could use: a run that started would fail otherwise than exit 2.
        env=child_env(DATABASE_URL="postgresql://nobody@/none?host=/nonexistent"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "args",
    [
        ("bench", "waits", "--triggers", "1000", "--plot", "w.png"),
        ("bench", "fleet", "--sensors", "2", "--plot", "f.png"),
        ("bench", "throughput", "--tasks", "10", "--plot", "t.png"),
        ("bench", "plot", str(REPO_ROOT / "docs/benchmarks/waits-1k-w10.json")),
    ],
    ids=["waits", "fleet", "throughput", "plot"],
)
def test_plotting_without_matplotlib_fails_at_once_naming_the_extra(
    args: tuple[str, ...], tmp_path: Path
) -> None:
    done = _without_matplotlib(*args, tmp_path=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "pip install 'deferral[plot]'" in output, output
    assert "floor" not in output, output  # bench waits' first step never started
    assert "Traceback" not in output, output
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize(
    ("saved", "kind"),
    [
        ("waits-10k-w10.json", "waits"),
        ("fleet-2000x8-w60.json", "fleet"),
        ("throughput-sweep-2w100-run1.json", "throughput"),
    ],
)
def test_bench_plot_draws_a_saved_result(saved: str, kind: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / f"{kind}.png"
    result = CliRunner().invoke(
        bench, ["plot", str(REPO_ROOT / "docs/benchmarks" / saved), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert f"wrote {out} ({kind})" in result.output
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_bench_plot_writes_next_to_the_result_by_default(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    saved = tmp_path / "result.json"
    saved.write_text((REPO_ROOT / "docs/benchmarks/waits-1k-w10.json").read_text())
    result = CliRunner().invoke(bench, ["plot", str(saved)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "result.png").read_bytes()[:8] == PNG_SIGNATURE


def test_bench_plot_of_a_file_that_is_no_result_is_a_usage_error(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    result = CliRunner().invoke(bench, ["plot", str(other)])
    assert result.exit_code == 2, result.output
    assert "RESULT_FILE" in result.output
    assert "not a result of bench waits, bench fleet or bench throughput" in result.output
