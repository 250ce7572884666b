"""What a stored log line's text becomes: the one place where the text a trigger or a task
logged or printed is turned into the message kept in the database.

Every line goes through :func:`stored_text` once, whatever it came from (a record of any
logger, a print, a line of an isolated task's child process, the engine's own line about a
failed try), before it is buffered (engine/usercode/logbuffer.py). Whatever must change in what is
stored is done here: the cut of a line over the length limit, the escapes PostgreSQL text needs
(and, when they come, the masks of secrets: before the cut, so that a secret is never half kept).
"""

from __future__ import annotations

from engine.store.core import storable

__all__ = ["NO_LINE", "cut_mark", "extend_line", "size_text", "stored_text", "utf8_len"]

#: Characters encoded at a time when a long text is measured (never the whole text at once).
_CHUNK = 1 << 20


def utf8_len(text: str, start: int = 0, stop: int | None = None) -> int:
    """Bytes of ``text[start:stop]`` in UTF-8 (lone surrogates as 3 bytes each), measured
    without encoding a long text in one piece."""
    stop = len(text) if stop is None else min(stop, len(text))
    if start >= stop:
        return 0
    if text.isascii():
        return stop - start
    return sum(
        len(text[i : min(i + _CHUNK, stop)].encode("utf-8", "surrogatepass"))
        for i in range(start, stop, _CHUNK)
    )


def cut_mark(cut: int) -> str:
    """What ends a line of which ``cut`` bytes were cut."""
    return f" [... {cut} bytes cut]"


def stored_text(text: str, *, max_bytes: int, cut: int = 0) -> tuple[str, int]:
    """The message stored for a line ``text`` (of which ``cut`` bytes were already cut where it
    was read), and its size in bytes (UTF-8, as PostgreSQL counts it): at most ``max_bytes`` of
    the text, then ``[... N bytes cut]`` when any was cut; NUL characters and lone surrogates
    escaped (PostgreSQL text holds neither)."""
    if len(text) > max_bytes:  # (a character is at least one byte: over the limit for sure)
        cut += utf8_len(text, max_bytes)
        text = text[:max_bytes]
    if text.isascii():
        if "\x00" in text:
            text = text.replace("\x00", "\\x00")
            if len(text) > max_bytes:
                cut += len(text) - max_bytes
                text = text[:max_bytes]
        size = len(text)
    else:
        text = storable(text)
        data = text.encode("utf-8")
        size = len(data)
        if size > max_bytes:
            text = data[:max_bytes].decode("utf-8", "ignore")  # (no half character kept)
            kept = len(text.encode("utf-8"))
            cut += size - kept
            size = kept
    if cut:
        mark = cut_mark(cut)
        text += mark
        size += len(mark)
    return text, size


#: No printed line waiting: its text and the bytes cut of it.
NO_LINE = ("", 0)


def extend_line(
    head: str, cut: int, text: str, start: int, stop: int, limit: int
) -> tuple[str, int]:
    """A printed line ``head`` (``cut`` bytes cut of it) continued by ``text[start:stop]``:
    kept up to ``limit`` characters (at least as many bytes), the rest counted as cut (a
    line printed in many pieces is never held longer than it can be stored)."""
    room = limit - len(head)
    n = stop - start
    if n <= room:
        if not head and start == 0 and stop == len(text):
            return text, cut  # (the whole text: no copy)
        return head + text[start:stop], cut
    kept = max(room, 0)
    return head + text[start : start + kept], cut + utf8_len(text, start + kept, stop)


def size_text(n: int) -> str:
    """``n`` bytes as a reader would say it: ``10 MiB``, ``256 KiB``, ``1000 bytes``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"
