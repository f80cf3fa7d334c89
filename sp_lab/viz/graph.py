"""The split-graph explorer: which tensors cross piecewise boundaries, and what the passes changed.

Everything here reads a saved CompileReport (``sp_lab.compile_report/1``, defined in sp_lab/compiler/report.py),
as a dict, a JSON path or an object with ``to_dict()``; nothing reaches into the compiler, so a
report saved on a GPU box can be explored on a laptop with no live process.

Layered as Optuna's ``visualization`` module: each view has

1. a data function returning plain dataclasses / polars DataFrames (``overview_data``,
   ``piece_diff_data``, ``compare_data``, ``piece_table``, ``range_table``) - tests assert on these;
2. a figure builder taking only that data (``build_overview_figure``, ...);
3. a thin public ``plot_*`` (``plot_overview``, ``plot_piece``, ``plot_compare``).

``save_html`` writes standalone HTML and ``emit_trace`` sends the report (and the overview data)
through ``torch._logging.trace_structured`` so tlparse users see the same artifacts.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from sp_lab.compiler.report import CompileReport

SCHEMA_PREFIX = "sp_lab.compile_report/"
COLLECTIVE_KEYS = ("all_reduce", "reduce_scatter", "all_gather", "fused_all_gather_matmul",
                   "fused_matmul_reduce_scatter")
FUSED_KEYS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")
MATCH_KEYS = ("sp_first", "sp_middle", "sp_last", "async_tp_ag_mm", "async_tp_mm_rs",
              "boundary_gather", "boundary_erase")

# One colour per node kind in drill-down graphs; kinds outside the contract's list draw as "other".
KIND_COLORS = {
    "collective": "#d62728", "fused": "#9467bd", "matmul": "#1f77b4", "norm": "#2ca02c",
    "split": "#8c564b", "input": "#bcbd22", "output": "#17becf", "other": "#7f7f7f",
}
SHARDED_COLOR = "#6a3d9a"
FULL_COLOR = "#4d4d4d"
FAILURE_COLOR = "#d62728"
UNSAFE_COLOR = "#e6780b"
_BOX_FILL = {"compiled": "#dbe9f6", "splitting_op": "#f3e3c9", "group": "#e4ecd9"}
_BOX_LINE = {"compiled": "#3b6ea5", "splitting_op": "#b07b2a", "group": "#5b8a3c"}


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def load_report(path: str | Path) -> dict:
    """Read a CompileReport saved as JSON (``report.to_json(path)``) through its strict loader."""
    return as_report_dict(CompileReport.load(path))


def as_report_dict(report: CompileReport | Mapping[str, Any] | str | Path) -> dict:
    """Normalise a report given as a dict, a JSON path, or a :class:`CompileReport`."""
    if isinstance(report, (str, Path)):
        return load_report(report)
    if hasattr(report, "to_dict"):
        report = report.to_dict()
    if not isinstance(report, Mapping):
        raise TypeError(f"expected a CompileReport, its dict or a path to its JSON; got {type(report).__name__}")
    schema = report.get("schema", "")
    if not str(schema).startswith(SCHEMA_PREFIX):
        raise ValueError(f"report schema {schema!r} is not {SCHEMA_PREFIX}*; this explorer reads reports "
                         f"written by sp_lab.compiler.report.CompileReport.to_dict()")
    if not report.get("ranges"):
        raise ValueError("report has no compile ranges ('ranges' is empty): nothing was compiled")
    return dict(report)


def _resolve_range(report: dict, range_index: int | None) -> int:
    """``None`` picks the first range that has pieces (ranges compile lazily, on their first token
    count) with SP on, where boundaries matter; else the first with pieces; else range 0."""
    ranges = report["ranges"]
    if range_index is None:
        built = [i for i, r in enumerate(ranges) if r.get("pieces")]
        return next((i for i in built if ranges[i].get("enable_sp")), built[0] if built else 0)
    if not -len(ranges) <= range_index < len(ranges):
        available = ", ".join(f"{i}: tokens {r['lo']}-{r['hi']}" for i, r in enumerate(ranges))
        raise IndexError(f"range_index={range_index} is out of bounds; this report has {available}")
    return range_index % len(ranges)


def format_shape(shape: Sequence[int | str] | None) -> str:
    """``["s0", 4096]`` -> ``"[s0, 4096]"`` (symbolic dims kept as written by the compiler)."""
    if shape is None:
        return "[?]"
    return "[" + ", ".join(str(d) for d in shape) + "]"


# --------------------------------------------------------------------------------------------
# 1. Overview: data
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RangeSummary:
    """One compile range of the report (one compiled artifact)."""

    index: int
    """Position in ``report["ranges"]``."""
    lo: int
    """Smallest token count served by this artifact (inclusive)."""
    hi: int
    """Largest token count served (inclusive)."""
    enable_sp: bool
    """Whether the SP pass ran on this range."""
    enable_async_tp: bool
    """Whether the AsyncTP pass ran on this range."""
    boundary: str
    """Boundary strategy: "none", "gather_erase", "gather" or "sharded"."""
    compile_mode: str
    """"piecewise" or "full_graph"."""
    compiled: bool
    """False when compilation itself failed (e.g. the ``copy_`` epilogue of strategy "none")."""
    compile_time_s: float | None
    """Wall time to compile the whole range."""
    numerically_unsafe: bool
    """True when a pass dropped a write the program needs (erased ``copy_`` of an in-place residual)."""

    @property
    def title(self) -> str:
        on = {True: "on", False: "off"}
        t = f" · compile {self.compile_time_s:.1f} s" if self.compile_time_s is not None else ""
        return (f"tokens {self.lo}-{self.hi} · boundary={self.boundary} · SP {on[self.enable_sp]} · "
                f"AsyncTP {on[self.enable_async_tp]}{t}")


@dataclass(frozen=True)
class TensorCrossing:
    """A tensor that leaves one piece and enters the next."""

    name: str
    """Tensor name at the boundary (e.g. "residual")."""
    dtype: str
    """Element type, e.g. "bfloat16"."""
    shape_before: tuple
    """Shape before the passes ran; ints or symbolic strings ("s0")."""
    shape_after: tuple
    """Shape the next piece really receives."""
    sharded_before: bool
    """Whether the token dim was sharded over TP ranks before the passes."""
    sharded_after: bool
    """Whether the token dim is sharded over TP ranks after the passes (the SP win, or its bug)."""
    bytes_per_token_after: float | None
    """Bytes this rank hands over per token after the passes."""

    @property
    def text(self) -> str:
        """One label line; the shape before the passes is left to the hover text to keep labels short."""
        return f"{self.name} {format_shape(self.shape_after)}{' sharded' if self.sharded_after else ''}"


@dataclass(frozen=True)
class FailureMark:
    """A check that failed where a piece received a tensor of the wrong shape."""

    piece: int
    """Index of the piece whose check failed (the receiving piece)."""
    tensor: str
    """Name of the offending input inside that piece."""
    check: str
    """"assert_size_stride" (Inductor input guard) or "copy_epilogue" (functionalization's copy_)."""
    expected_shape: tuple
    """Shape the piece was compiled for."""
    actual_shape: tuple
    """Shape it received."""
    message: str
    """The error text as raised."""
    boundary: int | None
    """Index of the boundary the tensor crossed, or None when no boundary feeds the piece."""

    @property
    def text(self) -> str:
        """Three label lines: the check, then both shapes."""
        return (f"✗ {self.check} failed (piece {self.piece})<br>expected {format_shape(self.expected_shape)}"
                f"<br>got {format_shape(self.actual_shape)}")


@dataclass(frozen=True)
class ErasedCopy:
    """A ``copy_`` epilogue the ``gather_erase`` strategy deleted because its shapes differed."""

    piece: int
    """Piece whose epilogue was erased."""
    target: str
    """The graph input the copy would have written (the in-place residual)."""
    dst_shape: tuple
    """Shape of the destination (full)."""
    src_shape: tuple
    """Shape of the dropped source (sharded): this write is lost, so the next piece reads stale data."""


@dataclass(frozen=True)
class PieceBox:
    """One piece of the split graph: a compiled submodule or an eager splitting op."""

    index: int
    """Position in the range's piece list (submod_<index>)."""
    name: str
    """Submodule name."""
    kind: str
    """"compiled" or "splitting_op"."""
    op: str | None
    """Qualified name of the splitting op (e.g. "sp_lab::attention"), None for compiled pieces."""
    fingerprint: str | None
    """Hash of the structure after the passes; identical layers share it."""
    compile_time_s: float | None
    """Compile time of this piece."""
    cache_hit: bool | None
    """Whether Inductor's FX-graph cache served it (None: not compiled)."""
    collectives_after: dict
    """Collective and fused-op counts after the passes, by COLLECTIVE_KEYS."""
    matches: dict
    """Pattern matches by pass (sp_first, ..., boundary_erase)."""
    n_changed: int
    """Number of nodes the passes added."""

    @property
    def short_label(self) -> str:
        if self.kind == "splitting_op":
            return (self.op or "split").split("::")[-1]
        return f"piece {self.index}"


@dataclass(frozen=True)
class BoundaryLabel:
    """The cut between two pieces and everything that crosses it."""

    index: int
    """Position in the range's boundary list."""
    after_piece: int
    """Index of the producing piece."""
    before_piece: int
    """Index of the consuming piece."""
    tensors: tuple[TensorCrossing, ...]
    """Tensors crossing, in report order."""
    failures: tuple[FailureMark, ...] = ()
    """Checks that failed on the consuming side because of this boundary."""

    @property
    def signature(self) -> tuple:
        """What makes two boundaries "the same" for collapsing: tensor dtypes, shapes and sharding in order,
        and failed checks; not indices, nor names (FX numbers them per layer: getitem_5, getitem_9)."""
        return (tuple((t.dtype, t.shape_before, t.shape_after, t.sharded_before, t.sharded_after)
                      for t in self.tensors),
                tuple((f.check, f.expected_shape, f.actual_shape) for f in self.failures))

    @property
    def bytes_per_token(self) -> float:
        return sum(t.bytes_per_token_after or 0.0 for t in self.tensors)


@dataclass(frozen=True)
class PieceGroup:
    """A run of identical layers collapsed into one box: ``repeats`` copies of a ``period``-piece block.

    The run ends on a compiled piece, so the last copy may lack its trailing splitting op.
    """

    id: str
    """Stable id ("g0", "g1", ...) to pass to ``plot_overview(expand=[...])``."""
    pieces: tuple[int, ...]
    """Indices of all pieces in the run, in order."""
    period: int
    """Pieces per repeated block (2 for compiled piece + attention)."""
    repeats: int
    """Number of repeated blocks."""

    @property
    def first(self) -> int:
        return self.pieces[0]

    @property
    def last(self) -> int:
        return self.pieces[-1]

    @property
    def label(self) -> str:
        return f"pieces {self.first}-{self.last} x{self.repeats}"

    @property
    def block(self) -> tuple[int, ...]:
        """The first repeat: the pieces that stand for all the others."""
        return self.pieces[: self.period]


@dataclass(frozen=True)
class OverviewData:
    """Everything the overview draws, for one compile range."""

    model: str
    """Model name from the report."""
    tp_size: int | None
    """Tensor-parallel degree the report was compiled for."""
    synthetic: bool
    """True for hand-made reports (tests, benchmarks), never for the compiler's own."""
    range: RangeSummary
    """The compile range shown."""
    pieces: tuple[PieceBox, ...]
    """All pieces in order."""
    boundaries: tuple[BoundaryLabel, ...]
    """All boundaries in order."""
    groups: tuple[PieceGroup, ...]
    """Runs of identical layers (collapsed unless expanded)."""
    failures: tuple[FailureMark, ...]
    """Failed checks of this range."""
    erased: tuple[ErasedCopy, ...]
    """``copy_`` epilogues erased by ``gather_erase`` (numerically unsafe)."""

    def boundary_after(self, piece: int) -> BoundaryLabel | None:
        """The boundary leaving ``piece`` (None after the last piece)."""
        return self._by_after.get(piece)

    def lane(self, expand: bool | Iterable[str] = False) -> list[PieceBox | PieceGroup]:
        """Pieces and collapsed groups left to right; ``expand`` is True, False or group ids to open."""
        expanded = _expanded_ids(self.groups, expand)
        starts = {g.first: g for g in self.groups if g.id not in expanded}
        items: list[PieceBox | PieceGroup] = []
        i = 0
        while i < len(self.pieces):
            group = starts.get(self.pieces[i].index)
            if group is not None:
                items.append(group)
                i += len(group.pieces)
            else:
                items.append(self.pieces[i])
                i += 1
        return items

    @cached_property
    def _by_after(self) -> dict[int, BoundaryLabel]:
        return {b.after_piece: b for b in self.boundaries}

    def to_dict(self) -> dict:
        """Plain JSON-able form (used by ``emit_trace``), with group labels spelled out."""
        out = dataclasses.asdict(self)
        for g, d in zip(self.groups, out["groups"]):
            d["label"] = g.label
        return out


def _expanded_ids(groups: Sequence[PieceGroup], expand: bool | Iterable[str]) -> set[str]:
    if expand is True:
        return {g.id for g in groups}
    if expand is False or expand is None:
        return set()
    wanted = {expand} if isinstance(expand, str) else set(expand)
    unknown = wanted - {g.id for g in groups}
    if unknown:
        known = ", ".join(f"{g.id} ({g.label})" for g in groups) or "none"
        raise ValueError(f"unknown group ids {sorted(unknown)}; groups in this range: {known}")
    return wanted


def overview_data(report: Any, range_index: int | None = None, *, max_period: int = 4,
                  min_repeats: int = 2) -> OverviewData:
    """Pieces, boundaries, failures and erased copies of one range, with identical layers grouped.

    A run of ``min_repeats`` or more identical blocks of up to ``max_period`` pieces (equal
    fingerprints, equal boundary signatures, equal failures) becomes one :class:`PieceGroup`. Blocks
    start at a compiled piece so a group reads as "layers": compiled piece + the attention after it.
    ``range_index=None`` picks the first range with SP on.
    """
    report = as_report_dict(report)
    ri = _resolve_range(report, range_index)
    r = report["ranges"][ri]
    summary = RangeSummary(
        index=ri, lo=r["lo"], hi=r["hi"], enable_sp=bool(r.get("enable_sp")),
        enable_async_tp=bool(r.get("enable_async_tp")), boundary=r.get("boundary", "?"),
        compile_mode=r.get("compile_mode", "piecewise"), compiled=bool(r.get("compiled", True)),
        compile_time_s=r.get("compile_time_s"), numerically_unsafe=bool(r.get("numerically_unsafe")))

    pieces = tuple(PieceBox(
        index=p["index"], name=p.get("name", f"submod_{p['index']}"), kind=p.get("kind", "compiled"),
        op=p.get("op"), fingerprint=p.get("fingerprint"), compile_time_s=p.get("compile_time_s"),
        cache_hit=p.get("cache_hit"),
        collectives_after={k: (p.get("op_counts_after") or {}).get(k, 0) for k in COLLECTIVE_KEYS},
        matches={k: (p.get("matches") or {}).get(k, 0) for k in MATCH_KEYS},
        n_changed=len(p.get("changed") or ())) for p in r["pieces"])

    raw_boundaries = sorted(r.get("boundaries", []), key=lambda b: b["index"])
    feeding: dict[int, list[dict]] = defaultdict(list)
    for b in raw_boundaries:
        feeding[b["before_piece"]].append(b)
    failures_by_boundary: dict[int, list[FailureMark]] = defaultdict(list)
    failures = []
    for f in r.get("failures", []):
        # The boundary that fed the failing piece; prefer one that carries the named tensor.
        candidates = feeding.get(f["piece"], [])
        named = [b for b in candidates if any(t["name"] == f.get("tensor") for t in b["tensors"])]
        chosen = (named or candidates or [None])[-1]
        mark = FailureMark(piece=f["piece"], tensor=f.get("tensor", "?"), check=f.get("check", "?"),
                           expected_shape=tuple(f.get("expected_shape") or ()),
                           actual_shape=tuple(f.get("actual_shape") or ()), message=f.get("message", ""),
                           boundary=None if chosen is None else chosen["index"])
        failures.append(mark)
        if chosen is not None:
            failures_by_boundary[chosen["index"]].append(mark)

    boundaries = tuple(BoundaryLabel(
        index=b["index"], after_piece=b["after_piece"], before_piece=b["before_piece"],
        tensors=tuple(TensorCrossing(
            name=t["name"], dtype=t.get("dtype", "?"), shape_before=tuple(t.get("shape_before") or ()),
            shape_after=tuple(t.get("shape_after") or ()), sharded_before=bool(t.get("sharded_before")),
            sharded_after=bool(t.get("sharded_after")), bytes_per_token_after=t.get("bytes_per_token_after"))
            for t in b["tensors"]),
        failures=tuple(failures_by_boundary.get(b["index"], ()))) for b in raw_boundaries)
    erased = tuple(ErasedCopy(piece=e["piece"], target=e.get("target", "?"),
                              dst_shape=tuple(e.get("dst_shape") or ()), src_shape=tuple(e.get("src_shape") or ()))
                   for e in r.get("erased_copies", []))

    groups = _collapse(pieces, boundaries, failures, erased, max_period=max_period, min_repeats=min_repeats)
    provenance = report.get("provenance", {})
    return OverviewData(model=report.get("model", {}).get("name", "?"), tp_size=provenance.get("tp_size"),
                        synthetic=bool(provenance.get("synthetic")), range=summary, pieces=pieces,
                        boundaries=boundaries, groups=groups, failures=tuple(failures), erased=erased)


def _collapse(pieces: Sequence[PieceBox], boundaries: Sequence[BoundaryLabel], failures: Sequence[FailureMark],
              erased: Sequence[ErasedCopy], *, max_period: int, min_repeats: int) -> tuple[PieceGroup, ...]:
    """Greedy left-to-right run detection over per-piece signatures (O(pieces x max_period))."""
    by_after = {b.after_piece: b for b in boundaries}
    fails = defaultdict(list)
    for f in failures:
        fails[f.piece].append((f.check, f.expected_shape, f.actual_shape))
    erased_at = defaultdict(list)
    for e in erased:
        erased_at[e.piece].append((e.dst_shape, e.src_shape))
    # A piece is "the same" as another when its structure, its outgoing boundary and its problems are.
    sigs = [(p.kind, p.op, p.fingerprint, tuple(fails[p.index]), tuple(erased_at[p.index]),
             by_after[p.index].signature if p.index in by_after else None) for p in pieces]
    groups, i, n = [], 0, len(pieces)
    while i < n:
        best = None
        if pieces[i].kind == "compiled" and pieces[i].fingerprint is not None:
            for period in range(1, max_period + 1):
                block = sigs[i:i + period]
                repeats = 1
                while i + (repeats + 1) * period <= n and sigs[i + repeats * period:i + (repeats + 1) * period] == block:
                    repeats += 1
                # Strictly larger coverage only: on ties the shorter period reads better.
                if repeats >= min_repeats and (best is None or repeats * period > best[0] * best[1]):
                    best = (repeats, period)
        if best is None:
            i += 1
            continue
        repeats, period = best
        end = i + repeats * period
        # End on a compiled piece ("pieces 2-62 x31" for 31 layers): the last repeat's trailing splitting
        # op stays visible beside the group, as the first one before it does.
        while end - 1 > i and pieces[end - 1].kind != "compiled":
            end -= 1
        groups.append(PieceGroup(id=f"g{len(groups)}", pieces=tuple(p.index for p in pieces[i:end]),
                                 period=period, repeats=repeats))
        i = end
    return tuple(groups)


# --------------------------------------------------------------------------------------------
# 1. Overview: figure
# --------------------------------------------------------------------------------------------

# Lane geometry in x units (about _PX_PER_UNIT px each) sized so 10 px labels of neighbours do not collide.
_PIECE_W, _GROUP_W, _GAP_W, _LINE_H, _PX_PER_UNIT, _MAX_WIDTH_PX = 1.2, 4.0, 3.2, 0.22, 70, 1600


def _rect(x0: float, x1: float, y0: float, y1: float) -> tuple[list, list]:
    return [x0, x1, x1, x0, x0, None], [y0, y0, y1, y1, y0, None]


def _piece_hover(p: PieceBox) -> str:
    colls = ", ".join(f"{k} {v}" for k, v in p.collectives_after.items() if v) or "no collectives"
    matches = ", ".join(f"{k} {v}" for k, v in p.matches.items() if v) or "no pass matches"
    t = "n/a" if p.compile_time_s is None else f"{p.compile_time_s:.2f} s"
    return (f"<b>{p.name}</b> ({p.kind}{', ' + p.op if p.op else ''})<br>compile {t}, cache hit {p.cache_hit}"
            f"<br>after passes: {colls}<br>matches: {matches}<br>nodes added by passes: {p.n_changed}")


def build_overview_figure(data: OverviewData, expand: bool | Iterable[str] = False) -> go.Figure:
    """Horizontal lane of piece boxes with boundary labels between them (see module docstring)."""
    lane = data.lane(expand)
    erased_at = defaultdict(int)
    for e in data.erased:
        erased_at[e.piece] += 1
    failing_pieces = {f.piece for f in data.failures}
    boxes: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    labels = {"x": [], "y": [], "text": [], "hover": []}
    tensor_pts = {key: {"x": [], "y": [], "text": [], "hover": []} for key in ("full", "sharded")}
    fail_pts = {"x": [], "y": [], "text": [], "hover": []}
    unsafe_pts = {"x": [], "y": [], "text": [], "hover": []}
    links_x, links_y = [], []
    deepest = 0.0

    def put_tensors(x: float, boundary: BoundaryLabel, y0: float, prefix: str = "") -> float:
        y = y0
        if boundary.before_piece != boundary.after_piece + 1:
            # The compiler may record compiled -> compiled hand-overs that skip the eager splitting op.
            tensor_pts["full"]["x"].append(x)
            tensor_pts["full"]["y"].append(y)
            tensor_pts["full"]["text"].append(f"{prefix}<i>piece {boundary.after_piece} → piece {boundary.before_piece}:</i>")
            tensor_pts["full"]["hover"].append(f"boundary {boundary.index}")
            y -= _LINE_H
        for t in boundary.tensors:
            pts = tensor_pts["sharded" if t.sharded_after else "full"]
            pts["x"].append(x)
            pts["y"].append(y)
            pts["text"].append(prefix + t.text)
            pts["hover"].append(f"boundary {boundary.index}: piece {boundary.after_piece} → {boundary.before_piece}"
                                f"<br>{t.name} {t.dtype}<br>before passes {format_shape(t.shape_before)}"
                                f"{' sharded' if t.sharded_before else ''}<br>after passes "
                                f"{format_shape(t.shape_after)}{' sharded' if t.sharded_after else ''}"
                                f"<br>{t.bytes_per_token_after} bytes/token")
            y -= _LINE_H
        for f in boundary.failures:
            fail_pts["x"].append(x)
            fail_pts["y"].append(y)
            fail_pts["text"].append(f"<b>{f.text}</b>")
            fail_pts["hover"].append(f"{f.check} on {f.tensor}<br>{f.message}")
            y -= 3 * _LINE_H  # the failure label has three lines (check, expected, got)
        return y

    x = 0.0
    for k, item in enumerate(lane):
        if isinstance(item, PieceGroup):
            w, last, style = _GROUP_W, item.last, "group"
            # A stacked look says "many of these" without drawing them all.
            for off in (0.16, 0.08):
                bx, by = _rect(x + off, x + w + off, off, 1 + off)
                boxes["group_shadow"][0].extend(bx)
                boxes["group_shadow"][1].extend(by)
            block = [data.pieces[_index_of(data, i)] for i in item.block]
            kinds = " + ".join(p.op.split("::")[-1] if p.op else "compiled" for p in block)
            labels["text"].append(f"<b>{item.label}</b><br>{kinds}<br>[{item.id}]")
            labels["hover"].append(f"<b>{item.label}</b> ({item.id}): {item.repeats} identical blocks of "
                                   f"{item.period} pieces<br>" + "<br>".join(_piece_hover(p) for p in block))
            y = -0.3
            for p in block:  # with two or more repeats every boundary of the block is also inside the group
                inner = data.boundary_after(p.index)
                if inner is not None:
                    y = put_tensors(x + w / 2, inner, y, prefix="↳ ")
            deepest = min(deepest, y)
            n_erased = sum(erased_at[i] for i in item.pieces)
            if n_erased:
                unsafe_pts["x"].append(x + w / 2)
                unsafe_pts["y"].append(1.35)
                unsafe_pts["text"].append(f"⚠ unsafe: copy_ erased x{n_erased}")
                unsafe_pts["hover"].append("gather_erase dropped these residual writes; later pieces read stale data")
            bad = failing_pieces.intersection(item.pieces)
        else:
            w, last = (_PIECE_W if item.kind == "compiled" else _PIECE_W * 0.75), item.index
            style = item.kind if item.kind in _BOX_FILL else "compiled"
            labels["text"].append(f"<b>{item.short_label}</b>" + (f"<br>{item.compile_time_s:.2f} s"
                                                                  if item.compile_time_s else ""))
            labels["hover"].append(_piece_hover(item))
            if erased_at[item.index]:
                unsafe_pts["x"].append(x + w / 2)
                unsafe_pts["y"].append(1.35)
                unsafe_pts["text"].append("⚠ unsafe: copy_ erased")
                unsafe_pts["hover"].append("<br>".join(
                    f"copy_ into {e.target} {format_shape(e.dst_shape)} from {format_shape(e.src_shape)} erased"
                    for e in data.erased if e.piece == item.index))
            bad = {item.index} & failing_pieces
        bx, by = _rect(x, x + w, 0.0, 1.0)
        target = boxes["failed" if bad else style]
        target[0].extend(bx)
        target[1].extend(by)
        labels["x"].append(x + w / 2)
        labels["y"].append(0.5)
        x += w
        boundary = data.boundary_after(last)
        if boundary is not None and k < len(lane) - 1:
            links_x += [x, x + _GAP_W, None]
            links_y += [0.5, 0.5, None]
            deepest = min(deepest, put_tensors(x + _GAP_W / 2, boundary, -0.3))
            x += _GAP_W

    fig = go.Figure()
    fig.add_trace(go.Scatter(x=links_x, y=links_y, mode="lines", line={"color": "#999", "width": 1.5},
                             hoverinfo="skip", showlegend=False))
    box_style = {"group_shadow": ("#f4f7ef", "#9fb98b", None), "compiled": (_BOX_FILL["compiled"],
                 _BOX_LINE["compiled"], "compiled piece"), "splitting_op": (_BOX_FILL["splitting_op"],
                 _BOX_LINE["splitting_op"], "splitting op (eager)"), "group": (_BOX_FILL["group"],
                 _BOX_LINE["group"], "identical layers (collapsed)"), "failed": ("#f9d6d5", FAILURE_COLOR,
                                                                                 "failed check")}
    for key, (fill, line, name) in box_style.items():
        if key in boxes:
            fig.add_trace(go.Scatter(x=boxes[key][0], y=boxes[key][1], fill="toself", fillcolor=fill, mode="lines",
                                     line={"color": line, "width": 3 if key == "failed" else 1.5}, name=name,
                                     showlegend=name is not None, hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=labels["x"], y=labels["y"], mode="text", text=labels["text"],
                             hovertext=labels["hover"], hoverinfo="text", textfont={"size": 11},
                             showlegend=False))
    for key, color, name in (("full", FULL_COLOR, "full tensor"), ("sharded", SHARDED_COLOR, "sharded tensor")):
        pts = tensor_pts[key]
        fig.add_trace(go.Scatter(x=pts["x"], y=pts["y"], mode="text", text=pts["text"], hovertext=pts["hover"],
                                 hoverinfo="text", textfont={"color": color, "size": 10}, name=name,
                                 showlegend=bool(pts["x"])))
    if fail_pts["x"]:
        fig.add_trace(go.Scatter(x=fail_pts["x"], y=fail_pts["y"], mode="text", text=fail_pts["text"],
                                 hovertext=fail_pts["hover"], hoverinfo="text", name="failed check",
                                 textposition="bottom center", textfont={"color": FAILURE_COLOR, "size": 10},
                                 showlegend=False))
    if unsafe_pts["x"]:
        fig.add_trace(go.Scatter(x=unsafe_pts["x"], y=unsafe_pts["y"], mode="text", text=unsafe_pts["text"],
                                 hovertext=unsafe_pts["hover"], hoverinfo="text", name="unsafe: copy_ erased",
                                 textfont={"color": UNSAFE_COLOR, "size": 11}))
    title = f"{data.model} tp{data.tp_size} · {data.range.title}"
    if data.range.numerically_unsafe:
        title += " · <span style='color:#e6780b'>NUMERICALLY UNSAFE</span>"
    if not data.pieces:
        title += " · not compiled yet (ranges compile on their first token count)"
    elif not data.range.compiled:
        title += " · <span style='color:#d62728'>compile failed</span>"
    if data.synthetic:
        title += " · (synthetic report)"
    height = 320 + int(-deepest / _LINE_H) * 16
    fig.update_layout(
        # Long (expanded) lanes open at a readable zoom on their left end; pan to see the rest.
        title={"text": title, "font": {"size": 14}}, height=height,
        width=min(max(900, int(x * _PX_PER_UNIT)), _MAX_WIDTH_PX),
        xaxis={"visible": False, "range": [-0.3, min(x + 0.5, _MAX_WIDTH_PX / _PX_PER_UNIT)]}, yaxis={"visible": False, "range": [deepest - 0.2, 1.6]},
        plot_bgcolor="white", dragmode="pan", margin={"l": 20, "r": 20, "t": 60, "b": 20},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "x": 0},
    )
    return fig


