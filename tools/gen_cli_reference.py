"""Write docs/reference/cli.md from the commands' own help: python tools/gen_cli_reference.py"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from engine.cli import cli

DOC = Path(__file__).resolve().parent.parent / "docs" / "reference" / "cli.md"


def _help(cmd: click.Command, path: list[str]) -> str:
    ctx = click.Context(cmd, info_name=" ".join(path), terminal_width=100, max_content_width=100)
    return cmd.get_help(ctx).replace("Usage: ", "usage: ")


def render() -> str:
    out = [
        "# The `deferral` command",
        "",
        "Generated from the command's own help by `python tools/gen_cli_reference.py`",
        "(`deferral COMMAND --help` shows the same).",
        "",
        "```",
        _help(cli, ["deferral"]),
        "```",
        "",
    ]

    def walk(cmd: click.Command, path: list[str]) -> None:
        if len(path) > 1:
            out.extend([f"## `{' '.join(path)}`", "", "```", _help(cmd, path), "```", ""])
        if isinstance(cmd, click.Group):
            ctx = click.Context(cmd, info_name=" ".join(path))
            for name in sorted(cmd.list_commands(ctx)):
                sub = cmd.get_command(ctx, name)
                if sub is not None:
                    walk(sub, [*path, name])

    walk(cli, ["deferral"])
    return "\n".join(out)


if __name__ == "__main__":
    DOC.write_text(render())
    sys.stdout.write(f"wrote {DOC}\n")
