"""What ``deferral triggers logs`` and ``deferral tasks logs`` share: printing stored log
lines, page by page, and following them (polling) until the trigger is gone or the try ended."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import anyio
import click
import msgspec

from engine.cli.common import _run
from engine.masking import redact_text

if TYPE_CHECKING:
    from engine.store import LogLine

__all__ = ["PAGE_LINES", "POLL_S", "follow_pages", "print_line", "run_following"]

#: Lines read per query.
PAGE_LINES = 1000
#: How often --follow reads again.
POLL_S = 0.5

P = TypeVar("P")


def print_line(line: LogLine, *, as_json: bool) -> None:
    """One line: ``time level logger message`` (prints: ``[stdout]``/``[stderr]`` in place
    of the logger), or one JSON object. The message is masked (it was stored masked; this
    also masks what a secret registered here, or a line stored earlier, holds)."""
    line = msgspec.structs.replace(line, message=redact_text(line.message))
    if as_json:
        click.echo(msgspec.json.encode(line).decode())
        return
    at = line.at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    source = line.logger if line.stream == "log" else f"[{line.stream}]"
    click.echo(f"{at} {line.level:<7} {source} {line.message}")


async def follow_pages(
    read: Callable[[int], Awaitable[P]],
    lines_of: Callable[[P], list[LogLine]],
    next_seq_of: Callable[[P], int],
    over: Callable[[P], bool],
    *,
    follow: bool,
    as_json: bool,
    after_seq: int = 0,
) -> P:
    """Print every page ``read(after_seq)`` returns; with ``follow``, read again every
    ``POLL_S`` until a page that is not full says it is ``over`` (its lines, read in the same
    statement, are then all there is). Returns the last page."""
    while True:
        page = await read(after_seq)
        lines = lines_of(page)
        for line in lines:
            print_line(line, as_json=as_json)
        after_seq = next_seq_of(page)
        if len(lines) >= PAGE_LINES:
            continue
        if not follow or over(page):
            return page
        sys.stdout.flush()
        await anyio.sleep(POLL_S)


def run_following(main: Callable[[], Awaitable[P]]) -> P | None:
    """Run the command's coroutine; Ctrl-C ends it quietly (None)."""
    try:
        return _run(main)
    except KeyboardInterrupt:
        return None
