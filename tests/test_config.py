"""Settings: default < file < environment < flag, errors that name the key and where its
value came from (file and line, variable, flag), and ``deferral config show``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from engine.cli import cli
from engine.config import ConfigError, Settings, key_line, load


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_precedence_default_file_env_flag(tmp_path: Path) -> None:
    toml = _write(
        tmp_path / "deferral.toml",
        "# settings\n[deferral]\nworker_slots = 4\npool_size = 3\nlog_level = 'WARNING'\n",
    )
    env = {
        "DEFERRAL_CONFIG": str(toml),
        "DEFERRAL_POOL_SIZE": "5",
        "DEFERRAL_LOG_LEVEL": "ERROR",
    }
    loaded = load(env, log_level="DEBUG")
    s = loaded.settings
    assert (s.triggerer_capacity, s.worker_slots, s.pool_size, s.log_level) == (
        1000,
        4,
        5,
        "DEBUG",
    )
    assert loaded.sources["triggerer_capacity"] == "default"
    assert loaded.sources["worker_slots"] == f"{toml}:3"
    assert loaded.sources["pool_size"] == "env DEFERRAL_POOL_SIZE"
    assert loaded.sources["log_level"] == "flag --log-level"
    assert loaded.file == str(toml)


def test_the_file_is_found_in_the_home_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no deferral.toml here
    home = tmp_path / "home"
    home.mkdir()
    _write(home / "deferral.toml", "[deferral]\nworker_slots = 9\n")
    loaded = load({"DEFERRAL_HOME": str(home)})
    assert loaded.settings.worker_slots == 9
    assert loaded.sources["worker_slots"] == f"{home / 'deferral.toml'}:2"
    # A deferral.toml in the current folder comes first.
    _write(tmp_path / "deferral.toml", "[deferral]\nworker_slots = 2\n")
    assert load({"DEFERRAL_HOME": str(home)}).settings.worker_slots == 2
    # --config (or DEFERRAL_CONFIG) comes before both.
    other = _write(tmp_path / "other.toml", "[deferral]\nworker_slots = 7\n")
    assert load({"DEFERRAL_HOME": str(home)}, config=str(other)).settings.worker_slots == 7


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        ("[deferral]\nwroker_slots = 4\n", "wroker_slots", 2),
        ("# a comment\n\n[deferral]\npool_size = 2\nworker_slots = '8'\n", "worker_slots", 5),
        ("[deferral]\ninsecure_dev = 'yes'\n", "insecure_dev", 2),
        ("[deferral]\ntrigger_allow = 'triggers.*'\n", "trigger_allow", 2),
        ("[deferral]\nworker_slots = 0\n", "worker_slots", 2),
    ],
    ids=["unknown-key", "wrong-type", "wrong-bool", "list-expected", "out-of-range"],
)
def test_a_bad_key_in_the_file_is_an_error_naming_key_file_and_line(
    tmp_path: Path, text: str, key: str, line: int
) -> None:
    toml = _write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError) as caught:
        load({}, config=str(toml))
    message = str(caught.value)
    assert key in message
    assert f"{toml}:{line}" in message


def test_a_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"worker_slots.*env DEFERRAL_WORKER_SLOTS"):
        load({"DEFERRAL_WORKER_SLOTS": "many"})
    with pytest.raises(ConfigError, match=r"metrics_port.*env DEFERRAL_METRICS_PORT"):
        load({"DEFERRAL_METRICS_PORT": "70000"})


def test_log_bounds_are_checked_and_reach_the_worker_and_triggerer() -> None:
    from engine.launch.app import log_limits

    with pytest.raises(ConfigError, match=r"log_max_try_bytes must be > 0.*DEFERRAL_LOG_MAX_TRY"):
        load({"DEFERRAL_LOG_MAX_TRY_BYTES": "0"})
    with pytest.raises(ConfigError, match=r"log_buffer_bytes must be at least .*\(5120\)"):
        load({"DEFERRAL_LOG_MAX_LINE_BYTES": "4096", "DEFERRAL_LOG_BUFFER_BYTES": "5000"})
    settings = load({"DEFERRAL_LOG_MAX_TRIGGER_BYTES": "1000"}).settings
    limits = log_limits(settings)
    assert (limits.max_trigger_bytes, limits.max_try_bytes) == (1000, 10 << 20)
    assert (limits.max_lines_per_s, limits.max_line_bytes) == (1000, 64 << 10)


def test_a_named_file_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="DEFERRAL_CONFIG"):
        load({"DEFERRAL_CONFIG": str(tmp_path / "missing.toml")})


def test_key_line_looks_only_inside_the_table() -> None:
    text = 'worker_slots = 1\n[other]\nworker_slots = 2\n[deferral]\n  "worker_slots" = 3\n'
    assert key_line(text, "worker_slots", "deferral") == 5
    assert key_line(text, "worker_slots", None) == 1
    assert key_line(text, "pool_size", "deferral") is None


def _clear_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No DEFERRAL_* variables (DEFERRAL_CONFIG among them); restored after the test."""
    monkeypatch.setenv("DEFERRAL_CONFIG", "")
    for name in [k for k in os.environ if k.startswith("DEFERRAL_")]:
        monkeypatch.delenv(name)


