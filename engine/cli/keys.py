"""``deferral keys``: make encryption keys and re-encrypt stored values with a new one."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from engine.cli.common import _run
from engine.cli.pipes import PipeConsole
from engine.config import Settings
from engine.security.keys import generate_key, write_key_file

__all__ = ["keys"]

err_console = PipeConsole(stderr=True)


@click.group()
def keys() -> None:
    """Encryption keys of trigger kwargs, resume kwargs, events, results, Variables and
    connections."""


@keys.command("generate")
@click.option(
    "--file",
    "path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the key to this file (mode 0600; refused if it exists) instead of printing it.",
)
def keys_generate(path: Path | None) -> None:
    """Make a new Fernet key.

    Printed on stdout, or written to --file. To rotate: add it after the current key in
    fernet_key / DEFERRAL_FERNET_KEY on every process, then move it first on every process,
    then run `deferral keys rotate` (docs/explanation/security.md, "Rotating a key").
    """
    key = generate_key()
    if path is None:
        click.echo(key)
        return
    if not write_key_file(path, key):
        err_console.print(f"[red]error[/]: {path} exists; not overwritten")
        sys.exit(2)
    err_console.print(f"wrote a new key to {path} (mode 0600)")


@keys.command("rotate")
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=500,
    show_default=True,
    help="Rows read and rewritten per short transaction.",
)
@click.pass_context
def keys_rotate(ctx: click.Context, batch_size: int) -> None:
    """Re-encrypt every stored value with the first (primary) key, online: trigger kwargs,
    resume kwargs, events, results, Variables and connections' passwords and extras.

    Configure the keys as "NEW,OLD" in every process first (restart them), then run this;
    once it reports nothing left under an old key, OLD can be dropped. Exit 1 when some
    values could not be rewritten (no configured key opens them, or they changed meanwhile:
    run it again).
    """
    settings: Settings = ctx.obj["settings"]

    async def main() -> dict[str, int]:
        from engine.store import open_store

        store = await open_store(settings)
        try:
            if not store.keyring.encrypts:
                raise click.UsageError("no encryption key is configured: nothing to rotate to")
            counts = await store.rotate_keys(batch_size=batch_size)
            # Variables and stored connections' secrets too.
            more = await store.rotate_secret_values(batch_size=batch_size)
            return {name: counts[name] + more[name] for name in counts}
        finally:
            await store.close()

    counts = _run(main)
    click.echo(
        f"re-encrypted {counts['rewritten']}, already under the primary key {counts['current']}, "
        f"changed meanwhile {counts['changed']}, unreadable with these keys {counts['unreadable']}"
    )
    if counts["changed"] or counts["unreadable"]:
        sys.exit(1)
