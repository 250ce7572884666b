"""What every scenario's command shares: its ``--out`` and ``--keep-db`` options, and how its
result is written (JSON, to ``--out`` or stdout)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

__all__ = ["keep_db_option", "out_option", "write_result"]

F = TypeVar("F", bound=Callable[..., Any])


def out_option(command: F) -> F:
    """``--out FILE``: write the JSON result there instead of stdout."""
    return click.option("--out", type=click.Path(dir_okay=False), help="Write the JSON here.")(
        command
    )


def keep_db_option(databases: str = "database") -> Callable[[F], F]:
    """``--keep-db``: leave the benchmark's database(s) for a look afterwards."""
    return click.option("--keep-db", is_flag=True, help=f"Do not drop the benchmark {databases}.")


def write_result(result: Any, out: str | None) -> None:
    """The result as indented JSON, to ``out`` (a file path) or else to stdout."""
    text = json.dumps(result, indent=2) + "\n"
    if out:
        Path(out).write_text(text)
    else:
        sys.stdout.write(text)
