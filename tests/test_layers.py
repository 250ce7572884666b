"""Fewer copies, checked: one parser of named SQL files, one dotted-path importer with one error
shape, PythonSensor with the other sensors, and a runtime that does not load the benchmarks."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from engine.cli import cli
from engine.store.queries import load_queries as store_queries
from operators.sensors import PythonSensor
from triggers.base import ImportPathError, TriggerSerializationError, import_trigger_class
from triggers.http import HttpTrigger
from triggers.python import PythonTrigger
from triggers.sqlfiles import parse_queries

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "triggers", "operators")

#: A secret-looking module constant: an import path naming it must not print its value.
SECRET_VALUE = "s3cr3t-value-never-printed"


def _sources() -> dict[str, str]:
    return {
        str(path.relative_to(REPO)): path.read_text()
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    return set(out.split())


def test_importing_the_runtime_loads_no_benchmark_module() -> None:
    loaded = _loaded_after(
        "import engine, engine.cli, engine.launch.app, engine.worker.worker, "
        "engine.triggerer, engine.scheduler.scheduler, engine.store, operators.sensors, "
        "operators.python, operators.bash"
    )
    assert "engine.cli" in loaded
    assert sorted(m for m in loaded if m.split(".")[0] == "benchmarks") == []


def test_the_bench_command_still_loads_on_use() -> None:
    result = CliRunner().invoke(cli, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    assert "Benchmarks of the engine" in result.output
    assert "bench" in CliRunner().invoke(cli, ["--help"]).output


def test_sensors_do_not_import_the_python_operators() -> None:
    assert "operators.python" not in _loaded_after("import operators.sensors")


def test_python_sensor_lives_with_the_sensors_and_is_still_importable_from_python() -> None:
    from operators.python import PythonSensor as FromPython

    assert FromPython is PythonSensor
    assert PythonSensor.__module__ == "operators.sensors.python"


def test_the_sensors_mirror_the_triggers_one_module_per_family() -> None:
    import operators.sensors

    families = set()
    for name in operators.sensors.__all__:
        package, family = getattr(operators.sensors, name).__module__.rsplit(".", 1)
        assert package == "operators.sensors", name
        families.add(family)
    # Every family but the base waits, deferred, on the triggers of the same name.
    assert families - {"base"} == {
        "temporal",
        "file",
        "http",
        "sql",
        "external_task",
        "python",
        "bash",
    }
    for family in families - {"base"}:
        assert importlib.util.find_spec(f"triggers.{family}") is not None, family


def test_one_parser_reads_every_named_sql_file() -> None:
    # The parser is the one module holding a pattern for the block header.
    copies = [name for name, text in _sources().items() if "-- name: (" in text]
    assert copies == ["triggers/sqlfiles.py"]
    assert "claim_tasks" in store_queries()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("-- name: a\n-- says what\n", r"^x\.sql: query 'a' is empty$"),
        ("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n", r"^x\.sql: query 'a' is defined twice$"),
    ],
)
def test_the_sql_parser_names_the_file_in_its_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_queries(text, "x.sql")


def test_one_importer_imports_every_dotted_path() -> None:
    importers = [name for name, text in _sources().items() if "importlib.import_module(" in text]
    # engine/dags/dagparse.py imports DAG *files* by their file path: not a dotted-path import.
    assert importers == ["engine/dags/dagparse.py", "triggers/base.py"]


def _exits_on_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "exits_on_import_mod.py").write_text("raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "exits_on_import_mod.check"


BAD_PATHS = [
    ("NoDots", r"must be a dotted import path 'module\.name'$"),
    ("__main__.check", r"points into __main__, which other processes cannot import"),
    ("no_such_module_xyz.check", r"cannot be imported: module 'no_such_module_xyz' raised "),
    ("tests.test_layers.missing", r"cannot be imported: module 'tests.test_layers' has no attr"),
    ("tests.test_layers.SECRET_VALUE", r"names a str, which is not "),
]


def _entry_points() -> dict[str, tuple[type[Exception], str, object]]:
    """Each way a user's dotted path reaches the importer: (error, role in message, call)."""
    return {
        "trigger": (TriggerSerializationError, "trigger classpath", import_trigger_class),
        "python check": (ImportPathError, "check", lambda p: PythonTrigger(p)),
        "http check": (
            ImportPathError,
            "response_check",
            lambda p: HttpTrigger("http://127.0.0.1/", response_check=p),
        ),
        "sensor": (
            ImportPathError,
            "check",
            lambda p: PythonSensor(
                task_id="s", python_callable=bool, deferrable=True, async_check=p
            ).trigger({}),
        ),
    }


@pytest.mark.parametrize("entry", sorted(_entry_points()))
@pytest.mark.parametrize(("path", "reason"), BAD_PATHS, ids=[p for p, _ in BAD_PATHS])
def test_every_bad_import_path_fails_with_one_error_shape(
    entry: str, path: str, reason: str
) -> None:
    error, role, call = _entry_points()[entry]
    with pytest.raises(error) as info:
        call(path)  # type: ignore[operator]
    message = str(info.value)
    assert re.match(rf"^{re.escape(role)} {re.escape(repr(path))} ", message), message
    assert re.search(reason, message), message
    assert SECRET_VALUE not in message


def test_user_code_exiting_on_import_is_an_import_path_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _exits_on_import(tmp_path, monkeypatch)
    with pytest.raises(ImportPathError, match=r"^check .* raised SystemExit: 3$"):
        PythonTrigger(path)


def test_a_lazy_command_that_does_not_import_is_an_import_path_error() -> None:
    group = type(cli)(name="g", lazy={"gone": "no_such_module_xyz.command"})
    with pytest.raises(ImportPathError, match=r"^command 'no_such_module_xyz.command' "):
        group.get_command(click.Context(group), "gone")
