"""Layered (Sugiyama) layout of a piece graph by Graphviz's ``dot``, returned as plain positions.

Why ``dot``: it is the layered-DAG engine FX's own graph drawer (``torch.fx.passes.graph_drawer``) uses, a
separately maintained program with decades of work on crossing reduction and edge routing, deterministic, and
fast enough (~10-50 ms for a collapsed decoder layer). We ask it only for coordinates (``-Tjson0``) and draw
with plotly ourselves, so positions are data that Python tests can check and the figure exports to static
HTML like every other sp_lab plot. The JavaScript alternatives (ELK, dagre inside an anywidget) would lay out
in the browser, out of reach of tests and of ``save_html``; dagre is no longer maintained.

The Python ``graphviz`` package only writes the DOT text and runs the ``dot`` executable; both are needed
(``pip install graphviz`` and the system package: ``apt-get install graphviz``, ``brew install graphviz`` or
``conda install graphviz``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["DagLayout", "GraphvizMissing", "PlacedNode", "dot_layout"]

_POINTS_PER_CHAR = 5.6  # Graphviz points per character at the 10 pt font the figure uses
_NODE_HEIGHT_IN = 0.32
_CURVE_SAMPLES = 6  # points per cubic Bézier segment when flattening dot's splines


class GraphvizMissing(RuntimeError):
    """Graphviz (the ``dot`` program or the ``graphviz`` Python package) is not installed."""


@dataclass(frozen=True)
class PlacedNode:
    """A node's box, in points, y growing upwards (Graphviz's convention)."""

    id: str
    x: float
    """Centre x."""
    y: float
    """Centre y."""
    width: float
    height: float


@dataclass(frozen=True)
class DagLayout:
    """Positions of a laid-out graph."""

    nodes: tuple[PlacedNode, ...]
    edges: tuple[tuple[str, str, tuple[tuple[float, float], ...]], ...]
    """(tail id, head id, polyline from tail to head)."""
    width: float
    """Bounding box width in points."""
    height: float
    """Bounding box height in points."""

    def position(self, node_id: str) -> PlacedNode:
        return next(n for n in self.nodes if n.id == node_id)


def dot_layout(nodes: tuple[tuple[str, str], ...], edges: tuple[tuple[str, str], ...], *,
               rankdir: str = "TB") -> DagLayout:
    """Lay out ``nodes`` (``(id, label)``; the label only sizes the box) and ``edges`` (``(tail, head)``).

    Cached: the widget redraws the same piece for every search or mode switch.
    """
    return _cached_layout(tuple(nodes), tuple(edges), rankdir)


@lru_cache(maxsize=256)
def _cached_layout(nodes: tuple[tuple[str, str], ...], edges: tuple[tuple[str, str], ...], rankdir: str) -> DagLayout:
    try:
        import graphviz
    except ImportError as err:
        raise GraphvizMissing("the piece drill-down lays graphs out with Graphviz: pip install graphviz "
                              "(and the dot program: apt-get install graphviz, brew install graphviz or "
                              "conda install graphviz)") from err
    if not nodes:
        return DagLayout(nodes=(), edges=(), width=0.0, height=0.0)
    graph = graphviz.Digraph(graph_attr={"rankdir": rankdir, "nodesep": "0.25", "ranksep": "0.35",
                                         "splines": "spline"},
                             node_attr={"shape": "box", "fixedsize": "true", "fontsize": "10",
                                        "height": str(_NODE_HEIGHT_IN)})
    # Ids go in as "n<i>": FX names are safe, but a label-free numbering keeps DOT quoting out of the way.
    key = {node_id: f"n{i}" for i, (node_id, _) in enumerate(nodes)}
    for node_id, label in nodes:
        width_in = max(0.7, (len(label) * _POINTS_PER_CHAR + 16) / 72)
        graph.node(key[node_id], label="", width=f"{width_in:.2f}")
    for tail, head in edges:
        graph.edge(key[tail], key[head])
    try:
        raw = graph.pipe(format="json0")
    except graphviz.ExecutableNotFound as err:
        raise GraphvizMissing("Graphviz's dot program is not on PATH; the piece drill-down needs it for its "
                              "layout: apt-get install graphviz (Debian/Ubuntu), brew install graphviz (macOS) "
                              "or conda install graphviz") from err
    out = json.loads(raw)
    x0, y0, x1, y1 = (float(v) for v in out["bb"].split(","))
    by_key = {k: node_id for node_id, k in key.items()}
    objects = out.get("objects", [])
    placed = []
    for obj in objects:
        x, y = (float(v) for v in obj["pos"].split(","))
        placed.append(PlacedNode(id=by_key[obj["name"]], x=x, y=y, width=float(obj["width"]) * 72,
                                 height=float(obj["height"]) * 72))
    name_of = {obj["_gvid"]: by_key[obj["name"]] for obj in objects}
    routed = tuple((name_of[e["tail"]], name_of[e["head"]], _polyline(e.get("pos", "")))
                   for e in out.get("edges", []))
    return DagLayout(nodes=tuple(placed), edges=routed, width=x1 - x0, height=y1 - y0)


def _polyline(pos: str) -> tuple[tuple[float, float], ...]:
    """Flatten dot's edge spline (``"e,x,y p0 p1 p2 p3 ..."``: end point, then cubic Bézier control points)."""
    end = None
    points = []
    for token in pos.split():
        if token.startswith(("e,", "s,")):
            _, x, y = token.split(",")
            if token.startswith("e,"):
                end = (float(x), float(y))
            continue
        x, y = token.split(",")
        points.append((float(x), float(y)))
    line = points[:1]
    for i in range(0, len(points) - 3, 3):
        p0, p1, p2, p3 = points[i:i + 4]
        for k in range(1, _CURVE_SAMPLES + 1):
            t = k / _CURVE_SAMPLES
            u = 1 - t
            line.append((u ** 3 * p0[0] + 3 * u * u * t * p1[0] + 3 * u * t * t * p2[0] + t ** 3 * p3[0],
                         u ** 3 * p0[1] + 3 * u * u * t * p1[1] + 3 * u * t * t * p2[1] + t ** 3 * p3[1]))
    if end is not None:
        line.append(end)
    return tuple(line)
