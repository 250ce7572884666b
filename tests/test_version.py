"""``deferral --version`` prints the version the package is built with."""

from __future__ import annotations

import tomllib

from click.testing import CliRunner

from engine.cli import cli
from tests.helpers import REPO_ROOT


def test_version_prints_the_projects_version() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    result = CliRunner().invoke(cli, ["--version"], prog_name="deferral")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"deferral, version {project['version']}"
