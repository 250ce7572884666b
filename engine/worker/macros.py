"""``macros`` and the date filters of templates, as Airflow's (docs/reference/templates.md).

``{{ macros.ds_add(ds, 7) }}``, ``{{ macros.datetime_diff_for_humans(logical_date) }}``,
``{{ data_interval_end | ds_nodash }}``. The modules Airflow's ``macros`` carries are there
too: ``macros.json``, ``macros.time``, ``macros.uuid``, ``macros.random`` (the function),
``macros.dateutil``, ``macros.datetime``, ``macros.timedelta``.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import time
import types
import uuid
from typing import Any

import dateutil
import dateutil.parser
import dateutil.relativedelta
import dateutil.tz
import pendulum

__all__ = [
    "FILTERS",
    "MACROS",
    "datetime_diff_for_humans",
    "ds_add",
    "ds_filter",
    "ds_format",
    "ds_format_locale",
    "ds_nodash_filter",
    "ts_filter",
    "ts_nodash_filter",
    "ts_nodash_with_tz_filter",
]


def ds_add(ds: str, days: int) -> str:
    """``ds`` (``YYYY-MM-DD``; ``2015-1-5`` too) plus ``days`` (negative: minus):
    ``ds_add('2026-01-31', 1)`` is ``'2026-02-01'``."""
    if not days:
        return str(ds)
    moved = dt.datetime.strptime(str(ds), "%Y-%m-%d") + dt.timedelta(days=days)
    return moved.strftime("%Y-%m-%d")


def ds_format(ds: str, input_format: str, output_format: str) -> str:
    """``ds`` read with ``input_format`` and written with ``output_format`` (strftime codes):
    ``ds_format('2026-01-31', '%Y-%m-%d', '%d/%m/%Y')`` is ``'31/01/2026'``."""
    return dt.datetime.strptime(str(ds), input_format).strftime(output_format)


def ds_format_locale(
    ds: str, input_format: str, output_format: str, locale: str | None = None
) -> str:
    """``ds`` read with ``input_format`` (strftime) and written with ``output_format``, a
    Babel (CLDR) pattern, in ``locale`` (default: ``LC_TIME``, else ``en_US``):
    ``ds_format_locale('2024-07-12', '%Y-%m-%d', 'EEEE d MMMM', 'nl_NL')`` is
    ``'vrijdag 12 juli'``. Needs Babel (``pip install 'deferral[locale]'``)."""
    try:
        from babel import Locale
        from babel.dates import LC_TIME, format_datetime
    except ImportError:
        raise RuntimeError(
            "macros.ds_format_locale needs Babel: pip install 'deferral[locale]' (or babel)"
        ) from None
    when = dt.datetime.strptime(str(ds), input_format)
    chosen = locale or LC_TIME or Locale("en", "US")
    return str(format_datetime(when, format=output_format, locale=chosen))


def datetime_diff_for_humans(when: Any, since: Any = None) -> str:
    """How far ``when`` is from ``since`` (now when None), in words: ``'2 days ago'``,
    ``'in 3 hours'``, ``'1 hour after'`` (pendulum's ``diff_for_humans``)."""
    other = None if since is None else pendulum.instance(since)
    return str(pendulum.instance(when).diff_for_humans(other))


def ds_filter(value: dt.date | None) -> str | None:
    """``{{ data_interval_end | ds }}``: ``YYYY-MM-DD``."""
    return None if value is None else value.strftime("%Y-%m-%d")


def ds_nodash_filter(value: dt.date | None) -> str | None:
    return None if value is None else value.strftime("%Y%m%d")


def ts_filter(value: dt.date | None) -> str | None:
    return None if value is None else value.isoformat()


def ts_nodash_filter(value: dt.date | None) -> str | None:
    return None if value is None else value.strftime("%Y%m%dT%H%M%S")


def ts_nodash_with_tz_filter(value: dt.date | None) -> str | None:
    return None if value is None else value.isoformat().replace("-", "").replace(":", "")


#: The filters every template has.
FILTERS = {
    "ds": ds_filter,
    "ds_nodash": ds_nodash_filter,
    "ts": ts_filter,
    "ts_nodash": ts_nodash_filter,
    "ts_nodash_with_tz": ts_nodash_with_tz_filter,
}

#: ``macros`` in templates and the context.
MACROS = types.SimpleNamespace(
    ds_add=ds_add,
    ds_format=ds_format,
    ds_format_locale=ds_format_locale,
    datetime_diff_for_humans=datetime_diff_for_humans,
    datetime=dt.datetime,
    timedelta=dt.timedelta,
    json=json,
    time=time,
    uuid=uuid,
    random=random.random,
    dateutil=dateutil,
)
