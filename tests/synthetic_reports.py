"""SYNTHETIC CompileReport dicts, built by hand from the schema in sp_lab/compiler/report.py.

Nothing here comes out of the compiler: these reports are what the compiler *should* write for a
toy or Llama-shaped model under each boundary strategy, so that the plots and tables in
``sp_lab.viz`` can be built and tested before (and independently of) ``sp_lab.compiler``. Every
report says so in ``provenance["synthetic"]``. Once the compiler lands, real reports saved from it
(``tests/data/report_toy_sharded.json``) replace these as the ground truth.

What each strategy looks like here (docs/piecewise-boundaries.md):

- ``none``: SP rewrites each piece; the residual leaves piece 0 sharded but piece 2 was compiled
  for the full shape, so piece 2 fails (``assert_size_stride`` for an out-of-place residual,
  ``copy_epilogue`` for one updated in place).
- ``gather_erase``: every output whose token dim shrank is all-gathered at the end of its piece and
  mismatched ``copy_`` epilogues are erased (numerically unsafe for in-place residuals).
- ``gather``: as ``gather_erase`` but the ``copy_`` is kept (gathered into).
- ``sharded``: SP runs on the whole graph before splitting; the residual crosses every boundary as
  a ``[ceil(s0 / tp), hidden]`` shard.

Run ``python tests/synthetic_reports.py`` to rewrite the JSON fixtures in ``tests/data/``.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

STRATEGIES = ("none", "gather_erase", "gather", "sharded")
COUNT_KEYS = ("all_reduce", "reduce_scatter", "all_gather", "fused_all_gather_matmul",
              "fused_matmul_reduce_scatter", "mm")
MATCH_KEYS = ("sp_first", "sp_middle", "sp_last", "async_tp_ag_mm", "async_tp_mm_rs",
              "boundary_gather", "boundary_erase")
DATA_DIR = Path(__file__).parent / "data"


@dataclass(frozen=True)
class SyntheticShape:
    """Model dimensions the synthetic report is shaped after (a subset of ``ModelSpec``)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str
    residual_inplace: bool = False

    def to_dict(self) -> dict:
        return dict(self.__dict__)