def _index_of(data: OverviewData, piece_index: int) -> int:
    # Pieces are stored in report order, which the contract makes equal to their index.
    if data.pieces[piece_index].index == piece_index:
        return piece_index
    return next(i for i, p in enumerate(data.pieces) if p.index == piece_index)


def plot_overview(report: Any, range_index: int | None = None, *, expand: bool | Iterable[str] = False,
                  widget: bool = False) -> go.Figure:
    """Overview of one compiled range: pieces, boundaries, failures, erased copies, collapsed layers.

    ``expand``: False keeps identical layers collapsed, True opens them all, a list of group ids
    (``overview_data(report).groups``) opens those. ``widget=True`` returns a ``go.FigureWidget``.
    """
    return _maybe_widget(build_overview_figure(overview_data(report, range_index), expand=expand), widget)


# --------------------------------------------------------------------------------------------
# 2. Piece drill-down
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodePos:
    """One FX node placed on a layered layout."""

    name: str
    """FX node name."""
    target: str
    """Called op, e.g. "aten.mm.default"."""
    kind: str
    """collective, fused, matmul, norm, split, input, output or other."""
    shape: tuple
    """Output shape (ints or symbolic strings)."""
    dtype: str
    """Output dtype."""
    depth: int
    """Longest path from a graph input (the layer, i.e. x position)."""
    y: float
    """Position within the layer."""
    changed: bool
    """True when the passes added this node (after-graph) or removed it (before-graph)."""


