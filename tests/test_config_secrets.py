"""A setting given a value of the wrong type or shape is an error naming the setting, where it
came from and what is expected, and never the value of a secret setting (``database_url``,
``fernet_key``): real TOML files, real environment variables, the real CLI (click's
CliRunner, and one command as a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine.cli import cli
from engine.config import ConfigError, load
from tests.helpers import REPO_ROOT

SECRET = "PASSWORD-1234"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No DEFERRAL_* variables of the test run's own, and no deferral.toml found by accident."""
    for name in [k for k in os.environ if k.startswith("DEFERRAL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DEFERRAL_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)


def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env=env)
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("setting", "toml_value"),
    [
        ("database_url", f'["postgresql://x:{SECRET}@h/d"]'),
        ("database_url", f'{{ url = "postgresql://x:{SECRET}@h/d" }}'),
        ("fernet_key", f'["{SECRET}"]'),
        ("fernet_key", f'{{ key = "{SECRET}" }}'),
    ],
    ids=["database_url-list", "database_url-table", "fernet_key-list", "fernet_key-table"],
)
@pytest.mark.parametrize("command", [["config", "show"], ["tasks", "list"], ["db", "url"]])
def test_a_secret_setting_of_the_wrong_type_is_never_printed(
    tmp_path: Path, setting: str, toml_value: str, command: list[str]
) -> None:
    toml = tmp_path / "deferral.toml"
    toml.write_text(f"[deferral]\nworker_slots = 2\n{setting} = {toml_value}\n")
    code, output = _cli("--config", str(toml), *command)
    assert code == 2, output
    assert SECRET not in output
    flat = " ".join(output.split())
    assert f"setting {setting}" in flat
    assert f"{toml}:3" in output.replace("\n", "")  # the file and line
    assert "Expected `str | null`" in flat  # the type expected
    assert "not shown" in flat


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (f"mysql://x:{SECRET}@h/d", "its scheme 'mysql' is not postgresql or postgres"),
        (f"postgresql://x:{SECRET}@h:port/d", "its host or port does not parse"),
        (f"postgresql://x:{SECRET}@h:99999/d", "its host or port does not parse"),
        (f"x:{SECRET}@h/d", "it has no scheme"),
        (f"{SECRET}://h/d", "its scheme is not"),
        (f"postgresql+asyncpg://x:{SECRET}@h/d", "its scheme 'postgresql+asyncpg' is not"),
    ],
    ids=["scheme", "port", "port-range", "no-scheme", "secret-as-scheme", "sqlalchemy-scheme"],
)
def test_a_database_url_of_the_wrong_shape_names_the_variable_not_the_value(
    url: str, problem: str
) -> None:
    code, output = _cli("config", "show", env={"DEFERRAL_DATABASE_URL": url})
    assert code == 2, output
    assert SECRET not in output
    flat = " ".join(output.split())
    assert "setting database_url must be a PostgreSQL URL" in flat
    assert problem in flat
    assert "env DEFERRAL_DATABASE_URL" in flat
    # The same from a file and from the flag.
    with pytest.raises(ConfigError) as caught:
        load({}, database_url=url)
    assert SECRET not in str(caught.value)
    assert "flag --database-url" in str(caught.value)


def test_good_database_urls_still_load() -> None:
    for url in (
        "postgresql://u:p@h:5432/d",
        "postgres://h/d",
        "postgresql:///d?host=/run/postgresql",
        "postgresql://u:p%40ss@[::1]:5432/d",
    ):
        assert load({"DEFERRAL_DATABASE_URL": url}).settings.database_url == url


def test_other_settings_show_their_value_masked(tmp_path: Path) -> None:
    code, output = _cli(
        "config", "show", env={"DEFERRAL_WORKER_SLOTS": f"postgresql://x:{SECRET}@h/d"}
    )
    assert code == 2, output
    assert SECRET not in output
    assert "'postgresql://x:***@h/d'" in output  # the value helps, its password is masked
    toml = tmp_path / "slots.toml"
    toml.write_text("[deferral]\nworker_slots = 'many'\n")
    code, output = _cli("--config", str(toml), "config", "show")
    assert code == 2, output
    assert "'many'" in output


@pytest.mark.subprocess
def test_the_deferral_command_never_prints_the_secret(tmp_path: Path) -> None:
    toml = tmp_path / "deferral.toml"
    toml.write_text(f'[deferral]\ndatabase_url = ["postgresql://x:{SECRET}@h/d"]\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEFERRAL_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "engine", "--config", str(toml), "config", "show", "--json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done
    assert SECRET not in done.stdout + done.stderr
    assert "database_url" in done.stderr
    assert "Traceback" not in done.stderr