def _show(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, effective: bool = False
) -> Any:
    result = CliRunner().invoke(
        cli,
        [*args, "config", "show", "--json", *(["--effective"] if effective else [])],
        env={"DEFERRAL_HOME": str(tmp_path / "home"), **(env or {})},
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return {row["setting"]: row for row in msgspec.json.decode(result.output)}


def test_config_show_names_every_setting_and_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _clear_env(monkeypatch)
    toml = _write(
        tmp_path / "conf.toml",
        "[deferral]\nworker_slots = 4\ndatabase_url = 'postgresql://u:secret@db/x'\n",
    )
    rows = _show(
        tmp_path,
        "--config",
        str(toml),
        "--log-level",
        "DEBUG",
        env={"DEFERRAL_POOL_SIZE": "3", "DEFERRAL_FERNET_KEY": "k" * 44},
    )
    assert set(rows) == {f.name for f in msgspec.structs.fields(Settings)}
    assert rows["worker_slots"] == {
        "setting": "worker_slots",
        "value": 4,
        "source": f"{toml}:2",
    }
    assert rows["pool_size"]["source"] == "env DEFERRAL_POOL_SIZE"
    assert rows["log_level"] == {
        "setting": "log_level",
        "value": "DEBUG",
        "source": "flag --log-level",
    }
    assert rows["triggerer_capacity"]["source"] == "default"
    # Secrets are not printed.
    assert rows["fernet_key"]["value"] == "<hidden>"
    assert "secret" not in rows["database_url"]["value"]


def test_config_show_effective_derives_unset_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _clear_env(monkeypatch)
    plain = _show(tmp_path)
    effective = _show(tmp_path, effective=True)
    assert plain["database_url"]["value"] is None
    assert "embedded server" in effective["database_url"]["value"]
    assert effective["fernet_key_file"]["value"] == str(
        (tmp_path / "home" / "fernet.key").resolve()
    )
    assert effective["trigger_allow"]["value"][0] == "triggers.*"


def test_bad_settings_exit_2_with_the_key_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear_env(monkeypatch)
    toml = _write(tmp_path / "bad.toml", "[deferral]\n\nworker_slots = 'x'\n")
    result = CliRunner().invoke(cli, ["--config", str(toml), "config", "show"])
    assert result.exit_code == 2
    assert "worker_slots" in result.output
    assert f"{toml}:3" in result.output.replace("\n", "")


def test_the_outcome_linger_is_checked_and_reaches_the_worker() -> None:
    """`worker_outcome_linger_s`: 0 writes every outcome at once, a negative value is an
    error naming the setting; the value reaches the worker's config."""
    from engine.worker.config import WorkerConfig

    with pytest.raises(ConfigError, match=r"worker_outcome_linger_s must be >= 0"):
        load({"DEFERRAL_WORKER_OUTCOME_LINGER_S": "-0.01"})
    with pytest.raises(ConfigError, match=r"worker_outcome_linger_s.*DEFERRAL_WORKER_OUTCOME"):
        load({"DEFERRAL_WORKER_OUTCOME_LINGER_S": "soon"})
    assert WorkerConfig.from_settings(load({}).settings).outcome_linger_s == 0.01
    settings = load({"DEFERRAL_WORKER_OUTCOME_LINGER_S": "0"}).settings
    assert WorkerConfig.from_settings(settings).outcome_linger_s == 0
