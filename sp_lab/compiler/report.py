"""CompileReport: what the compiler did, per token range, Dynamo graph and piece, as typed records.

This module is the contract between the compiler and everything that reads its output (the graph explorer,
sweeps, widgets, tests): small frozen dataclasses that the passes fill while they run, their JSON form, and
one strict loader. It imports no torch, so a report saved on a GPU box can be read anywhere.

Counting ops in a graph, snapshotting it and fingerprinting it are in ``sp_lab.compiler.inspection``.
"""

from __future__ import annotations

import dataclasses
import enum
import gzip
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from sp_lab.config import BoundaryStrategy
from sp_lab.jsonfile import TypedJSON, json_kind

__all__ = [
    "COLLECTIVE_KEYS",
    "FUSED_KEYS",
    "MATCH_KEYS",
    "OP_KEYS",
    "SCHEMA",
    "SP_MATCH_KEYS",
    "BoundaryCrossing",
    "BoundaryFailure",
    "BoundaryRecord",
    "CacheOutcome",
    "CompileReport",
    "CopyEvent",
    "CountKey",
    "DynamoGraph",
    "FusionDecision",
    "GraphSnapshot",
    "NodeRecord",
    "PieceOutput",
    "PieceRecord",
    "RangeReport",
    "ReportError",
    "SPRewrite",
    "TensorSpec",
    "record_from_json",
    "record_to_json",
]

SCHEMA = "sp_lab.compile_report/2"
_SCHEMA_V1 = "sp_lab.compile_report/1"
_R = TypeVar("_R")

CacheOutcome = Literal["hit", "miss", "off"]
"""What sp_lab's on-disk artifact cache did for a range (``RangeReport.artifact_cache``)."""

Shape = tuple[int | str, ...]
"""A tensor's shape: ints, or symbolic sizes written as strings (``"s0"``, ``"((s0 + 1)//2)"``)."""


class CountKey(enum.StrEnum):
    """Every key a report counts by: ops found in a graph and matches made by the passes.

    The values are the JSON keys of ``op_counts_before`` / ``op_counts_after`` (:data:`OP_KEYS`) and of
    ``matches`` (:data:`MATCH_KEYS`). A key prints as its plain string, so a printed ``op_counts()`` reads
    ``{'all_reduce': 0, ...}``.
    """

    __repr__ = str.__repr__

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    FUSED_ALL_GATHER_MATMUL = "fused_all_gather_matmul"
    FUSED_MATMUL_REDUCE_SCATTER = "fused_matmul_reduce_scatter"
    MM = "mm"
    SP_FIRST = "sp_first"
    SP_MIDDLE = "sp_middle"
    SP_LAST = "sp_last"
    ASYNC_TP_AG_MM = "async_tp_ag_mm"
    ASYNC_TP_MM_RS = "async_tp_mm_rs"
    BOUNDARY_GATHER = "boundary_gather"
    BOUNDARY_ERASE = "boundary_erase"
    DTENSOR_SEQ_RS = "dtensor_seq_reduce_scatter"  # DTensor's split/cat reduce_scatter restated on [N, H]
    DTENSOR_SEQ_AG = "dtensor_seq_all_gather"  # a matmul given its own [N / tp, H] gather of DTensor's


K = CountKey
OP_KEYS = (K.ALL_REDUCE, K.REDUCE_SCATTER, K.ALL_GATHER, K.FUSED_ALL_GATHER_MATMUL, K.FUSED_MATMUL_REDUCE_SCATTER, K.MM)
"""Ops counted in a piece's graph (``op_counts_before`` / ``op_counts_after``)."""
COLLECTIVE_KEYS = OP_KEYS[:5]
"""Collectives, plain and fused with a matmul."""
FUSED_KEYS = (K.FUSED_ALL_GATHER_MATMUL, K.FUSED_MATMUL_REDUCE_SCATTER)
MATCH_KEYS = (K.SP_FIRST, K.SP_MIDDLE, K.SP_LAST, K.ASYNC_TP_AG_MM, K.ASYNC_TP_MM_RS, K.BOUNDARY_GATHER, K.BOUNDARY_ERASE,
              K.DTENSOR_SEQ_RS, K.DTENSOR_SEQ_AG)
