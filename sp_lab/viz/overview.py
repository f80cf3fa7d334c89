"""The overview's data: one compile range as a lane of pieces and the boundaries between them.

Plain records the tests assert on (``overview_data``); ``overview_figure`` draws them. Identical decoder
layers are collapsed into one :class:`PieceGroup` so an 80-layer model reads as five boxes.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from sp_lab.compiler.report import (
    COLLECTIVE_KEYS,
    MATCH_KEYS,
    OP_KEYS,
    BoundaryCrossing,
    CountKey,
    PieceRecord,
    RangeReport,
)
from sp_lab.compiler.shape_text import format_shape, format_size
from sp_lab.viz.report_input import as_report, range_label, report_provenance, resolve_range

if TYPE_CHECKING:
    from sp_lab.viz.report_input import ReportSource

__all__ = [
    "ABBREVIATION_KEY", "OP_ABBREVIATIONS", "BoundaryLabel", "ErasedCopy", "FailureMark", "OverviewData", "PieceBox", "PieceGroup",
    "crossing_text", "format_shape", "format_size", "ops_summary", "overview_data", "range_title",
]

# The field's shorthand, as in vLLM's and PyTorch's AsyncTP write-ups: "AG+mm" is all_gather fused into a matmul.
OP_ABBREVIATIONS = {CountKey.ALL_REDUCE: "AR", CountKey.REDUCE_SCATTER: "RS", CountKey.ALL_GATHER: "AG",
                    CountKey.FUSED_ALL_GATHER_MATMUL: "AG+mm", CountKey.FUSED_MATMUL_REDUCE_SCATTER: "mm+RS",
                    CountKey.MM: "mm"}
_MEANINGS = {"AR": "all-reduce", "RS": "reduce-scatter", "AG": "all-gather",
             "AG+mm": "all-gather fused into the next matmul (AsyncTP)",
             "mm+RS": "matmul fused with its reduce-scatter (AsyncTP)", "mm": "matmul"}
ABBREVIATION_KEY = "<br>".join((
    " · ".join(f"{a} = {_MEANINGS[a]}" for a in ("AR", "RS", "AG", "mm")),
    " · ".join(f"{a} = {_MEANINGS[a]}" for a in ("AG+mm", "mm+RS")),
    "B/tok = bytes per token on one rank · N = tokens in the forward"))
"""The key to every abbreviation the explorer's figures print (drawn under each of them)."""


def ops_summary(counts: dict[str, int], keys: Sequence[str] = COLLECTIVE_KEYS) -> str:
    """``{"reduce_scatter": 1, "fused_all_gather_matmul": 1}`` -> ``"1 RS · 1 AG+mm"`` ("" when none)."""
    return " · ".join(f"{counts[k]} {OP_ABBREVIATIONS[k]}" for k in keys if counts.get(k))


def range_title(rng: RangeReport) -> str:
    """``"tokens 8-64 · boundary=sharded · SP on · AsyncTP on · compile 4.3 s"``."""
    on = {True: "on", False: "off"}
    t = f" · compile {rng.compile_time_s:.1f} s" if rng.compile_time_s else ""
    return (f"{range_label(rng)} · boundary={rng.boundary} · SP {on[rng.enable_sp]} · "
            f"AsyncTP {on[rng.enable_async_tp]}{t}")


