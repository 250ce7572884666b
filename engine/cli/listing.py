"""How the listing commands show what they list: task instance tables and JSON rows, times,
durations, values as compact JSON, and every value that may hold a secret (results, errors,
rendered fields, run confs, trigger kwargs) masked (engine.masking).

Tables never cut an id. In a terminal a long cell folds onto more lines, and a table too wide
to fold readably is shown one row at a time (``column  value`` lines); with ``--wide``, or
when the output is not a terminal (a pipe, a file: a script reads it), every row is one line
however long."""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import click
import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from engine import masking
from engine.cli.common import console, decode_result, err_console
from engine.cli.pipes import PipeConsole
from engine.states import RUN_STATES, STATES

if TYPE_CHECKING:
    from engine.client.runs import RunOutcome
    from engine.store.models import TaskInstance

#: Shown instead of a secret.
MASK = masking.MASK
#: The longest result or error a table shows in a terminal without --wide (JSON has it all).
CELL_CHARS = 60

#: ``--state`` of the task listings: one of the task instance states (engine/states.py); any
#: other value is a usage error that lists them.
TASK_STATE = click.Choice(sorted(STATES))
#: ``--state`` of the run listings.
RUN_STATE = click.Choice(sorted(RUN_STATES))


def wide_option(fn: Any) -> Any:
    return click.option(
        "--wide",
        is_flag=True,
        help="One line per row however long (the default when the output is not a terminal).",
    )(fn)


#: Columns whose cells a narrow terminal folds last.
_ID_COLUMNS = frozenset({"id", "dag_id", "run_id", "last run", "task_id", "try"})
#: In a terminal, a column other than an id folds to no fewer characters than this; a table
#: that cannot fit its ids whole and its other columns so is shown one row at a time instead.
MIN_FOLDED_CHARS = 10


def _cell_text(value: object) -> str:
    return value.plain if isinstance(value, Text) else str(value)


def _longest_line(values: Sequence[object]) -> int:
    return max((len(line) for v in values for line in _cell_text(v).splitlines()), default=0)


def _fits(table: Table, width: int) -> bool:
    """Whether ``table`` fits ``width`` with its ids whole and every other column at least
    :data:`MIN_FOLDED_CHARS` wide (or as wide as its longest line, if less)."""
    need = 1
    for column in table.columns:
        longest = _longest_line([column.header, *column.cells])
        is_id = str(column.header) in _ID_COLUMNS
        need += 3 + (longest if is_id else min(longest, MIN_FOLDED_CHARS))
    return need <= width


def _print_records(table: Table, out: Console) -> None:
    """Each row as a block of ``column  value`` lines (psql's expanded display): nothing is
    cut or squeezed however narrow the terminal; a long value runs on to the next line."""
    headers = [str(column.header) for column in table.columns]
    pad = max(len(h) for h in headers)
    columns = [list(column.cells) for column in table.columns]
    for row in range(table.row_count):
        if row:
            out.print()
        for header, cells in zip(headers, columns, strict=True):
            lines = _cell_text(cells[row]).splitlines() or [""]
            for i, line in enumerate(lines):
                label = header if i == 0 else ""
                out.print(
                    f"{label:<{pad}}  {line}".rstrip(),
                    markup=False,
                    highlight=False,
                    soft_wrap=True,
                )


def print_table(
    table: Table, *, wide: bool, out: Console | None = None, empty: str | None = None
) -> None:
    """Print a table without cutting any cell: one line a row with ``wide`` or when the output
    is not a terminal; in a terminal, folded to its width, or, when even folded it would not
    fit (an 80-column terminal and long run ids), one block of lines per row. A table without
    rows is ``empty``, one sentence (``no waiting triggers``), when given."""
    out = console if out is None else out
    if empty is not None and not table.row_count:
        out.print(empty, markup=False, highlight=False, soft_wrap=True)
        return
    if wide or not out.is_terminal:
        for column in table.columns:
            column.no_wrap = True
            column.overflow = "ignore"
        if out is console:
            out = PipeConsole(width=1_000_000, highlight=False, soft_wrap=False)
        out.print(table, width=1_000_000, highlight=False, soft_wrap=False)
        return
    if table.row_count and not _fits(table, out.width):
        _print_records(table, out)
        return
    for column in table.columns:
        column.overflow = "fold"
        # Ids keep their line while other columns can wrap; only then are they folded.
        column.no_wrap = str(column.header) in _ID_COLUMNS
        if not column.no_wrap:
            column.min_width = min(_longest_line([column.header, *column.cells]), MIN_FOLDED_CHARS)
    out.print(table, highlight=False)


