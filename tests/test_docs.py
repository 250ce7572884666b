"""Docs that describe code stay in step with it."""

from __future__ import annotations

import msgspec

from engine.config import Settings
from engine.states import TRANSITIONS
from engine.worker.templating import TEMPLATE_VARIABLES
from tests.helpers import REPO_ROOT


def test_the_state_page_lists_every_transition_and_no_other() -> None:
    text = (REPO_ROOT / "docs/explanation/states.md").read_text()
    listed = {
        (line.split("`")[1], line.split("`")[3])
        for line in text.splitlines()
        if line.startswith("| `")
    }
    assert listed == set(TRANSITIONS)


def test_every_setting_is_documented() -> None:
    text = (REPO_ROOT / "docs/reference/settings.md").read_text()
    missing = [f for f in msgspec.structs.fields(Settings) if f"`{f.name}`" not in text]
    assert not missing, [f.name for f in missing]


def test_the_settings_reference_is_generated_from_the_settings() -> None:
    import runpy

    module = runpy.run_path(
        str(REPO_ROOT / "tools" / "gen_settings_reference.py"), run_name="check"
    )
    text = (REPO_ROOT / "docs/reference/settings.md").read_text()
    assert text == module["render"](), "run: python tools/gen_settings_reference.py"


def test_the_cli_reference_is_generated_from_the_current_commands() -> None:
    import runpy

    module = runpy.run_path(str(REPO_ROOT / "tools" / "gen_cli_reference.py"), run_name="check")
    text = (REPO_ROOT / "docs/reference/cli.md").read_text()
    assert text == module["render"](), "run: python tools/gen_cli_reference.py"


def test_the_template_reference_lists_every_variable_and_macro() -> None:
    text = (REPO_ROOT / "docs/reference/templates.md").read_text()
    macros = ["macros.ds_add", "macros.ds_format", "macros.datetime", "macros.timedelta"]
    missing = [name for name in [*TEMPLATE_VARIABLES, *macros] if f"| `{name}" not in text]
    assert not missing, missing
    assert "reference/templates.md" in (REPO_ROOT / "docs/index.md").read_text()
