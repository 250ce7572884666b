"""Write docs/reference/cli.md from the commands' own help: python tools/gen_cli_reference.py"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from engine.cli import cli

DOC = Path(__file__).resolve().parent.parent / "docs" / "reference" / "cli.md"


def _context(cmd: click.Command, name: str, parent: click.Context | None) -> click.Context:
    # Built the way click builds them when the command runs, so settings such as the help
    # option's names are inherited from the parent exactly as users see them.
    return cmd.make_context(
        name,
        [],
        parent=parent,
        resilient_parsing=True,
        terminal_width=100,
        max_content_width=100,
    )


def _help(ctx: click.Context) -> str:
    return ctx.get_help().replace("Usage: ", "usage: ")


def render() -> str:
    root = _context(cli, "deferral", None)
    out = [
        "# The `deferral` command",
        "",
        "Generated from the command's own help by `python tools/gen_cli_reference.py`",
        "(`deferral COMMAND --help` shows the same).",
        "",
        "```",
        _help(root),
        "```",
        "",
    ]

    def walk(ctx: click.Context) -> None:
        cmd = ctx.command
        if isinstance(cmd, click.Group):
            for name in sorted(cmd.list_commands(ctx)):
                sub = cmd.get_command(ctx, name)
                if sub is None:
                    continue
                sub_ctx = _context(sub, name, ctx)
                out.extend(["## `" + sub_ctx.command_path + "`", "", "```", _help(sub_ctx)])
                out.extend(["```", ""])
                walk(sub_ctx)

    walk(root)
    return "\n".join(out)


if __name__ == "__main__":
    DOC.write_text(render())
    sys.stdout.write(f"wrote {DOC}\n")