def crossing_text(t: BoundaryCrossing) -> str:
    """One label line for a tensor crossing a boundary: name, shape received, sharded or not, bytes per token."""
    return (f"{t.name} {format_shape(t.shape_after)}{' sharded' if t.sharded_after else ''}"
            f" · {t.bytes_per_token_after or 0:g} B/tok")


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
    """Index of the boundary the tensor crossed, or None when the report has no boundary feeding the piece
    (a compile that failed leaves no pieces and no boundaries)."""

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
    """Served by an identical piece compiled earlier in this range (None: not compiled)."""
    inductor_cache_hit: bool | None
    """Inductor's FX-graph cache served the compile (None: unknown or not compiled)."""
    ops_after: dict
    """Collective, fused-op and matmul counts after the passes (keys of OP_ABBREVIATIONS)."""
    matches: dict
    """Pattern matches by pass (sp_first, ..., boundary_erase)."""
    n_changed: int
    """Number of nodes the passes added."""

    @property
    def short_label(self) -> str:
        if self.kind == "splitting_op":
            return (self.op or "split").split("::")[-1]
        return f"piece {self.index}"

    @property
    def ops_text(self) -> str:
        """What the piece runs, e.g. ``"1 RS · 1 AG+mm · 1 mm+RS"``; "no collectives" for a compiled piece
        without any, "" for a splitting op."""
        if self.kind != "compiled":
            return ""
        return ops_summary(self.ops_after) or "no collectives"

    @property
    def compile_text(self) -> str:
        """``"0.42 s"``, ``"0.42 s · cached"`` or "" when the piece was not compiled."""
        if self.compile_time_s is None or self.kind != "compiled":
            return ""
        cached = self.cache_hit or self.inductor_cache_hit
        return f"{self.compile_time_s:.2f} s" + (" · cached" if cached else "")


@dataclass(frozen=True)
class BoundaryLabel:
    """The cut between two pieces and everything that crosses it."""

    index: int
    """Position in the range's boundary list."""
    after_piece: int
    """Index of the producing piece."""
    before_piece: int
    """Index of the consuming piece."""
    tensors: tuple[BoundaryCrossing, ...]
    """Tensors crossing, in report order (the compiler's records)."""
    failures: tuple[FailureMark, ...] = ()
    """Checks that failed on the consuming side because of this boundary."""

    @property
    def signature(self) -> tuple:
        """What makes two boundaries "the same" for collapsing: tensor dtypes, shapes and sharding in order,
        and failed checks; not indices, nor FX names (numbered per layer: getitem_5, getitem_9)."""
        return (tuple((t.dtype, t.shape_before, t.shape_after, t.sharded_before, t.sharded_after)
                      for t in self.tensors),
                tuple((f.check, f.expected_shape, f.actual_shape) for f in self.failures))

    @property
    def bytes_per_token(self) -> float:
        """Bytes per token handed over at this boundary, all tensors."""
        return sum(t.bytes_per_token_after or 0.0 for t in self.tensors)

    @property
    def sharded_bytes_per_token(self) -> float:
        """The part of :attr:`bytes_per_token` carried by token-sharded tensors."""
        return sum(t.bytes_per_token_after or 0.0 for t in self.tensors if t.sharded_after)

    @property
    def text(self) -> str:
        """Summary line: ``"1,152 B/tok (256 sharded, 896 full)"``."""
        total, sharded = self.bytes_per_token, self.sharded_bytes_per_token
        return f"{total:,.0f} B/tok ({sharded:,.0f} sharded, {total - sharded:,.0f} full)"


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
    """True for hand-made reports, never for the compiler's own."""
    range_index: int
    """Position of the range shown in the report's ranges."""
    range: RangeReport
    """The compile range shown (the compiler's record)."""
    pieces: tuple[PieceBox, ...]
    """All pieces in order (empty when the range did not compile)."""
    boundaries: tuple[BoundaryLabel, ...]
    """All boundaries in order."""
    groups: tuple[PieceGroup, ...]
    """Runs of identical layers (collapsed unless expanded)."""
    failures: tuple[FailureMark, ...]
    """Failed checks of this range."""
    erased: tuple[ErasedCopy, ...]
    """``copy_`` epilogues erased by ``gather_erase`` (numerically unsafe)."""
    provenance: str
    """:func:`~sp_lab.viz.report_input.report_provenance` of the report: backend, device, torch."""

    def boundary_after(self, piece: int) -> BoundaryLabel | None:
        """The boundary leaving ``piece`` (None after the last piece)."""
        return self._by_after.get(piece)

    def piece(self, index: int) -> PieceBox:
        """The piece with this index."""
        return self._by_index[index]

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

    @cached_property
    def _by_index(self) -> dict[int, PieceBox]:
        return {p.index: p for p in self.pieces}

    def to_dict(self) -> dict:
        """Plain JSON-able form (used by ``emit_trace``): the range by its title, group labels spelled out."""
        out = {"model": self.model, "tp_size": self.tp_size, "synthetic": self.synthetic,
               "range_index": self.range_index, "range": range_title(self.range),
               **{name: [dataclasses.asdict(x) for x in getattr(self, name)]
                  for name in ("pieces", "boundaries", "groups", "failures", "erased")}}
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


