"""``deferral demo`` runs its DAG through real engine processes and exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.helpers import REPO_ROOT


@pytest.mark.subprocess
def test_the_demo_runs_to_success_and_prints_its_summary(admin_url: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "DEFERRAL_DATABASE_URL": admin_url,
        "DEFERRAL_HOME": str(tmp_path),
        "COLUMNS": "120",
    }
    done = subprocess.run(
        [sys.executable, "-m", "engine", "demo", "--sensors", "20", "--jobs", "2", "--window", "1"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "run success" in out
    # 20 sensors and 2 jobs, each with a downstream task: 44 tasks, all successful.
    assert re.search(r"tasks success\s*\S\s*44\b", out), out
    assert "peak waits held by the triggerer" in out
    assert "peak worker slots held by waiting tasks after that" in out
    log = (tmp_path / "demo.log").read_text()
    for kind in ("scheduler", "worker", "triggerer"):
        assert f" {kind}[" in log, log  # every process wrote its lines there
    # It ends by naming its DAG file and what to do next.
    tail = " ".join(out[out.index("The demo DAG is") :].split())
    assert str(tmp_path / "demo_dags" / "deferral_demo.py") in tail, tail
    assert "docs/tutorial.md" in tail, tail
    assert "deferral standalone --dags FOLDER" in tail, tail
    # The database's password is not printed.
    assert urlsplit(admin_url).password is None or urlsplit(admin_url).password not in out