"""What the passes matched in a piece (``matches``)."""
SP_MATCH_KEYS = (K.SP_FIRST, K.SP_MIDDLE, K.SP_LAST)
del K


_IN_JSON = {"required": True}  # field metadata: a saved report must have it, though code may start it empty


class ReportError(ValueError):
    """A saved CompileReport is malformed; the message names the field's path (``ranges[1].pieces[0].lo``)."""


# -- records ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """A named graph input as compiled: shape and dtype (both None for non-tensors such as a SymInt)."""

    name: str
    shape: Shape | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class NodeRecord:
    """One FX node of a piece snapshot, for the explorer: ``op · module · shape``, source on hover."""

    name: str
    op: str  # placeholder | call_function | output | ...
    target: str  # "aten.mm.default"
    kind: str  # input | output | collective | fused | matmul | norm | split | other
    shape: Shape | None = None
    dtype: str | None = None
    module: str | None = None  # module path from nn_module_stack ("model.layers.3.mlp"); None: the root
    source: str | None = None  # the model's line that made it: "layers.py:57  return F.linear(x, w)"


@dataclass(frozen=True)
class GraphSnapshot:
    """A piece's graph: nodes in order and (producer, consumer) edges by node name."""

    nodes: tuple[NodeRecord, ...] = ()
    edges: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class PieceOutput:
    """A piece output's shape before and after the passes (they differ where SP left a token shard)."""

    index: int
    shape: Shape | None
    shape_before: Shape | None


@dataclass(frozen=True)
class FusionDecision:
    """One AsyncTP candidate and what the gate decided (``m`` is the range's low end; None: unreadable)."""

    pattern: Literal["all_gather_matmul", "matmul_reduce_scatter"]
    m: int | None
    n: int | None
    k: int | None
    decision: Literal["fuse", "no_fuse"]
    why: str
    dtype: str | None = None
    """The matmul's operand dtype (``"bfloat16"``, ``"float8_e4m3fn"`` for a scaled matmul, ...)."""


@dataclass(frozen=True)
class SPRewrite:
    """One ``all_reduce -> norm`` rewritten into ``reduce_scatter -> norm on the shard -> all_gather``."""

    all_reduce: str  # the rewritten node's name
    form: Literal["first", "middle", "last"]


@dataclass(frozen=True)
class CopyEvent:
    """An epilogue ``copy_(dst, src)`` whose source became a token shard, and what the boundary policy did."""

    target: str  # the graph input the copy writes (the in-place residual)
    dst_shape: Shape | None
    src_shape: Shape | None
    action: Literal["kept", "erased", "gathered"]


@dataclass(frozen=True)
class BoundaryCrossing:
    """A tensor made before a splitting op and used at or after it.

    ``name`` is the model's own name for it (the variable its next user's code reads, e.g. ``residual``,
    ``positions``), the same in every boundary strategy; ``node`` is the FX node as split; ``module`` and
    ``source`` say where it was made.
    """

    name: str
    dtype: str
    shape_before: Shape | None  # without SP (what the in-piece strategies compile the next piece for)
    shape_after: Shape | None  # what really crosses after the passes
    sharded_before: bool
    sharded_after: bool
    bytes_per_token_after: float | None
    node: str | None = None
    module: str | None = None
    source: str | None = None  # "layers.py:296  return funcol.all_reduce(out, ...)", as NodeRecord.source
    producer_piece: int | None = None  # the piece that made it (an earlier one than after_piece, for positions)
    producer_output: int | None = None  # index into that piece's outputs
    consumer_inputs: tuple[tuple[int, int], ...] = ()  # (piece index, index among its inputs), every user after


