"""Wait for a file (or a glob pattern) to exist."""

from __future__ import annotations

import glob
import os
from typing import Any

import anyio.to_thread

from triggers.polling import DEFAULT_POLL_INTERVAL_S, PollingTrigger

__all__ = ["FileTrigger", "find_files"]


def _holds_files(folder: str, recursive: bool) -> bool:
    for _root, _dirs, files in os.walk(folder):
        if files:
            return True
        if not recursive:
            return False
    return False


def find_files(filepath: str, recursive: bool) -> list[str]:
    """Files matching ``filepath`` (a path or a glob; ``**`` with ``recursive``), sorted.

    A directory matches when it holds at least one file (recursively with ``recursive``).
    Blocking: call it in a thread from async code.
    """
    found: list[str] = []
    for path in sorted(glob.glob(filepath, recursive=recursive)):
        if os.path.isfile(path) or (os.path.isdir(path) and _holds_files(path, recursive)):
            found.append(path)
    return found


class FileTrigger(PollingTrigger):
    """Fires when ``filepath`` matches at least one file; the payload is the sorted list of
    matching paths. The glob and stat calls run in a thread, never on the triggerer's loop."""

    def __init__(
        self,
        filepath: str,
        *,
        recursive: bool = False,
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        end_from_trigger: bool = False,
    ) -> None:
        super().__init__(poll_interval=poll_interval, end_from_trigger=end_from_trigger)
        if not isinstance(filepath, str) or not filepath:
            raise ValueError(f"filepath must be a non-empty string, got {filepath!r}")
        self.filepath = filepath
        self.recursive = bool(recursive)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggers.file.FileTrigger",
            {"filepath": self.filepath, "recursive": self.recursive, **self._base_kwargs()},
        )

    async def check(self) -> list[str] | None:
        found = await anyio.to_thread.run_sync(find_files, self.filepath, self.recursive)
        return found or None
