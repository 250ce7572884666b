"""What a stored log line's text becomes: the one place where the text a trigger or a task
logged or printed is turned into the message kept in the database.

Every line goes through :func:`stored_text` once, whatever it came from (a record of any
logger, a print, a line of an isolated task's child process, the engine's own line about a
failed try), before it is buffered (engine/usercode/logsink.py). Whatever must change in what is
stored is done here: the cut of a line over the length limit, the escapes PostgreSQL text needs
(and, when they come, the masks of secrets: before the cut, so that a secret is never half kept).
"""

from __future__ import annotations

from engine.store.core import storable

__all__ = ["cut_mark", "stored_text", "utf8_len"]

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
