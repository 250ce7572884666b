"""docs/reference/operators.md names every operator and sensor, every parameter of their
``__init__``, every trigger rule and every context key: a parameter added to the code and not
to the page fails here."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import typing

import pytest

import operators
from operators.base import DEFAULT_RETRY_DELAY_S, TRIGGER_RULES, BaseOperator, Context
from tests.helpers import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "reference" / "operators.md"


def operator_classes() -> list[type[BaseOperator]]:
    """Every public BaseOperator subclass (and BaseOperator) defined in the operators package."""
    found: dict[str, type[BaseOperator]] = {}
    for info in pkgutil.walk_packages(operators.__path__, "operators."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                isinstance(obj, type)
                and issubclass(obj, BaseOperator)
                and obj.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found[f"{obj.__module__}.{name}"] = obj
    return [found[key] for key in sorted(found)]


def parameters(cls: type[BaseOperator]) -> list[str]:
    return [
        p.name
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


def test_the_operator_classes_are_found() -> None:
    names = {cls.__name__ for cls in operator_classes()}
    assert {"BaseOperator", "PythonOperator", "BashOperator", "BaseSensorOperator"} <= names
    assert {"FileSensor", "HttpSensor", "SqlSensor", "PythonSensor"} <= names


@pytest.mark.parametrize("cls", operator_classes(), ids=lambda cls: cls.__name__)
def test_every_operator_and_its_parameters_are_documented(cls: type[BaseOperator]) -> None:
    text = PAGE.read_text()
    assert f"`{cls.__name__}`" in text
    missing = [name for name in parameters(cls) if f"`{name}`" not in text]
    assert not missing, f"{cls.__name__}: document {missing} in {PAGE.name}"


def test_every_trigger_rule_is_documented() -> None:
    text = PAGE.read_text()
    missing = sorted(rule for rule in TRIGGER_RULES if f"| `{rule}`" not in text)
    assert not missing


def test_every_context_key_is_documented() -> None:
    text = PAGE.read_text()
    missing = [key for key in typing.get_type_hints(Context) if f"| `{key}` |" not in text]
    assert not missing


def test_the_documented_retry_delay_is_the_default() -> None:
    assert inspect.signature(BaseOperator.__init__).parameters["retry_delay"].default == 300
    assert DEFAULT_RETRY_DELAY_S == 300
    assert "retry_delay=300" in PAGE.read_text()


def _slug(heading: str) -> str:
    """The anchor a Markdown heading gets (GitHub's rule, for the characters we use)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_links_of_the_docs_index_reach_their_pages_and_headings() -> None:
    index = REPO_ROOT / "docs" / "index.md"
    links = re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", index.read_text())
    assert ("reference/operators.md", "") in links
    for target, anchor in links:
        page = index.parent / target
        assert page.is_file(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
            assert anchor in {_slug(h) for h in headings}, (target, anchor)