@dataclass(frozen=True)
class BoundaryRecord:
    """One splitting op and every tensor crossing it."""

    index: int
    after_piece: int
    before_piece: int
    tensors: tuple[BoundaryCrossing, ...] = ()
    splitting_op: str | None = None


@dataclass(frozen=True)
class BoundaryFailure:
    """A piece boundary that SP broke (strategy ``none``)."""

    piece: int
    tensor: str
    check: Literal["assert_size_stride", "copy_epilogue"]
    expected_shape: Shape | None
    actual_shape: Shape | None
    message: str
    lo: int | None = None
    hi: int | None = None


@dataclass(frozen=True)
class PieceRecord:
    """One piece of a range: a compiled submodule (what the passes saw and did) or an eager splitting op."""

    index: int
    name: str
    kind: Literal["compiled", "splitting_op"]
    op: str | None = None
    compile_time_s: float = 0.0
    cache_hit: bool | None = None  # served by an identical piece compiled earlier in this range
    inductor_cache_hit: bool | None = None  # Inductor's FX-graph cache served the compile
    matches: dict[CountKey, int] = field(default_factory=dict)
    op_counts_before: dict[CountKey, int] = field(default_factory=dict)
    op_counts_after: dict[CountKey, int] = field(default_factory=dict)
    graph_before: GraphSnapshot | None = None
    graph_after: GraphSnapshot | None = None
    changed: tuple[str, ...] = ()  # nodes the passes added
    fingerprint: str | None = None
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[PieceOutput, ...] = ()
    async_tp_decisions: tuple[FusionDecision, ...] = ()
    sp_rewrites: tuple[SPRewrite, ...] = ()
    copies: tuple[CopyEvent, ...] = ()

    @property
    def erased_copies(self) -> tuple[CopyEvent, ...]:
        return tuple(c for c in self.copies if c.action == "erased")


@dataclass(frozen=True)
class DynamoGraph:
    """One graph Dynamo captured and handed to sp_lab (a model gives one, symbolic in the token count, per batch
    size; another only where a call breaks what a capture assumed)."""

    index: int
    static_tokens: int | None  # the token count Dynamo specialised this graph to; None: symbolic
    capture_time_s: float  # from the call that triggered the capture to the graph reaching sp_lab
    # Captured by another compile of the model (SharedCaptures) and reused here: capture_time_s is 0.
    shared_capture: bool = False


@dataclass
class RangeReport:
    """The artifact of one token range compiled from one Dynamo graph (filled while it compiles)."""

    lo: int
    hi: int
    enable_sp: bool
    enable_async_tp: bool
    boundary: BoundaryStrategy
    compile_mode: str
    compiled: bool = False
    compile_time_s: float = 0.0
    pieces: list[PieceRecord] = field(default_factory=list)
    boundaries: list[BoundaryRecord] = field(default_factory=list)
    failures: list[BoundaryFailure] = field(default_factory=list)
    dynamo_graph: int | None = None  # index into CompileReport.graphs; None: not compiled yet
    static_tokens: int | None = None  # copied from that graph: the one token count this artifact serves
    token_guards: list[str] = field(default_factory=list)  # what its trace assumed about the token count N
    artifact_cache: CacheOutcome | None = None
    """sp_lab's on-disk artifact cache (``compiler/artifact_cache.py``): "hit" when an entry for this range was
    loaded, "miss" when it compiled afresh and saved one, "off" without a cache; None: not compiled."""

    @property
    def erased_copies(self) -> list[tuple[int, CopyEvent]]:
        """(piece index, copy) for every copy ``gather_erase`` erased."""
        return [(p.index, c) for p in self.pieces for c in p.erased_copies]

    @property
    def numerically_unsafe(self) -> bool:
        """True when ``gather_erase`` erased a copy: an in-place residual update may have been dropped."""
        return bool(self.erased_copies)

    def op_counts(self) -> dict[CountKey, int]:
        """Ops in the compiled pieces after all passes (identical pieces counted once per use)."""
        return _sum_counts(OP_KEYS, (p.op_counts_after for p in self.pieces))

    def matches(self) -> dict[CountKey, int]:
        return {k: v for k, v in _sum_counts(MATCH_KEYS, (p.matches for p in self.pieces)).items() if v}

    def to_dict(self) -> dict[str, Any]:
        d = _to_json(self)
        # Derived, written for readers of the raw JSON; recomputed on load.
        d["erased_copies"] = [dict(_to_json(c), piece=i) for i, c in self.erased_copies]
        d["numerically_unsafe"] = self.numerically_unsafe
        return d


