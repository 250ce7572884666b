"""Regenerate docs/reference/cli.md from the click commands."""
import click
from engine.cli import cli

out = ["# The `deferral` command", "",
       "Generated from the command's own help (`deferral COMMAND --help` shows the same).", ""]

def walk(cmd, path):
    ctx = click.Context(cmd, info_name=" ".join(path))
    if path != ["deferral"]:
        out.append(f"## `{' '.join(path)}`")
        out.append("")
        out.append("```")
        out.append(cmd.get_help(ctx).replace("Usage: ", "usage: "))
        out.append("```")
        out.append("")
    if isinstance(cmd, click.Group):
        for name in sorted(cmd.list_commands(ctx)):
            walk(cmd.get_command(ctx, name), path + [name])

ctx = click.Context(cli, info_name="deferral")
out.append("```")
out.append(cli.get_help(ctx).replace("Usage: ", "usage: "))
out.append("```")
out.append("")
walk(cli, ["deferral"])
open("docs/reference/cli.md", "w").write("\n".join(out))
