"""The sensor that waits until a query's first cell is truthy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from operators.base import Context
from operators.sensors.base import BaseSensorOperator
from triggers.base import BaseTrigger
from triggers.sql import SqlTrigger

__all__ = ["SqlSensor"]


class SqlSensor(BaseSensorOperator):
    """Waits until the first cell of the first row of ``sql`` is truthy, on the database
    ``conn`` (a URL or a connection id); the result is that cell. ``sql`` and ``parameters``
    are templated; an ``sql`` ending in ``.sql`` names a file in the DAG's folder (or
    ``template_searchpath``), read and rendered."""

    template_fields = ("sql", "parameters")
    template_ext = (".sql",)

    def __init__(
        self, *, conn: str, sql: str, parameters: Sequence[Any] = (), **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.conn = conn
        self.sql = sql
        self.parameters = list(parameters)

    def trigger(self, context: Context) -> BaseTrigger:
        return SqlTrigger(self.conn, self.sql, parameters=self.parameters, **self.trigger_kwargs())
