"""Run selectors: what every command that takes a RUN accepts (``tasks list --run``, ``tasks
why``, ``tasks logs``, ``runs wait``), resolved in one place.

A selector is, in this order of trial:

* a run id, in full (``manual__2026-12-02T07:40:17.123456+00:00``);
* ``latest``: the newest run (the first line of ``deferral runs list``);
* a logical date, to the precision written: ``2026-11-20`` is that day, ``2026-11-20T06``
  that hour, ``2026-11-20T06:30`` that minute, down to the microsecond (naive: in the DAG's
  time zone, UTC without a DAG; ``Z`` or ``+01:00`` say otherwise). Of several runs in the
  span, the one exactly at its start is taken (the daily run of 2026-11-20 beside a manual run
  that afternoon); otherwise it names them;
* a prefix of a run id that only one run has (``manual__2026-12-02T07``).

A selector that names no run is an error that suggests the closest run ids (difflib, against
the ids, their dates and their beginnings); one that names several lists them.
"""

from __future__ import annotations

import datetime as dt
import difflib
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.dags.timetables import stored_timezone, to_aware

if TYPE_CHECKING:
    from engine.store import Store
    from engine.store.runselect import SelectedRun

UTC = dt.UTC

__all__ = [
    "LATEST",
    "SELECTOR_HELP",
    "AmbiguousRun",
    "NoSuchRun",
    "date_span",
    "resolve_run",
    "resolve_runs",
]

#: The selector of the newest run.
LATEST = "latest"
#: What a RUN argument accepts, for the commands' help.
SELECTOR_HELP = (
    "a run id, a unique prefix of one, a logical date (2026-11-20, 2026-11-20T06:00) or latest"
)
#: The most runs an ambiguous selector names.
LISTED = 10
#: How many of the newest runs a selector that named none is compared with.
SUGGEST_FROM = 5000
#: The most ids suggested, and how close (difflib's ratio) one must be.
SUGGESTED = 3
CLOSE_RATIO = 0.6

_DATE = re.compile(
    r"^(?P<date>\d{4}-\d{2}-\d{2})"
    r"(?:[T ](?P<hour>\d{2})(?::?(?P<minute>\d{2})(?::?(?P<second>\d{2})"
    r"(?:[.,](?P<fraction>\d{1,6}))?)?)?)?"
    r"(?P<zone>Z|[+-]\d{2}(?::?\d{2})?)?$"
)


class NoSuchRun(LookupError):
    """A selector that names no run (the message suggests the closest ids)."""


class AmbiguousRun(LookupError):
    """A selector that names several runs (the message lists them)."""


def date_span(text: str, tz: dt.tzinfo = UTC) -> tuple[dt.datetime, dt.datetime] | None:
    """The span of logical dates ``text`` names, ``[start, end)`` in UTC, to the precision it
    is written in (a day, an hour, ... a microsecond); naive: in ``tz``. None: not a date."""
    match = _DATE.match(text.strip())
    if match is None:
        return None
    try:
        when = dt.datetime.fromisoformat(text.strip().replace(",", "."))
    except ValueError:
        return None
    parts = match.groupdict()
    if parts["fraction"]:
        step = dt.timedelta(microseconds=10 ** (6 - len(parts["fraction"])))
    elif parts["second"]:
        step = dt.timedelta(seconds=1)
    elif parts["minute"]:
        step = dt.timedelta(minutes=1)
    elif parts["hour"]:
        step = dt.timedelta(hours=1)
    else:
        step = dt.timedelta(days=1)
    if when.tzinfo is not None:
        start = when.astimezone(UTC)
        return start, start + step
    # A naive span is of wall-clock time: a day in a zone that changes its clock that day is
    # 23 or 25 hours long.
    return to_aware(when, tz), to_aware(when + step, tz)


def _named(run: SelectedRun, *, with_dag: bool) -> str:
    return f"{run.run_id} (DAG {run.dag_id})" if with_dag else run.run_id


def _whose(dag_id: str | None) -> str:
    return f" of DAG {dag_id!r}" if dag_id is not None else ""


def _listing(runs: Sequence[SelectedRun], *, with_dag: bool) -> str:
    shown = ", ".join(_named(r, with_dag=with_dag) for r in runs[:LISTED])
    return shown + (" (and more)" if len(runs) > LISTED else "")


