"""Bad command-line arguments get a usage error that names the argument, never a traceback or
a misleading "cannot use the database". Run against a real database, so a value that slipped
through would reach it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from engine.cli import cli
from tests.helpers import child_env


def _invoke(db_url: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env={"DEFERRAL_DATABASE_URL": db_url})
    return result.exit_code, result.output + (
        "" if result.exception is None or isinstance(result.exception, SystemExit)
        else f"raised {result.exception!r}"
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["tasks", "list", "--limit", "-1"], "--limit"),
        (["triggers", "list", "--limit", "-1"], "--limit"),
        (["tasks", "list", "--dag", "a\x00b"], "--dag"),
        (["tasks", "list", "--run", "r\x00"], "--run"),
        (["tasks", "list", "--state", "\x00"], "--state"),
        (["tasks", "list", "--dag", "caf\udce9"], "--dag"),
        (["dags", "trigger", "d\x00g"], "DAG_ID"),
        (["dags", "trigger", "d\udcffg"], "DAG_ID"),
        (["dags", "trigger", "dag", "--run-id", "r\x00"], "--run-id"),
        (["dags", "trigger", "dag", "--conf", '{"a": "\x00"}'], "--conf"),
        (["dags", "trigger", "dag", "--conf", '{"a": "\udce9"}'], "--conf"),
        (["dags", "trigger", "dag", "--conf", '{"a": "\\u0000"}'], "--conf"),
        (["dags", "trigger", "dag", "--conf", '{"\\udce9": 1}'], "--conf"),
        (["dags", "list", "--dags", "dags\x00"], "--dags"),
        (["dags", "trigger", "dag", "--wait", "--timeout", "-1"], "--timeout"),
        (["dags", "trigger", "dag", "--wait", "--timeout", "nan"], "--timeout"),
        (["--database-url", "postgresql://x\x00y", "tasks", "list"], "--database-url"),
        (["triggers", "logs", "0"], "ID"),
        (["triggers", "logs", "x"], "ID"),
        (["triggers", "logs", str(2**63)], "ID"),
        (["tasks", "logs", "d\x00", "r", "t"], "DAG"),
        (["tasks", "logs", "d", "r\udce9", "t"], "RUN"),
        (["tasks", "logs", "d", "r", "t", "--try", "0"], "--try"),
        (["tasks", "logs", "d", "r", "t", "--try", str(2**31)], "--try"),
        (["pools", "set", "p", "--slots", "-1"], "--slots"),
        (["pools", "set", "p", "--slots", str(2**31)], "--slots"),
        (["pools", "set", "p", "--slots", "x"], "--slots"),
        (["pools", "set", "p"], "--slots"),
        (["pools", "set", "", "--slots", "1"], "NAME"),
        (["pools", "set", "  ", "--slots", "1"], "NAME"),
        (["pools", "set", "p\x00", "--slots", "1"], "NAME"),
        (["pools", "set", "p", "--slots", "1", "--description", "d\udce9"], "--description"),
        (["pools", "delete", ""], "NAME"),
    ],
)
def test_a_bad_argument_is_a_usage_error_naming_it(
    db_url: str, args: list[str], names: str
) -> None:
    code, output = _invoke(db_url, *args)
    assert code == 2, output
    assert "Usage:" in output, output
    assert names in output, output
    assert "cannot use the database" not in output
    assert "Traceback" not in output
    assert "raised" not in output


def test_a_good_limit_still_reaches_the_database(db_url: str) -> None:
    code, output = _invoke(db_url, "tasks", "list", "--limit", "0", "--json")
    assert (code, output.strip()) == (0, "[]")


def test_non_utf8_bytes_on_the_real_command_line_are_a_usage_error(db_url: str) -> None:
    """What a shell passes: bytes that are not UTF-8 (Python decodes them with
    surrogateescape)."""
    env = child_env(DATABASE_URL=db_url)
    result = subprocess.run(
        [sys.executable.encode(), b"-m", b"engine", b"tasks", b"list", b"--dag", b"caf\xe9"],
        env=env,
        capture_output=True,
        check=False,
        timeout=60,
    )
    err = result.stderr.decode("utf-8", "replace")
    assert result.returncode == 2, err
    assert "--dag" in err
    assert "UTF-8" in err
    assert "Traceback" not in err
    assert "cannot use the database" not in err
