"""The sensor that waits for a file to appear."""

from __future__ import annotations

from typing import Any

from operators.base import Context
from operators.sensors.base import BaseSensorOperator
from triggers.base import BaseTrigger
from triggers.file import FileTrigger, find_files

__all__ = ["FileSensor"]


class FileSensor(BaseSensorOperator):
    """Waits until ``filepath`` (a path or glob; ``**`` with ``recursive``) matches a file;
    the result is the sorted list of matches."""

    template_fields = ("filepath",)

    def __init__(self, *, filepath: str, recursive: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filepath = filepath
        self.recursive = bool(recursive)

    def poke(self, context: Context) -> Any:
        return find_files(self.filepath, self.recursive) or None

    def trigger(self, context: Context) -> BaseTrigger:
        return FileTrigger(self.filepath, recursive=self.recursive, **self.trigger_kwargs())