def _piece(p: PieceRecord) -> PieceBox:
    after = p.op_counts_after or {}
    return PieceBox(
        index=p.index, name=p.name, kind=p.kind, op=p.op, fingerprint=p.fingerprint,
        compile_time_s=p.compile_time_s if p.kind == "compiled" else None, cache_hit=p.cache_hit,
        inductor_cache_hit=p.inductor_cache_hit,
        ops_after={k: int(after.get(k, 0)) for k in OP_KEYS},
        matches={k: int(p.matches.get(k, 0)) for k in MATCH_KEYS}, n_changed=len(p.changed))


def overview_data(report: ReportSource, range_index: int | None = None, *, max_period: int = 4,
                  min_repeats: int = 2) -> OverviewData:
    """Pieces, boundaries, failures and erased copies of one range, with identical layers grouped.

    A run of ``min_repeats`` or more identical blocks of up to ``max_period`` pieces (equal
    fingerprints, equal boundary signatures, equal failures) becomes one :class:`PieceGroup`. Blocks
    start at a compiled piece so a group reads as "layers": compiled piece + the attention after it.
    ``range_index=None`` picks the first SP range that compiled or failed.
    """
    report = as_report(report)
    ri = resolve_range(report, range_index)
    r = report.ranges[ri]
    pieces = tuple(_piece(p) for p in r.pieces)

    raw_boundaries = sorted(r.boundaries, key=lambda b: b.index)
    feeding: dict[int, list] = defaultdict(list)
    for b in raw_boundaries:
        feeding[b.before_piece].append(b)
    failures_by_boundary: dict[int, list[FailureMark]] = defaultdict(list)
    failures = []
    for f in r.failures:
        # The boundary that fed the failing piece; prefer one that carries the named tensor.
        candidates = feeding.get(f.piece, [])
        named = [b for b in candidates if any(t.name == f.tensor for t in b.tensors)]
        chosen = (named or candidates or [None])[-1]
        mark = FailureMark(piece=f.piece, tensor=f.tensor, check=f.check,
                           expected_shape=tuple(f.expected_shape or ()), actual_shape=tuple(f.actual_shape or ()),
                           message=f.message, boundary=None if chosen is None else chosen.index)
        failures.append(mark)
        if chosen is not None:
            failures_by_boundary[chosen.index].append(mark)

    boundaries = tuple(BoundaryLabel(
        index=b.index, after_piece=b.after_piece, before_piece=b.before_piece,
        tensors=tuple(b.tensors),
        failures=tuple(failures_by_boundary.get(b.index, ()))) for b in raw_boundaries)
    erased = tuple(ErasedCopy(piece=piece, target=c.target, dst_shape=tuple(c.dst_shape or ()),
                              src_shape=tuple(c.src_shape or ())) for piece, c in r.erased_copies)

    groups = _collapse(pieces, boundaries, failures, erased, max_period=max_period, min_repeats=min_repeats)
    provenance = report.provenance
    return OverviewData(model=report.model.get("name", "?"), tp_size=provenance.get("tp_size"),
                        synthetic=bool(provenance.get("synthetic")), range_index=ri, range=r, pieces=pieces,
                        boundaries=boundaries, groups=groups, failures=tuple(failures), erased=erased,
                        provenance=report_provenance(report))


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