@dataclass(frozen=True)
class GraphLayout:
    """A piece graph with positions: nodes by depth, edges as name pairs."""

    nodes: tuple[NodePos, ...]
    """Placed nodes."""
    edges: tuple[tuple[str, str], ...]
    """(producer, consumer) pairs."""

    def by_kind(self) -> dict[str, int]:
        """Node count per kind."""
        counts: dict[str, int] = defaultdict(int)
        for n in self.nodes:
            counts[n.kind] += 1
        return dict(counts)


@dataclass(frozen=True)
class PieceDiffData:
    """One piece before and after the SP and AsyncTP passes."""

    range: RangeSummary
    """Range the piece belongs to."""
    piece: PieceBox
    """The piece."""
    before: GraphLayout
    """Graph before the passes; ``changed`` marks nodes the passes removed."""
    after: GraphLayout
    """Graph after the passes; ``changed`` marks nodes the passes added."""
    added: tuple[str, ...]
    """Node names the passes added."""
    removed: tuple[str, ...]
    """Node names present before but not after."""
    op_counts: pl.DataFrame
    """Columns op, before, after, delta."""


def layered_layout(graph: Mapping, highlight: Iterable[str] = ()) -> GraphLayout:
    """Place ``{"nodes", "edges"}`` by topological depth (longest path), ordering each layer by the
    mean position of its producers so edges cross less. Plain Python, no graphviz."""
    nodes = list(graph.get("nodes", []))
    names = [n["name"] for n in nodes]
    known = set(names)
    edges = [(a, b) for a, b in graph.get("edges", []) if a in known and b in known]
    preds: dict[str, list[str]] = defaultdict(list)
    succs: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        preds[b].append(a)
        succs[a].append(b)
    indegree = {n: len(preds[n]) for n in names}
    depth = {n: 0 for n in names}
    ready = [n for n in names if indegree[n] == 0]
    seen = 0
    while ready:  # Kahn's algorithm, keeping graph order among ready nodes.
        n = ready.pop(0)
        seen += 1
        for s in succs[n]:
            depth[s] = max(depth[s], depth[n] + 1)
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    if seen != len(names):
        cyclic = sorted(n for n, d in indegree.items() if d > 0)
        raise ValueError(f"piece graph has a cycle through {cyclic[:5]}; report graphs must be DAGs")
    # Graph inputs (weights above all) sit just left of their first consumer, not all in column 0,
    # so a weight is drawn next to the matmul that reads it.
    for n in names:
        if not preds[n] and succs[n]:
            depth[n] = max(min(depth[s] for s in succs[n]) - 1, 0)
    layers: dict[int, list[str]] = defaultdict(list)
    for n in names:
        layers[depth[n]].append(n)
    y: dict[str, float] = {}
    order = {n: i for i, n in enumerate(names)}
    for d in sorted(layers):
        layer = layers[d]
        if d > 0:
            layer.sort(key=lambda n: (sum(y[p] for p in preds[n]) / max(len(preds[n]), 1), order[n]))
        for i, n in enumerate(layer):
            y[n] = i - (len(layer) - 1) / 2
    marked = set(highlight)
    placed = tuple(NodePos(name=n["name"], target=str(n.get("target", "")), kind=n.get("kind", "other"),
                           shape=tuple(n.get("shape") or ()), dtype=n.get("dtype", "?"), depth=depth[n["name"]],
                           y=y[n["name"]], changed=n["name"] in marked) for n in nodes)
    return GraphLayout(nodes=placed, edges=tuple(edges))