def _closeness(selector: str, run: SelectedRun) -> float:
    """How close ``selector`` is to what one may type for ``run``: its id, the id's date part
    (after ``__``), its logical date (in full and the day) and the id's first characters."""
    text = selector.strip()
    when = run.logical_date.astimezone(UTC)
    forms = {
        run.run_id,
        run.run_id.split("__", 1)[-1],
        run.run_id[: len(text)],
        when.isoformat(),
        when.date().isoformat(),
    }
    return max(difflib.SequenceMatcher(None, text, form).ratio() for form in forms)


def closest(selector: str, runs: Sequence[SelectedRun]) -> list[SelectedRun]:
    """The runs whose id is closest to ``selector`` (at most :data:`SUGGESTED`)."""
    scored = sorted(
        ((_closeness(selector, r), i) for i, r in enumerate(runs)), key=lambda s: (-s[0], s[1])
    )
    return [runs[i] for score, i in scored[:SUGGESTED] if score >= CLOSE_RATIO]


async def _timezone(store: Store, dag_id: str | None) -> dt.tzinfo:
    if dag_id is None:
        return UTC
    dag = await store.get_dag(dag_id)
    return stored_timezone(dag.timetable if dag is not None else None)


async def resolve_runs(store: Store, dag_id: str | None, selector: str) -> list[SelectedRun]:
    """The run(s) ``selector`` names, of DAG ``dag_id`` (None: of any DAG). Only a full run id
    may name several runs (one a DAG, when no DAG is given); otherwise raises
    :class:`AmbiguousRun`, or :class:`NoSuchRun` when it names none."""
    with_dag = dag_id is None
    exact = await store.runs_named(dag_id, selector)
    if exact:
        return exact
    text = selector.strip()
    if text.lower() == LATEST:
        latest = await store.latest_run(dag_id)
        if latest is None:
            raise NoSuchRun(f"no runs{_whose(dag_id)} yet: {LATEST} names none")
        return [latest]
    span = date_span(text, await _timezone(store, dag_id))
    if span is not None:
        dated = await store.runs_dated(dag_id, span[0], span[1], LISTED + 1)
        at_start = [r for r in dated if r.logical_date == span[0]]
        if len(dated) == 1 or len(at_start) == 1:
            return [dated[0] if len(dated) == 1 else at_start[0]]
        if dated:
            raise AmbiguousRun(
                f"{text!r} is the logical date of several runs{_whose(dag_id)}: "
                f"{_listing(dated, with_dag=with_dag)}; give the time too, or the run id"
                + ("" if dag_id else ", or the DAG")
            )
    prefixed = await store.runs_prefixed(dag_id, selector, LISTED + 1)
    if len(prefixed) == 1:
        return prefixed
    if prefixed:
        raise AmbiguousRun(
            f"{selector!r} begins the ids of several runs{_whose(dag_id)}: "
            f"{_listing(prefixed, with_dag=with_dag)}; give more of the id"
        )
    recent = await store.recent_runs(dag_id, SUGGEST_FROM)
    near = closest(selector, recent)
    message = f"no run {selector!r}{_whose(dag_id)} (RUN is {SELECTOR_HELP})"
    if near:
        message += f"; did you mean {', '.join(_named(r, with_dag=with_dag) for r in near)}?"
    elif not recent:
        message += f"; there are no runs{_whose(dag_id)} yet"
    else:
        where = f" --dag {dag_id}" if dag_id is not None else ""
        message += f"; deferral runs list{where} shows the runs"
    raise NoSuchRun(message)


async def resolve_run(
    store: Store, dag_id: str | None, selector: str, *, with_dag: str = ""
) -> SelectedRun:
    """The one run ``selector`` names (see :func:`resolve_runs`); a run id that several DAGs
    have is :class:`AmbiguousRun` when no DAG is given (``with_dag``: the command again, with
    the DAG, for the message)."""
    runs = await resolve_runs(store, dag_id, selector)
    if len(runs) > 1:
        dags = ", ".join(r.dag_id for r in runs)
        raise AmbiguousRun(
            f"run id {selector!r} names a run of {len(runs)} DAGs ({dags}): name the DAG too"
            + (f": {with_dag}" if with_dag else "")
        )
    return runs[0]