def _sum_counts(keys: tuple[CountKey, ...], counts: typing.Iterable[dict[CountKey, int]]) -> dict[CountKey, int]:
    total = dict.fromkeys(keys, 0)
    for c in counts:
        for key, n in c.items():
            total[CountKey(key)] = total.get(CountKey(key), 0) + n
    return total


@dataclass
class CompileReport:
    """Requested and effective configuration, provenance, the Dynamo graphs, and one :class:`RangeReport` per
    token range and Dynamo graph (ranges not compiled yet are listed once, ``compiled=False``)."""

    requested: dict[str, Any]
    effective: dict[str, Any]
    provenance: dict[str, Any]
    model: dict[str, Any] = field(default_factory=dict)
    ranges: list[RangeReport] = field(default_factory=list, metadata=_IN_JSON)
    graphs: list[DynamoGraph] = field(default_factory=list)

    def range_for(self, num_tokens: int) -> RangeReport:
        """The entry serving ``num_tokens``: a graph Dynamo specialised to that count, else the symbolic one."""
        entries = [r for r in self.ranges if r.lo <= num_tokens <= r.hi]
        if not entries:
            raise ValueError(
                f"num_tokens={num_tokens} is outside every compile range "
                f"{sorted({(r.lo, r.hi) for r in self.ranges})}"
            )
        compiled = [r for r in entries if r.compiled]
        return next((r for r in compiled if r.static_tokens == num_tokens),
                    next((r for r in compiled if r.static_tokens is None), entries[0]))

    def op_counts(self, num_tokens: int) -> dict[CountKey, int]:
        """Collectives and fused ops in the compiled pieces (after all passes) of the range serving ``num_tokens``.

        Raises if that range has not been compiled yet (call the model with such a token count first).
        """
        rng = self.range_for(num_tokens)
        if not rng.compiled:
            raise RuntimeError(
                f"range [{rng.lo}, {rng.hi}] has not been compiled yet: call the compiled model with "
                f"{num_tokens} tokens first"
            )
        return rng.op_counts()

    def sp_rewrites(self, num_tokens: int) -> int:
        matches = self.range_for(num_tokens).matches()
        return sum(matches.get(k, 0) for k in SP_MATCH_KEYS)

    def fusion_fired(self, num_tokens: int) -> bool:
        counts = self.op_counts(num_tokens)
        return sum(counts[k] for k in FUSED_KEYS) > 0

    @property
    def failures(self) -> list[BoundaryFailure]:
        return [f for rng in self.ranges for f in rng.failures]

    @property
    def compile_time_s(self) -> float:
        """Everything sp_lab's compiles took: Dynamo's captures plus every range of every graph."""
        return sum(g.capture_time_s for g in self.graphs) + sum(r.compile_time_s for r in self.ranges)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "requested": self.requested,
            "effective": self.effective,
            "provenance": self.provenance,
            "graphs": [_to_json(g) for g in self.graphs],
            "ranges": [r.to_dict() for r in self.ranges],
            "failures": [_to_json(f) for f in self.failures],  # derived, as in RangeReport.to_dict
        }

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: Any) -> CompileReport:
        """Inverse of :meth:`to_dict` (older schemas migrated). A malformed report raises :class:`ReportError`
        (a ``ValueError``) naming the field's path (e.g. ``ranges[1].pieces[0].op_counts_after``), what it
        should hold and what it holds."""
        if not isinstance(d, dict):
            raise ReportError(f"compile report: expected a JSON object, got {json_kind(d)}")
        schema = d.get("schema")
        if schema == _SCHEMA_V1:
            d = _migrate_v1(d)
        elif schema != SCHEMA:
            raise ReportError(
                f"not an sp_lab compile report: schema {schema!r}, expected {SCHEMA!r} (or {_SCHEMA_V1!r})"
            )
        data = {k: v for k, v in d.items() if k not in ("schema", "failures")}
        report = _decode(cls, data, "")
        for i, r in enumerate(report.ranges):
            if not 1 <= r.lo <= r.hi:
                raise ReportError(f"compile report: ranges[{i}]: token range [{r.lo}, {r.hi}] is empty or below 1")
        return report

    @classmethod
    def from_json(cls, text: str) -> CompileReport:
        """Read a report from JSON text (see :meth:`load` for a file)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ReportError(f"compile report is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> CompileReport:
        """Read a report saved with ``report.to_json(path)`` (``.json.gz`` too); errors name the file."""
        path = Path(path)
        try:
            raw = path.read_bytes()
            text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"no compile report at {str(path)!r}; save one with report.to_json(path)") from None
        except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as e:
            reason = f"not UTF-8 text: {e.reason} at byte {e.start}" if isinstance(e, UnicodeDecodeError) else str(e)
            raise ReportError(f"{path}: not a JSON compile report ({reason})") from None
        try:
            return cls.from_json(text)
        except ReportError as e:
            raise ReportError(f"{path}: {e}") from None


# -- JSON -------------------------------------------------------------------------------------------------------


def _to_json(record: Any) -> Any:
    """A record as plain JSON values (lists, dicts with str keys, str, numbers, bool, None)."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: _to_json(getattr(record, f.name)) for f in dataclasses.fields(record)}
    if isinstance(record, (list, tuple)):
        return [_to_json(x) for x in record]
    if isinstance(record, dict):
        return {str(k): _to_json(v) for k, v in record.items()}
    if isinstance(record, enum.Enum):
        return record.value
    return record


