"""The ``deferral`` command (engine.cli.root) and its groups, one module each."""

from engine.cli.common import _run
from engine.cli.root import cli, main

__all__ = ["_run", "cli", "main"]