TOY = SyntheticShape("toy", 64, 128, 2, 4, 2, 16, 256, "float32")
LLAMA_3_8B = SyntheticShape("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256, "bfloat16")
LLAMA_3_70B = SyntheticShape("llama-3-70b", 8192, 28672, 80, 64, 8, 128, 128256, "bfloat16")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class _Graph:
    """A tiny FX-like graph recorder producing the report's ``{"nodes", "edges"}`` form."""

    def __init__(self) -> None:
        self.nodes: list[dict] = []
        self.edges: list[list[str]] = []
        self._names: Counter[str] = Counter()

    def add(self, base: str, target: str, kind: str, inputs: list[str], shape: list, dtype: str) -> str:
        n = self._names[base]
        self._names[base] += 1
        name = base if n == 0 else f"{base}_{n}"
        op = {"input": "placeholder", "output": "output"}.get(kind, "call_function")
        self.nodes.append({"name": name, "op": op, "target": target, "kind": kind,
                           "shape": shape, "dtype": dtype})
        self.edges.extend([src, name] for src in inputs)
        return name

    def to_dict(self) -> dict:
        return {"nodes": self.nodes, "edges": self.edges}


def _piece_graph(shape: SyntheticShape, tp: int, role: str, *, sp: bool, async_tp: bool,
                 strategy: str) -> dict:
    """Graph of one compiled piece.

    ``role`` is "first" (embedding + layer 0 up to attention), "middle" (attention output of layer
    i through the QKV projection of layer i + 1) or "last" (last attention output to logits).
    """
    g = _Graph()
    dt = shape.dtype
    s, H = "s0", shape.hidden_size
    shard = f"({s} + {tp - 1})//{tp}" if tp > 1 else s
    qkv_out = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim // tp
    matches = Counter()
    residual_sharded_in = sp and strategy == "sharded" and role != "first"

    def norm(x: str, rows) -> str:
        p = g.add("pow", "aten.pow.Tensor_Scalar", "norm", [x], [rows, H], "float32")
        m = g.add("mean", "aten.mean.dim", "norm", [p], [rows, 1], "float32")
        r = g.add("rsqrt", "aten.rsqrt.default", "norm", [m], [rows, 1], "float32")
        return g.add("mul", "aten.mul.Tensor", "norm", [x, r], [rows, H], dt)

    def reduce(x: str, first: bool) -> tuple[str, object]:
        """all_reduce (TP) or reduce_scatter over padded tokens (SP). Returns (node, token rows)."""
        if not sp:
            return g.add("all_reduce", "_c10d_functional.all_reduce.default", "collective", [x], [s, H],
                         dt), s
        matches["sp_first" if first else ("sp_last" if role == "last" else "sp_middle")] += 1
        padded = g.add("constant_pad_nd", "aten.constant_pad_nd.default", "other", [x],
                       [f"{tp}*{shard}", H], dt)
        return g.add("reduce_scatter", "_c10d_functional.reduce_scatter_tensor.default", "collective",
                     [padded], [shard, H], dt), shard

    def gather_mm(x: str, rows, n_out: int, weight: str) -> str:
        """mm on the full token dim; under SP the shard is all-gathered first (or fused with it)."""
        if sp and rows != s:
            if async_tp:
                matches["async_tp_ag_mm"] += 1
                fused = g.add("fused_all_gather_matmul", "symm_mem.fused_all_gather_matmul.default",
                              "fused", [x, weight], [f"{tp}*{shard}", n_out], dt)
                return g.add("slice", "aten.slice.Tensor", "other", [fused], [s, n_out], dt)
            ag = g.add("all_gather", "_c10d_functional.all_gather_into_tensor.default", "collective",
                       [x], [f"{tp}*{shard}", H], dt)
            x = g.add("slice", "aten.slice.Tensor", "other", [ag], [s, H], dt)
        return g.add("mm", "aten.mm.default", "matmul", [x, weight], [s, n_out], dt)

    def mm_reduce(x: str, weight: str, first: bool = False) -> tuple[str, object]:
        """Row-parallel mm followed by its all_reduce / reduce_scatter (fused under AsyncTP)."""
        if sp and async_tp:
            matches["sp_first" if first else ("sp_last" if role == "last" else "sp_middle")] += 1
            matches["async_tp_mm_rs"] += 1
            return g.add("fused_matmul_reduce_scatter", "symm_mem.fused_matmul_reduce_scatter.default",
                         "fused", [x, weight], [shard, H], dt), shard
        out = g.add("mm", "aten.mm.default", "matmul", [x, weight], [s, H], dt)
        return reduce(out, first)

    def add_residual(x: str, residual: str, rows) -> str:
        if shape.residual_inplace:
            return g.add("add_", "aten.add_.Tensor", "other", [residual, x], [rows, H], dt)
        return g.add("add", "aten.add.Tensor", "other", [x, residual], [rows, H], dt)

    outputs: list[str] = []
    if role == "first":
        ids = g.add("input_ids", "input_ids", "input", [], [s], "int64")
        w_emb = g.add("embed_weight", "embed_weight", "input", [], [shape.vocab_size // tp, H], dt)
        emb = g.add("embedding", "aten.embedding.default", "other", [w_emb, ids], [s, H], dt)
        residual, rows = reduce(emb, first=True)
        h = norm(residual, rows)
    else:
        res_rows = shard if residual_sharded_in else s
        attn = g.add("attn_out", "attn_out", "input", [], [s, shape.num_heads * shape.head_dim // tp], dt)
        residual = g.add("residual", "residual", "input", [], [res_rows, H], dt)
        w_o = g.add("o_proj_weight", "o_proj_weight", "input", [], [shape.num_heads * shape.head_dim // tp, H],
                    dt)
        x, rows = mm_reduce(attn, w_o)
        if sp and res_rows != rows:
            # gather-style boundaries hand over a full residual: take this rank's shard of it.
            residual = g.add("slice", "aten.slice.Tensor", "other", [residual], [rows, H], dt)
        residual = add_residual(x, residual, rows)
        h = norm(residual, rows)
        if role == "middle":
            w_gu = g.add("gate_up_weight", "gate_up_weight", "input", [], [H, 2 * shape.intermediate_size // tp],
                         dt)
            w_d = g.add("down_weight", "down_weight", "input", [], [shape.intermediate_size // tp, H], dt)
            gu = gather_mm(h, rows, 2 * shape.intermediate_size // tp, w_gu)
            act = g.add("silu_and_mul", "aten.mul.Tensor", "other", [gu], [s, shape.intermediate_size // tp], dt)
            x, rows = mm_reduce(act, w_d)
            residual = add_residual(x, residual, rows)
            h = norm(residual, rows)
    if role == "last":
        w_lm = g.add("lm_head_weight", "lm_head_weight", "input", [], [H, shape.vocab_size // tp], dt)
        logits = gather_mm(h, rows, shape.vocab_size // tp, w_lm)
        full = g.add("all_gather", "_c10d_functional.all_gather_into_tensor.default", "collective", [logits],
                     [f"{tp}*{s}", shape.vocab_size // tp], dt) if tp > 1 else logits
        outputs.append(full)
    else:
        w_qkv = g.add("qkv_weight", "qkv_weight", "input", [], [H, qkv_out], dt)
        qkv = gather_mm(h, rows, qkv_out, w_qkv)
        q = g.add("split", "aten.split_with_sizes.default", "other", [qkv],
                  [s, shape.num_heads * shape.head_dim // tp], dt)
        rope = g.add("rotary_embedding", "aten.mul.Tensor", "other", [q], [s, qkv_out], dt)
        outputs.append(rope)
        if sp and strategy in ("gather", "gather_erase") and rows != s:
            ag = g.add("all_gather", "_c10d_functional.all_gather_into_tensor.default", "collective",
                       [residual], [f"{tp}*{shard}", H], dt)
            residual = g.add("slice", "aten.slice.Tensor", "other", [ag], [s, H], dt)
            matches["boundary_gather"] += 1
        if shape.residual_inplace and role != "first" and strategy != "gather_erase":
            residual = g.add("copy_", "aten.copy_.default", "other", [residual], [s, H], dt)
        if shape.residual_inplace and role != "first" and strategy == "gather_erase" and sp:
            matches["boundary_erase"] += 1
        outputs.append(residual)
    g.add("output", "output", "output", outputs, [], dt)
    return {"graph": g.to_dict(), "matches": {k: matches.get(k, 0) for k in MATCH_KEYS}}


_TARGET_TO_COUNT_KEY = {
    "_c10d_functional.all_reduce.default": "all_reduce",
    "_c10d_functional.reduce_scatter_tensor.default": "reduce_scatter",
    "_c10d_functional.all_gather_into_tensor.default": "all_gather",
    "symm_mem.fused_all_gather_matmul.default": "fused_all_gather_matmul",
    "symm_mem.fused_matmul_reduce_scatter.default": "fused_matmul_reduce_scatter",
    "aten.mm.default": "mm",
}


def _op_counts(graph: dict) -> dict:
    counts = Counter(_TARGET_TO_COUNT_KEY.get(n["target"]) for n in graph["nodes"])
    return {k: counts.get(k, 0) for k in COUNT_KEYS}


def _fingerprint(kind: str, op: str | None, graph: dict) -> str:
    structure = [kind, op, [(n["target"], n["kind"], n["shape"]) for n in graph["nodes"]]]
    return hashlib.sha1(json.dumps(structure).encode()).hexdigest()


def _range(shape: SyntheticShape, tp: int, lo: int, hi: int, *, sp: bool, async_tp: bool,
           strategy: str) -> dict:
    """One compile range: 2L+1 pieces (L attention split ops), boundaries between neighbours."""
    dt_bytes = _DTYPE_BYTES[shape.dtype]
    H = shape.hidden_size
    shard = f"(s0 + {tp - 1})//{tp}" if tp > 1 else "s0"
    pieces, boundaries, erased, failures = [], [], [], []
    n_pieces = 2 * shape.num_layers + 1
    # The residual is sharded between pieces when the pass sharded it and nothing gathered it back.
    residual_sharded = sp and strategy in ("sharded", "none")
    for index in range(n_pieces):
        if index % 2:
            before = _attention_graph(shape, tp)
            after, matches = before, {k: 0 for k in MATCH_KEYS}
            kind, op, changed = "splitting_op", "sp_lab::attention", []
            compile_time, cache_hit = 0.0, None
        else:
            role = "first" if index == 0 else ("last" if index == n_pieces - 1 else "middle")
            before = _piece_graph(shape, tp, role, sp=False, async_tp=False, strategy=strategy)["graph"]
            built = _piece_graph(shape, tp, role, sp=sp, async_tp=async_tp, strategy=strategy)
            after, matches = built["graph"], built["matches"]
            before_names = {n["name"] for n in before["nodes"]}
            changed = [n["name"] for n in after["nodes"] if n["name"] not in before_names]
            kind, op = "compiled", None
            # Deterministic "timings": the first compile of each distinct piece pays, repeats hit the cache.
            cache_hit = role == "middle" and index > 2
            compile_time = 0.05 if cache_hit else round(0.4 + 0.1 * len(after["nodes"]) / 10, 3)
        pieces.append({
            "index": index, "name": f"submod_{index}", "kind": kind, "op": op,
            "compile_time_s": compile_time, "cache_hit": cache_hit, "matches": matches,
            "op_counts_before": _op_counts(before), "op_counts_after": _op_counts(after),
            "graph_before": before, "graph_after": after, "changed": changed,
            "fingerprint": _fingerprint(kind, op, after),
        })
        if index == n_pieces - 1:
            break
        tensors = []
        if index % 2 == 0:
            q_width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim // tp
            tensors.append({"name": "qkv", "dtype": shape.dtype, "shape_before": ["s0", q_width],
                            "shape_after": ["s0", q_width], "sharded_before": False, "sharded_after": False,
                            "bytes_per_token_after": float(q_width * dt_bytes)})
        else:
            width = shape.num_heads * shape.head_dim // tp
            tensors.append({"name": "attn_out", "dtype": shape.dtype, "shape_before": ["s0", width],
                            "shape_after": ["s0", width], "sharded_before": False, "sharded_after": False,
                            "bytes_per_token_after": float(width * dt_bytes)})
        tensors.append({
            "name": "residual", "dtype": shape.dtype, "shape_before": ["s0", H],
            "shape_after": [shard if residual_sharded else "s0", H],
            "sharded_before": False, "sharded_after": residual_sharded,
            "bytes_per_token_after": float(H * dt_bytes / (tp if residual_sharded else 1)),
        })
        boundaries.append({"index": index, "after_piece": index, "before_piece": index + 1, "tensors": tensors})

    compiled = True
    if sp and strategy == "none" and n_pieces > 2:
        check = "copy_epilogue" if shape.residual_inplace else "assert_size_stride"
        message = (f"RuntimeError: expand: attempting to expand a dimension of length {shard} -> s0!"
                   if shape.residual_inplace else
                   f"AssertionError: expected size s0=={shard} at dim=0")
        failures.append({"piece": 2, "tensor": "arg1_1", "check": check, "expected_shape": ["s0", H],
                         "actual_shape": [shard, H], "message": message})
        compiled = not shape.residual_inplace  # copy_ fails while compiling, the size assert at run time
    if sp and strategy == "gather_erase" and shape.residual_inplace:
        erased = [{"piece": p["index"], "target": "arg1_1", "dst_shape": ["s0", H], "src_shape": [shard, H]}
                  for p in pieces if p["kind"] == "compiled" and p["index"] > 0 and p["index"] < n_pieces - 1]
    return {
        "lo": lo, "hi": hi, "enable_sp": sp, "enable_async_tp": async_tp, "boundary": strategy,
        "compile_mode": "piecewise", "compiled": compiled,
        "compile_time_s": round(sum(p["compile_time_s"] for p in pieces), 3),
        "pieces": pieces, "boundaries": boundaries, "erased_copies": erased,
        "numerically_unsafe": bool(erased), "failures": failures,
    }


def _attention_graph(shape: SyntheticShape, tp: int) -> dict:
    """The splitting op's piece: attention over the local heads, run eagerly between pieces."""
    g = _Graph()
    q_width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim // tp
    qkv = g.add("qkv", "qkv", "input", [], ["s0", q_width], shape.dtype)
    a = g.add("attention", "sp_lab.attention.default", "split", [qkv],
              ["s0", shape.num_heads * shape.head_dim // tp], shape.dtype)
    g.add("output", "output", "output", [a], [], shape.dtype)
    return g.to_dict()


def make_report(shape: SyntheticShape = TOY, *, tp: int = 2, strategy: str = "sharded",
                num_layers: int | None = None, residual_inplace: bool | None = None,
                async_tp_min_tokens: int = 128, max_num_tokens: int = 16384, backend: str = "fake") -> dict:
    """A SYNTHETIC CompileReport dict (schema ``sp_lab.compile_report/1``).

    Two ranges: ``[1, async_tp_min_tokens - 1]`` with SP only and ``[async_tp_min_tokens,
    max_num_tokens]`` with SP + AsyncTP, both using boundary ``strategy``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}; expected one of {STRATEGIES}")
    overrides = {}
    if num_layers is not None:
        overrides["num_layers"] = num_layers
    if residual_inplace is not None:
        overrides["residual_inplace"] = residual_inplace
    shape = SyntheticShape(**{**shape.to_dict(), **overrides})
    ranges = [
        _range(shape, tp, 1, async_tp_min_tokens - 1, sp=True, async_tp=False, strategy=strategy),
        _range(shape, tp, async_tp_min_tokens, max_num_tokens, sp=True, async_tp=True, strategy=strategy),
    ]
    config = {"tp_size": tp, "enable_sp": True, "enable_async_tp": True,
              "async_tp_min_tokens": async_tp_min_tokens, "compile_mode": "piecewise",
              "splitting_ops": ["sp_lab::attention"], "boundary": strategy,
              "compile_range_split_points": [async_tp_min_tokens], "max_num_tokens": max_num_tokens}
    return {
        "schema": "sp_lab.compile_report/1",
        "model": shape.to_dict(),
        "requested": config,
        "effective": {"enable_sp": True, "enable_async_tp": True, "reasons": []},
        "provenance": {"torch": "2.13.0+cpu", "device": "cpu", "backend": backend, "tp_size": tp, "rank": 0,
                       "timestamp": "2025-01-01T00:00:00+00:00", "synthetic": True},
        "ranges": ranges,
        "failures": [{**f, "lo": r["lo"], "hi": r["hi"]} for r in ranges for f in r["failures"]],
    }


def llama_70b_tp8_report(strategy: str = "sharded") -> dict:
    """SYNTHETIC 80-layer Llama-3-70B-shaped report at tp 8 (161 pieces per range) for the benchmark."""
    return make_report(LLAMA_3_70B, tp=8, strategy=strategy)


def write_fixtures(directory: Path = DATA_DIR) -> list[Path]:
    """Write the toy and Llama-family fixtures for every strategy; returns the written paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for strategy in STRATEGIES:
        for stem, report in (
            (f"synthetic_toy_{strategy}", make_report(TOY, tp=2, strategy=strategy)),
            (f"synthetic_toy_inplace_{strategy}", make_report(TOY, tp=2, strategy=strategy,
                                                              residual_inplace=True)),
            (f"synthetic_llama_{strategy}", make_report(LLAMA_3_8B, tp=2, strategy=strategy, num_layers=4)),
        ):
            path = directory / f"{stem}.json"
            path.write_text(json.dumps(report, separators=(",", ":")) + "\n")  # compact: fixtures are read, not diffed
            written.append(path)
    return written


if __name__ == "__main__":
    for p in write_fixtures():
        print(p)