def cell(value: object) -> Text:
    """A table cell showing ``value`` as it is (no rich markup is interpreted in it)."""
    return Text("" if value is None else str(value))


def clip(text: str, *, wide: bool) -> str:
    if wide or not console.is_terminal or len(text) <= CELL_CHARS:
        return text
    return text[: CELL_CHARS - 1] + "…"


def fmt_time(value: dt.datetime | None) -> str:
    """A time in UTC to the second (``2026-12-01 11:05:07Z``: a narrow column wraps it at the
    space)."""
    if value is None:
        return ""
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def last_line(error: str | None) -> str:
    """The last non-blank line of an error (a traceback's ends with the exception)."""
    lines = [line for line in (error or "").strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _default(value: Any) -> Any:
    return str(value)


def compact_json(value: Any) -> str:
    """A value as compact JSON (what ``--json`` shows, on one line)."""
    return msgspec.json.encode(value, enc_hook=_default).decode()


def jsonable(value: Any) -> Any:
    """A decoded value as plain JSON data (whatever msgspec cannot encode becomes a string)."""
    return msgspec.json.decode(compact_json(value))


def is_secret_key(key: object) -> bool:
    return masking.is_sensitive_key(key)


def mask_secrets(value: Any) -> Any:
    """``value`` as the CLI shows it: secrets masked at any depth (registered secrets,
    sensitive key names such as ``password``, ``token``, ``Authorization``, secret shapes in
    text: engine.masking, the one function the status page and the logs use too)."""
    return masking.redact(value)


def masked_kwargs(raw: bytes | None) -> Any:
    """Stored trigger kwargs (decrypted, still encoded) as JSON data with secrets masked; None
    when no configured key opens them."""
    if raw is None:
        return None
    return mask_secrets(jsonable(decode_result(raw)))


# -- task instances ----------------------------------------------------------------------------


class ListedTask(msgspec.Struct, frozen=True, kw_only=True):
    """A task instance in ``tasks list --json`` and ``runs wait --json``.

    ``started_at``: the start of the first try, kept across deferrals, resumes, reschedules and
    retries; ``try_started_at``: of the current try; ``duration_s``: from ``started_at`` to
    ``ended_at`` (to now while not ended); ``error``: the current try's (None until it fails:
    the try before's is ``previous_error``); ``retry_at``: when an ``up_for_retry`` or
    ``up_for_reschedule`` task runs again."""

    dag_id: str
    run_id: str
    task_id: str
    state: str
    try_number: int
    result: Any
    error: str | None
    trigger_id: int | None
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    retry_at: dt.datetime | None
    try_started_at: dt.datetime | None
    duration_s: float | None
    previous_error: str | None
    #: What the templated fields rendered to at the start of the latest try; None: nothing.
    rendered: dict[str, Any] | None = None
    #: Why a waiting task is not running (engine/client/why.py); None for one that runs or has ended
    #: (and where it was not asked for).
    waiting_reason: str | None = None
    #: The XComs of the current try by key: ``{"bytes": n, "preview": "..."}`` (its return
    #: value under ``return_value``); None where it was not asked for.
    xcom: dict[str, Any] | None = None
    #: The instance of a mapped task (0..n-1; the table shows it as ``TASK[i]``); -1: not
    #: mapped.
    map_index: int = -1


def listed_task(
    row: TaskInstance, *, waiting_reason: str | None = None, xcom: dict[str, Any] | None = None
) -> ListedTask:
    return ListedTask(
        dag_id=row.dag_id,
        run_id=row.run_id,
        task_id=row.task_id,
        state=row.state,
        try_number=row.try_number,
        result=mask_secrets(jsonable(decode_result(row.result))),
        error=None if row.error is None else masking.redact_text(row.error),
        trigger_id=row.trigger_id,
        started_at=row.first_try_at,
        ended_at=row.ended_at,
        retry_at=row.retry_at,
        try_started_at=row.try_started_at,
        duration_s=row.duration_s,
        previous_error=(
            None if row.previous_error is None else masking.redact_text(row.previous_error)
        ),
        rendered=mask_secrets(row.rendered_fields),
        waiting_reason=waiting_reason,
        xcom=xcom,
        map_index=row.map_index,
    )


def filtered(what: str, **filters: object) -> str:
    """The sentence an empty listing prints: ``no runs of DAG x in state failed``."""
    words = {
        "dag_id": "of DAG {!r}",
        "run_id": "in run {!r}",
        "state": "in state {}",
        "task": "of task {!r}",
        "map_index": "with map index {}",
    }
    said = [words[name].format(value) for name, value in filters.items() if value is not None]
    return " ".join([f"no {what}", *said])


def state_cell(task: ListedTask) -> str:
    if task.retry_at is None:
        return task.state
    when = "retry at" if task.state == "up_for_retry" else "next check at"
    return f"{task.state} ({when} {fmt_time(task.retry_at)})"


def task_table(tasks: Sequence[ListedTask], *, with_run: bool, wide: bool) -> Table:
    """The task instances as a table: ids whole; state (with when a retry is due); try; first
    try's start; duration; result as compact JSON; the current try's error (its last line)."""
    heads = ["dag_id", "run_id"] if with_run else []
    table = Table(*heads, "task_id", "state", "try", "started_at", "duration", "result", "error")
    for task in tasks:
        ids = [cell(task.dag_id), cell(task.run_id)] if with_run else []
        result = "" if task.result is None else compact_json(task.result)
        table.add_row(
            *ids,
            cell(task.task_id if task.map_index < 0 else f"{task.task_id}[{task.map_index}]"),
            cell(state_cell(task)),
            cell(task.try_number),
            cell(fmt_time(task.started_at)),
            cell(fmt_duration(task.duration_s)),
            cell(clip(result, wide=wide)),
            cell(clip(last_line(task.error), wide=wide)),
        )
    return table


def show_outcome(dag_id: str, outcome: RunOutcome, *, wide: bool = False) -> None:
    """A run's state and its tasks table (``dags trigger --wait``, ``runs wait``)."""
    console.print(f"run [bold]{escape(dag_id)}/{escape(outcome.run_id)}[/]: {outcome.state}")
    if outcome.tasks:
        listed = [listed_task(task) for task in outcome.tasks]
        print_table(task_table(listed, with_run=False, wide=wide), wide=wide)


#: The exit code of a wait for a run, by the state it ended in (``running``: it timed out).
WAIT_EXIT = {"success": 0, "failed": 1, "running": 3}


@contextlib.contextmanager
def wait_ends_on_interrupt(dag_id: str, run_id: str) -> Iterator[None]:
    """Within the block (a wait for a run), Ctrl-C ends the process at once with
    :func:`interrupted_wait`'s message and code, whatever the wait was doing: a wait only
    reads, so nothing is left half-done, and the cancellation of a wait blocked in a
    connection's close (a busy or unreachable database) would otherwise hold the command
    until a second Ctrl-C."""

    def on_interrupt(_signum: int, _frame: Any) -> None:
        try:
            _say_interrupted(dag_id, run_id)
            sys.stderr.flush()
            # (what a normal exit runs: the embedded server stops if this process was its
            # last user)
            atexit._run_exitfuncs()
        finally:
            os._exit(130)

    if threading.current_thread() is not threading.main_thread():
        yield  # (a command run in a thread, as tests do: no SIGINT reaches it there)
        return
    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _say_interrupted(dag_id: str, run_id: str) -> None:
    err_console.print(
        f"interrupted (only the wait stopped): the run goes on; follow it with: "
        f"deferral runs wait {shlex.quote(dag_id)} {shlex.quote(run_id)}",
        highlight=False,
        soft_wrap=True,
        markup=False,
    )


def interrupted_wait(dag_id: str, run_id: str) -> NoReturn:
    """Ctrl-C while waiting for a run: the run is not stopped; say how to follow it, exit 130
    (the shell's code for SIGINT)."""
    _say_interrupted(dag_id, run_id)
    sys.exit(130)