def piece_diff_data(report: Any, range_index: int | None = None, piece_index: int = 0) -> PieceDiffData:
    """The graph of one piece before and after the passes, placed for drawing, with what changed."""
    report = as_report_dict(report)
    ri = _resolve_range(report, range_index)
    overview = overview_data(report, ri)
    pieces = report["ranges"][ri]["pieces"]
    match = [p for p in pieces if p["index"] == piece_index]
    if not pieces:
        raise IndexError(f"range {ri} (tokens {report['ranges'][ri]['lo']}-{report['ranges'][ri]['hi']}) has no "
                         f"pieces: it was not compiled; run a token count in it first or pick another range_index")
    if not match:
        raise IndexError(f"piece_index={piece_index} not in range {ri} (pieces 0-{len(pieces) - 1})")
    raw = match[0]
    before_g = raw.get("graph_before") or {"nodes": [], "edges": []}
    after_g = raw.get("graph_after") or before_g
    before_names = [n["name"] for n in before_g.get("nodes", [])]
    after_names = {n["name"] for n in after_g.get("nodes", [])}
    # The compiler lists what it added; anything else absent from the before-graph was added too.
    added = tuple(dict.fromkeys([*(raw.get("changed") or ()),
                                 *(n for n in after_names if n not in set(before_names))]))
    removed = tuple(n for n in before_names if n not in after_names)
    keys = sorted(set(raw.get("op_counts_before") or {}) | set(raw.get("op_counts_after") or {}),
                  key=lambda k: (k not in COLLECTIVE_KEYS, k))
    before_counts = [int((raw.get("op_counts_before") or {}).get(k, 0)) for k in keys]
    after_counts = [int((raw.get("op_counts_after") or {}).get(k, 0)) for k in keys]
    op_counts = pl.DataFrame({"op": keys, "before": before_counts, "after": after_counts},
                             schema={"op": pl.String, "before": pl.Int64, "after": pl.Int64}
                             ).with_columns(delta=pl.col("after") - pl.col("before"))
    return PieceDiffData(range=overview.range, piece=overview.pieces[_index_of(overview, piece_index)],
                         before=layered_layout(before_g, removed), after=layered_layout(after_g, added),
                         added=added, removed=removed, op_counts=op_counts)