def _migrate_v1(d: dict[str, Any]) -> dict[str, Any]:
    """``sp_lab.compile_report/1`` -> /2: copy events replace per-piece ``erased_copies``; non-tensor inputs
    have dtype None (was ""). Anything malformed is left as it is, for the loader to name."""
    d = dict(d, schema=SCHEMA)
    if isinstance(d.get("ranges"), list):
        d["ranges"] = [_migrate_v1_range(r) if isinstance(r, dict) else r for r in d["ranges"]]
    return d


def _migrate_v1_range(r: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(r.get("pieces"), list):
        return r
    pieces = []
    for p in r["pieces"]:
        if isinstance(p, dict):
            p = dict(p)
            own = p.pop("erased_copies", None)
            if isinstance(own, list) and own:
                p["copies"] = [dict(e, action="erased") if isinstance(e, dict) else e for e in own]
            elif own:
                p["copies"] = own  # malformed: named by the loader
            if isinstance(p.get("inputs"), list):
                p["inputs"] = [dict(i, dtype=i.get("dtype") or None) if isinstance(i, dict) else i
                               for i in p["inputs"]]
        pieces.append(p)
    return {**r, "pieces": pieces}


_DERIVED = {RangeReport: ("erased_copies", "numerically_unsafe")}  # written by to_dict, recomputed on load
_JSON = TypedJSON(ReportError, "compile report", derived=_DERIVED)


def _decode(tp: Any, value: Any, path: str) -> Any:
    """``value`` (parsed JSON) checked against the annotation ``tp`` and built into records."""
    return _JSON.decode(tp, value, path)


def record_to_json(record: Any) -> Any:
    """Any report record as plain JSON values (for side files that store a single record)."""
    return _to_json(record)


def record_from_json(cls: type[_R], data: Any, path: str = "") -> _R:
    """Build ``cls`` from parsed JSON with the report's strict checks (raises :class:`ReportError`)."""
    return _decode(cls, data, path)
