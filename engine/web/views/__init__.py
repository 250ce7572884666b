"""What each page shows: one module per page, each a function that reads the store and returns
the page's template context (:mod:`engine.web.app` routes the requests to them).

* ``common`` — tables as lists of columns, the cells (text, links, state squares), the
  pages' addresses and the states' legend;
* ``fleet``, ``dags`` (the DAGs list), ``dag`` (a DAG: its grid and graph), ``runs`` (every
  run), ``run`` (a run and its Gantt view), ``task`` (a task instance and its tries),
  ``triggers``, ``pools`` (the pools and a pool's tasks);
* ``grid``, ``gantt`` and ``tries`` lay out what those pages draw.
"""

from engine.web.views.common import (
    LEGEND,
    Column,
    Link,
    NotFound,
    Square,
    Squares,
    Table,
    dag_url,
    run_url,
    task_url,
    url,
)
from engine.web.views.dag import dag_page
from engine.web.views.dags import DagQuery, dags_page
from engine.web.views.fleet import fleet_page
from engine.web.views.pools import POOL_GROUPS, pool_page, pools_page
from engine.web.views.run import gantt_page, run_page
from engine.web.views.runs import RUN_TYPES, RunQuery, runs_page
from engine.web.views.task import task_page
from engine.web.views.triggers import TriggerFilter, triggers_page

__all__ = [
    "LEGEND",
    "POOL_GROUPS",
    "RUN_TYPES",
    "Column",
    "DagQuery",
    "Link",
    "NotFound",
    "RunQuery",
    "Square",
    "Squares",
    "Table",
    "TriggerFilter",
    "dag_page",
    "dag_url",
    "dags_page",
    "fleet_page",
    "gantt_page",
    "pool_page",
    "pools_page",
    "run_page",
    "run_url",
    "runs_page",
    "task_page",
    "task_url",
    "triggers_page",
    "url",
]
