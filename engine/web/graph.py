"""A DAG's graph for the status page: drawn (an SVG of boxes in columns by depth, an arrow
from each task to each of its downstream tasks) up to :data:`MAX_DRAWN_TASKS` tasks,
summarized above (counts, depth, width, roots and leaves): a drawing of thousands of boxes is
megabytes no one can read.

The depth of every task is found in one pass in topological order (Kahn's algorithm), without
recursion: a chain of any length is fine.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_DRAWN_TASKS",
    "MAX_LISTED",
    "NODE_H",
    "NODE_W",
    "Edge",
    "Graph",
    "GraphSummary",
    "Node",
    "depths",
    "draw",
    "graph",
    "ordered",
]

#: Above this many tasks the graph is summarized, not drawn.
MAX_DRAWN_TASKS = 200
#: Roots and leaves a summary names (the others are counted).
MAX_LISTED = 10

#: A task's box, and the room between columns (where the arrows run) and between boxes.
NODE_W, NODE_H = 160, 36
_GAP_X, _GAP_Y = 48, 12

#: What a box says under the task id, for the states that wait: on what.
WAITING_ON = {
    "deferred": "deferred: on a trigger",
    "up_for_reschedule": "up_for_reschedule: a poke",
    "up_for_retry": "up_for_retry: its delay",
    "scheduled": "scheduled: a worker",
    "queued": "queued: a worker",
}


@dataclass(frozen=True)
class Node:
    task_id: str
    state: str
    x: int
    y: int
    href: str

    @property
    def label(self) -> str:
        """The line under the task id: its state, and what it waits on if it waits."""
        return "" if self.state == "none" else WAITING_ON.get(self.state, self.state)


@dataclass(frozen=True)
class Edge:
    """An arrow from an upstream task to its downstream task: the SVG path of a curve from
    the right side of one box to the left side of the other."""

    upstream: str
    downstream: str
    path: str


@dataclass(frozen=True)
class Graph:
    nodes: list[Node]
    edges: list[Edge]
    width: int
    height: int
    kind: str = "drawn"


@dataclass(frozen=True)
class GraphSummary:
    """What a graph too large to draw is made of."""

    tasks: int
    edges: int
    #: Tasks on the longest path (a chain of n tasks: n).
    levels: int
    #: The most tasks at one depth (side by side in a drawing).
    widest: int
    #: Tasks with no upstream, and with no downstream: (task id, link) up to MAX_LISTED each.
    roots: list[tuple[str, str]]
    leaves: list[tuple[str, str]]
    root_count: int
    leaf_count: int
    #: Tasks by state (a run's), most first; empty for a DAG.
    states: list[tuple[str, int]]
    max_drawn: int = MAX_DRAWN_TASKS
    kind: str = "summary"


def _upstream(tasks: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
    """Each task's upstream tasks, those of this DAG only, each once."""
    ids = {str(t["task_id"]) for t in tasks}
    return {
        str(t["task_id"]): list(
            dict.fromkeys(u for u in map(str, t.get("upstream", [])) if u in ids)
        )
        for t in tasks
    }


def depths(upstream: dict[str, list[str]]) -> dict[str, int]:
    """Each task's depth: the length of the longest path to it from a task with no upstream
    (roots: 0). Tasks in a cycle, which a recorded DAG never has, go one below the others."""
    downstream: dict[str, list[str]] = {t: [] for t in upstream}
    waiting = {t: len(ups) for t, ups in upstream.items()}
    for task_id, ups in upstream.items():
        for u in ups:
            downstream[u].append(task_id)
    depth = dict.fromkeys((t for t, n in waiting.items() if n == 0), 0)
    ready = deque(depth)
    while ready:
        task_id = ready.popleft()
        for down in downstream[task_id]:
            depth[down] = max(depth.get(down, 0), depth[task_id] + 1)
            waiting[down] -= 1
            if waiting[down] == 0:
                ready.append(down)
    below = max(depth.values(), default=-1) + 1
    return {t: depth.get(t, below) for t in upstream}


def draw(
    upstream: dict[str, list[str]],
    depth: dict[str, int],
    states: dict[str, str],
    href: Callable[[str], str] | None,
) -> Graph:
    """The tasks as boxes in columns by depth, an arrow from each upstream box to its task."""
    columns: dict[int, list[str]] = {}
    for task_id in upstream:
        columns.setdefault(depth[task_id], []).append(task_id)
    place: dict[str, tuple[int, int]] = {}
    nodes = []
    for col, ids in sorted(columns.items()):
        for row, task_id in enumerate(ids):
            x, y = col * (NODE_W + _GAP_X) + 4, row * (NODE_H + _GAP_Y) + 4
            place[task_id] = (x, y)
            nodes.append(
                Node(task_id, states.get(task_id, "none"), x, y, href(task_id) if href else "")
            )
    edges = []
    for task_id, ups in upstream.items():
        x2, y2 = place[task_id][0] - 2, place[task_id][1] + NODE_H // 2
        for u in ups:
            x1, y1 = place[u][0] + NODE_W, place[u][1] + NODE_H // 2
            bend = max(12, (x2 - x1) // 2)
            path = f"M{x1},{y1} C{x1 + bend},{y1} {x2 - bend},{y2} {x2},{y2}"
            edges.append(Edge(u, task_id, path))
    width = (max(columns, default=0) + 1) * (NODE_W + _GAP_X) + 8
    height = max((len(ids) for ids in columns.values()), default=1) * (NODE_H + _GAP_Y) + 8
    return Graph(nodes, edges, width, height)


def _summary(
    upstream: dict[str, list[str]],
    depth: dict[str, int],
    states: dict[str, int],
    href: Callable[[str], str] | None,
) -> GraphSummary:
    has_downstream = {u for ups in upstream.values() for u in ups}
    roots = [t for t, ups in upstream.items() if not ups]
    leaves = [t for t in upstream if t not in has_downstream]

    def listed(ids: list[str]) -> list[tuple[str, str]]:
        return [(t, href(t) if href else "") for t in ids[:MAX_LISTED]]

    return GraphSummary(
        tasks=len(upstream),
        edges=sum(len(ups) for ups in upstream.values()),
        levels=max(depth.values(), default=-1) + 1,
        widest=max(Counter(depth.values()).values(), default=0),
        roots=listed(roots),
        leaves=listed(leaves),
        root_count=len(roots),
        leaf_count=len(leaves),
        states=sorted(states.items(), key=lambda kv: (-kv[1], kv[0])),
    )


def ordered(tasks: Sequence[dict[str, Any]]) -> list[str]:
    """The task ids by depth (roots first), in their given order within a depth: the order
    of the grid's rows."""
    depth = depths(_upstream(tasks))
    return sorted(depth, key=depth.__getitem__)


def graph(
    tasks: Sequence[dict[str, Any]],
    states: dict[str, str] | None = None,
    href: Callable[[str], str] | None = None,
    *,
    counts: dict[str, int] | None = None,
) -> Graph | GraphSummary:
    """The graph of ``tasks`` (each a dict with ``task_id`` and ``upstream``), colored by
    ``states`` (task id → state), each box linking to ``href(task_id)``: drawn up to
    :data:`MAX_DRAWN_TASKS` tasks, else summarized (``counts``: tasks by state)."""
    upstream = _upstream(tasks)
    depth = depths(upstream)
    if len(upstream) > MAX_DRAWN_TASKS:
        return _summary(upstream, depth, counts or {}, href)
    return draw(upstream, depth, states or {}, href)
