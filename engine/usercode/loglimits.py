"""The bounds of the log lines a process stores per trigger and per try (the settings
``log_*``), and their defaults: what a worker or a triggerer is given
(:meth:`LogLimits.from_settings`) and its log buffer enforces
(engine/usercode/logbuffer.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from engine.config import Settings

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_FLUSH_INTERVAL_S",
    "DEFAULT_MAX_LINES_PER_S",
    "DEFAULT_MAX_LINE_BYTES",
    "DEFAULT_MAX_TOTAL_BYTES",
    "LINE_OVERHEAD",
    "LogLimits",
]

#: Lines a trigger or a try may log a second (between two writes); older ones are dropped.
DEFAULT_MAX_LINES_PER_S = 1000
#: Bytes of text one trigger, or one try, stores in all.
DEFAULT_MAX_TOTAL_BYTES = 10 << 20
#: A longer line is cut here (with a note of how much was cut).
DEFAULT_MAX_LINE_BYTES = 64 << 10
#: Memory for the lines one process holds, all triggers or tries together.
DEFAULT_BUFFER_BYTES = 32 << 20
#: How often buffered lines are written.
DEFAULT_FLUSH_INTERVAL_S = 1.0
#: What a buffered line costs besides its text: its tuple, time, strings' headers, list slot.
LINE_OVERHEAD = 200


class LogLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The bounds of the stored logs of one process (settings ``log_max_lines_per_s``,
    ``log_max_try_bytes``, ``log_max_trigger_bytes``, ``log_max_line_bytes``,
    ``log_buffer_bytes``; what each bounds: engine/usercode/logbuffer.py)."""

    max_lines_per_s: int = DEFAULT_MAX_LINES_PER_S
    max_try_bytes: int = DEFAULT_MAX_TOTAL_BYTES
    max_trigger_bytes: int = DEFAULT_MAX_TOTAL_BYTES
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    buffer_bytes: int = DEFAULT_BUFFER_BYTES

    def __post_init__(self) -> None:
        for name in ("max_lines_per_s", "max_try_bytes", "max_trigger_bytes", "max_line_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        least = self.max_line_bytes + 1024
        if self.buffer_bytes < least:
            raise ValueError(
                f"buffer_bytes must be at least max_line_bytes + 1024 ({least}), "
                f"got {self.buffer_bytes}"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> LogLimits:
        """The bounds the settings ``log_max_lines_per_s``, ``log_max_try_bytes``,
        ``log_max_trigger_bytes``, ``log_max_line_bytes`` and ``log_buffer_bytes`` give."""
        return cls(
            max_lines_per_s=settings.log_max_lines_per_s,
            max_try_bytes=settings.log_max_try_bytes,
            max_trigger_bytes=settings.log_max_trigger_bytes,
            max_line_bytes=settings.log_max_line_bytes,
            buffer_bytes=settings.log_buffer_bytes,
        )