def build_piece_figure(data: PieceDiffData) -> go.Figure:
    """Before and after graphs side by side, coloured by node kind, changed nodes outlined thickly."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.04, subplot_titles=(
        f"before passes ({len(data.before.nodes)} nodes; {len(data.removed)} removed, thick outline)",
        f"after SP + AsyncTP ({len(data.after.nodes)} nodes; {len(data.added)} added, thick outline)"))
    legend_done: set[str] = set()
    for col, layout in ((1, data.before), (2, data.after)):
        pos = {n.name: (n.depth, n.y) for n in layout.nodes}
        ex, ey = [], []
        for a, b in layout.edges:
            ex += [pos[a][0], pos[b][0], None]
            ey += [pos[a][1], pos[b][1], None]
        fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line={"color": "#bbb", "width": 1}, hoverinfo="skip",
                                 showlegend=False), row=1, col=col)
        by_kind: dict[str, list[NodePos]] = defaultdict(list)
        for n in layout.nodes:
            by_kind[n.kind if n.kind in KIND_COLORS else "other"].append(n)
        for kind, nodes in by_kind.items():
            fig.add_trace(go.Scatter(
                x=[n.depth for n in nodes], y=[n.y for n in nodes], mode="markers+text",
                # Alternate label sides by depth: neighbouring columns are closer than a label is wide.
                text=[n.name for n in nodes], textfont={"size": 9},
                textposition=["top center" if n.depth % 2 else "bottom center" for n in nodes],
                marker={"size": [15 if n.changed else 11 for n in nodes], "color": KIND_COLORS[kind],
                            "line": {"width": [4 if n.changed else 0.5 for n in nodes], "color": "black"}},
                hovertext=[f"<b>{n.name}</b> ({n.kind})<br>{n.target}<br>{format_shape(n.shape)} {n.dtype}"
                           f"{'<br><b>' + ('added' if col == 2 else 'removed') + ' by the passes</b>' if n.changed else ''}"
                           for n in nodes], hoverinfo="text", name=kind, legendgroup=kind,
                showlegend=kind not in legend_done), row=1, col=col)
            legend_done.add(kind)
    changes = ", ".join(f"{r['op']} {r['before']}→{r['after']}" for r in data.op_counts.iter_rows(named=True)
                        if r["delta"]) or "no op-count changes"
    fig.update_layout(title={"text": f"{data.piece.name} ({data.piece.kind}) · {data.range.title}<br>"
                                      f"<sup>{changes}</sup>", "font": {"size": 14}},
                      height=560, width=max(1400, 2 * 48 * (1 + max((n.depth for n in data.after.nodes), default=0))),
                      plot_bgcolor="white", margin={"l": 20, "r": 20, "t": 90, "b": 20})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def plot_piece(report: Any, piece_index: int, range_index: int | None = None, *, widget: bool = False) -> go.Figure:
    """Drill-down into one piece: its graph before and after the SP and AsyncTP passes."""
    return _maybe_widget(build_piece_figure(piece_diff_data(report, range_index, piece_index)), widget)


# --------------------------------------------------------------------------------------------
# 3. Side by side
# --------------------------------------------------------------------------------------------

_COMPARE_UNITS = {"boundary bytes/token": "bytes", "boundary bytes/token/layer": "bytes",
                  "sharded tensors at boundaries": "count", "fused ops": "count",
                  "sp rewrites": "count", "compile time": "s", "cache hits": "count",
                  "failures": "count", "erased copies": "count"}


def _range_metrics(report: dict, ri: int) -> dict[str, float]:
    r = report["ranges"][ri]
    n_layers = sum(1 for p in r["pieces"] if p.get("kind") == "splitting_op") or \
        report.get("model", {}).get("num_layers") or 1
    counts = defaultdict(float)
    for p in r["pieces"]:
        for k in COLLECTIVE_KEYS:
            counts[k] += (p.get("op_counts_after") or {}).get(k, 0)
    crossing = [t for b in r.get("boundaries", []) for t in b["tensors"]]
    bytes_per_token = sum(t.get("bytes_per_token_after") or 0.0 for t in crossing)
    metrics = {
        "boundary bytes/token": bytes_per_token,
        "boundary bytes/token/layer": bytes_per_token / n_layers,
        "sharded tensors at boundaries": float(sum(bool(t.get("sharded_after")) for t in crossing)),
        **{f"{k}/layer": counts[k] / n_layers for k in COLLECTIVE_KEYS},
        "fused ops": float(sum(counts[k] for k in FUSED_KEYS)),
        "sp rewrites": float(sum((p.get("matches") or {}).get(k, 0) for p in r["pieces"]
                                 for k in ("sp_first", "sp_middle", "sp_last"))),
        "compile time": float(r.get("compile_time_s") or math.nan),
        "cache hits": float(sum(p.get("cache_hit") is True for p in r["pieces"])),
        "failures": float(len(r.get("failures", []))),
        "erased copies": float(len(r.get("erased_copies", []))),
    }
    return metrics


def _report_label(report: dict, ri: int) -> str:
    r = report["ranges"][ri]
    return f"{report.get('model', {}).get('name', '?')} {r.get('boundary', '?')} tokens {r['lo']}-{r['hi']}"


def compare_data(report_a: Any, report_b: Any, *, range_a: int | None = None, range_b: int | None = None,
                 labels: tuple[str, str] | None = None) -> pl.DataFrame:
    """Two reports (or two ranges of one) side by side, one row per metric.

    Columns: ``metric``, ``unit``, ``a``, ``b``, ``ratio`` (b / a, null where a is 0). The labels
    used for plotting are stored as the ``label_a`` / ``label_b`` columns (constant per frame).
    Metrics: bytes crossing boundaries per token (total and per layer), collectives and fused ops
    per layer by kind, fused ops, SP rewrites, compile time, cache hits, failures, erased copies.
    """
    ra, rb = as_report_dict(report_a), as_report_dict(report_b)
    ia, ib = _resolve_range(ra, range_a), _resolve_range(rb, range_b)
    ma, mb = _range_metrics(ra, ia), _range_metrics(rb, ib)
    la, lb = labels or (_report_label(ra, ia), _report_label(rb, ib))
    if la == lb:
        la, lb = f"{la} (a)", f"{lb} (b)"
    metrics = list(ma)
    frame = pl.DataFrame({
        "metric": metrics,
        "unit": [_COMPARE_UNITS.get(m, "per layer") for m in metrics],
        "a": [ma[m] for m in metrics], "b": [mb[m] for m in metrics],
    }).with_columns(
        ratio=pl.when(pl.col("a") != 0).then(pl.col("b") / pl.col("a")).otherwise(None),
        label_a=pl.lit(la), label_b=pl.lit(lb))
    return frame


_COMPARE_PANELS = (
    ("bytes crossing boundaries per token", ("boundary bytes/token", "boundary bytes/token/layer")),
    ("collectives per layer", tuple(f"{k}/layer" for k in COLLECTIVE_KEYS)),
    ("fused ops / rewrites / problems", ("fused ops", "sp rewrites", "failures", "erased copies")),
    ("compile", ("compile time", "cache hits")),
)


def build_compare_figure(frame: pl.DataFrame) -> go.Figure:
    """Grouped bars, one panel per unit family (bytes, per-layer counts, counts, compile)."""
    la, lb = frame["label_a"][0], frame["label_b"][0]
    values = {r["metric"]: r for r in frame.iter_rows(named=True)}
    fig = make_subplots(rows=1, cols=len(_COMPARE_PANELS), subplot_titles=[t for t, _ in _COMPARE_PANELS],
                        horizontal_spacing=0.06)
    for col, (_, metrics) in enumerate(_COMPARE_PANELS, start=1):
        metrics = [m for m in metrics if m in values]
        for side, label, color in (("a", la, "#1f77b4"), ("b", lb, "#ff7f0e")):
            fig.add_trace(go.Bar(x=metrics, y=[values[m][side] for m in metrics], name=label, marker_color=color,
                                 legendgroup=side, showlegend=col == 1,
                                 hovertemplate="%{x}: %{y:.4g}<extra>" + label + "</extra>"), row=1, col=col)
    fig.update_layout(barmode="group", height=460, width=1500, title=f"{la}  vs  {lb}",
                      legend={"orientation": "h", "y": -0.25}, margin={"l": 40, "r": 20, "t": 80, "b": 120})
    return fig


def plot_compare(report_a: Any, report_b: Any, *, range_a: int | None = None, range_b: int | None = None,
                 labels: tuple[str, str] | None = None, widget: bool = False) -> go.Figure:
    """Compare two reports (e.g. boundary "gather" vs "sharded") or two ranges of one report."""
    frame = compare_data(report_a, report_b, range_a=range_a, range_b=range_b, labels=labels)
    return _maybe_widget(build_compare_figure(frame), widget)


# --------------------------------------------------------------------------------------------
# 4. Tables
# --------------------------------------------------------------------------------------------

def piece_table(report: Any) -> pl.DataFrame:
    """One row per (range, piece): matches per pass, op counts before/after, compile time, cache hit.

    Columns: range, lo, hi, boundary, piece, name, kind, op, compile_time_s, cache_hit,
    ``match_<key>`` for each MATCH_KEYS, ``before_<op>`` / ``after_<op>`` for each counted op,
    n_changed, fingerprint.
    """
    report = as_report_dict(report)
    count_keys = sorted({k for r in report["ranges"] for p in r["pieces"]
                         for k in (*(p.get("op_counts_before") or {}), *(p.get("op_counts_after") or {}))}
                        | set(COLLECTIVE_KEYS), key=lambda k: (k not in COLLECTIVE_KEYS, k))
    rows = []
    for ri, r in enumerate(report["ranges"]):
        for p in r["pieces"]:
            row = {"range": ri, "lo": r["lo"], "hi": r["hi"], "boundary": r.get("boundary"), "piece": p["index"],
                   "name": p.get("name"), "kind": p.get("kind"), "op": p.get("op"),
                   "compile_time_s": p.get("compile_time_s"), "cache_hit": p.get("cache_hit")}
            row.update({f"match_{k}": (p.get("matches") or {}).get(k, 0) for k in MATCH_KEYS})
            row.update({f"before_{k}": (p.get("op_counts_before") or {}).get(k, 0) for k in count_keys})
            row.update({f"after_{k}": (p.get("op_counts_after") or {}).get(k, 0) for k in count_keys})
            row.update(n_changed=len(p.get("changed") or ()), fingerprint=p.get("fingerprint"))
            rows.append(row)
    schema = {"range": pl.Int64, "lo": pl.Int64, "hi": pl.Int64, "boundary": pl.String, "piece": pl.Int64,
              "name": pl.String, "kind": pl.String, "op": pl.String, "compile_time_s": pl.Float64,
              "cache_hit": pl.Boolean, **{f"match_{k}": pl.Int64 for k in MATCH_KEYS},
              **{f"before_{k}": pl.Int64 for k in count_keys}, **{f"after_{k}": pl.Int64 for k in count_keys},
              "n_changed": pl.Int64, "fingerprint": pl.String}
    return pl.DataFrame(rows, schema=schema)


def range_table(report: Any) -> pl.DataFrame:
    """One row per compile range: token span, passes on, strategy, compiled, time, failures, safety."""
    report = as_report_dict(report)
    return pl.DataFrame([{
        "range": i, "lo": r["lo"], "hi": r["hi"], "enable_sp": bool(r.get("enable_sp")),
        "enable_async_tp": bool(r.get("enable_async_tp")), "boundary": r.get("boundary"),
        "compile_mode": r.get("compile_mode"), "compiled": bool(r.get("compiled", True)),
        "compile_time_s": r.get("compile_time_s"), "pieces": len(r["pieces"]),
        "failures": len(r.get("failures", [])), "erased_copies": len(r.get("erased_copies", [])),
        "numerically_unsafe": bool(r.get("numerically_unsafe")),
    } for i, r in enumerate(report["ranges"])], schema_overrides={"compile_time_s": pl.Float64})


# --------------------------------------------------------------------------------------------
# 5. Export: HTML and torch's structured trace
# --------------------------------------------------------------------------------------------

def save_html(figs: go.Figure | Sequence[go.Figure], path: str | Path, *, title: str = "sp_lab report",
              include_plotlyjs: bool | str = True) -> Path:
    """Write one or several figures to one standalone HTML file (plotly.js embedded by default, so
    it opens offline; pass ``include_plotlyjs="cdn"`` for a ~4 MB smaller file)."""
    figs = [figs] if isinstance(figs, go.Figure) else list(figs)
    if not figs:
        raise ValueError("save_html needs at least one figure")
    divs = [f.to_html(full_html=False, include_plotlyjs=include_plotlyjs if i == 0 else False)
            for i, f in enumerate(figs)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{title}</title></head>\n"
                    f"<body>\n" + "\n".join(divs) + "\n</body></html>\n", encoding="utf-8")
    return path


def emit_trace(report: Any, *, include_overview: bool = True) -> bool:
    """Send the report (and each range's overview data) to torch's structured trace for tlparse.

    Artifacts: ``sp_lab_compile_report`` (the report JSON) and ``sp_lab_overview_<range>`` (the data
    behind ``plot_overview``). Only written when structured tracing is on (``TORCH_TRACE=<dir>``).
    Returns False, with a warning, when this torch has no compatible ``trace_structured``.
    """
    report = as_report_dict(report)
    try:
        from torch._logging import trace_structured
    except ImportError as err:
        warnings.warn(f"torch._logging.trace_structured is unavailable ({err}); report not traced", stacklevel=2)
        return False
    import inspect

    params = inspect.signature(trace_structured).parameters
    if "metadata_fn" not in params or "payload_fn" not in params:
        warnings.warn("torch._logging.trace_structured has no metadata_fn/payload_fn parameters on this torch; "
                      "report not traced (save it with save_html or report.to_json instead)", stacklevel=2)
        return False
    # Outside a compile there is no trace id; saying so stops torch from logging our stack every time.
    extra = {"expect_trace_id": False} if "expect_trace_id" in params else {}
    # Dict payloads are serialised by torch with one value per line, which keeps tlparse's lines short.
    trace_structured("artifact", metadata_fn=lambda: {"name": "sp_lab_compile_report", "encoding": "json"},
                     payload_fn=lambda: report, **extra)
    if include_overview:
        for ri in range(len(report["ranges"])):
            name = f"sp_lab_overview_{ri}"
            trace_structured("artifact", metadata_fn=lambda name=name: {"name": name, "encoding": "json"},
                             payload_fn=lambda ri=ri: overview_data(report, ri).to_dict(), **extra)
    return True


def _maybe_widget(fig: go.Figure, widget: bool) -> go.Figure:
    if not widget:
        return fig
    try:
        import anywidget  # noqa: F401  (plotly's FigureWidget is built on it since plotly 6)
    except ImportError as err:
        raise ImportError("widget=True needs anywidget (pip install anywidget); or use widget=False "
                          "and display the go.Figure") from err
    return go.FigureWidget(fig)


__all__ = [
    "BoundaryLabel", "ErasedCopy", "FailureMark", "GraphLayout", "NodePos", "OverviewData", "PieceBox",
    "PieceDiffData", "PieceGroup", "RangeSummary", "TensorCrossing", "as_report_dict", "build_compare_figure",
    "build_overview_figure", "build_piece_figure", "compare_data", "emit_trace", "format_shape", "layered_layout",
    "load_report", "overview_data", "piece_diff_data", "piece_table", "plot_compare", "plot_overview",
    "plot_piece", "range_table", "save_html",
]
