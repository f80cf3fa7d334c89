"""Model-level SP thresholds: tokens per rank from which fusing a matmul with its collective pays.

For code that does SP itself instead of a compiler pass: vLLM from 0.32, where the SP compile pass is gone and
SP lives in model code (``vllm/models/common/ops/sequence_parallel.py``; what each release has there is in the
release table, :attr:`sp_lab.vllm_releases.VllmRelease.model_sp`: 0.32 has the all-gather / reduce-scatter
helpers only, 0.33 adds ``is_sequence_parallel_active(is_enabled, num_tokens)``, 0.34 gives it a ``min_tokens``
argument and fuses all-gather + matmul from a hard-coded 1024 rows per rank), SGLang, TensorRT-LLM or a model
author's own layers. Per matmul shape ``(K, N, dtype)`` at the tp measured:

- ``min_tokens_per_rank``: the shard rows (tokens / tp) from which the fused all-gather + matmul (``ag``) or
  matmul + reduce-scatter (``rs``) was faster than collective + matmul at every larger measured count, from
  per-matmul rows (:func:`sp_lab.tuning.microbench.measure_matmuls`); ``None`` where it never paid;
- else, where the tuned config carries a per-matmul rule (``LabConfig.heuristic``), the shard rows from which
  the rule says "fuse" (for the rows' dtype) at every larger power-of-two token count up to
  ``max_num_tokens``, and not below the config's AsyncTP gate (fusion only happens where AsyncTP runs);
- else the layer sweep's AsyncTP threshold (fused from ``async_tp_min_tokens = T`` tokens) per rank,
  ``ceil(T / tp)``, for every matmul of the model (``basis: "layer sweep"``); ``None`` where the config never
  fuses (SP off, or SP without AsyncTP);
- ``sp_min_tokens_per_rank``: from which SP pays per layer (the tuned config's SP threshold per rank).

:meth:`ModelSpTable.function_source` writes it as a dependency-free Python file to paste into model code:
``min_tokens_per_rank(k, n, dtype, tp)`` (shard rows, sp_lab's unit) and ``min_tokens(k, n, dtype, tp)`` (the whole
batch, the unit of vLLM's ``is_sequence_parallel_active(is_enabled, num_tokens, min_tokens)``, where ``num_tokens`` is
``positions.shape[0]``), ``SP_MIN_TOKENS_PER_RANK`` and ``SP_MIN_TOKENS`` likewise, with the provenance in the
docstring; :attr:`ModelSpTable.regret` says what using it costs on the rows it came from. ``k`` and ``n`` are the
matmul as one rank runs it: the in-features of the rank's weight shard and its out-features (``w.shape[1],
w.shape[0]`` of an ``nn.Linear`` weight on that rank); ``dtype`` is any spelling of the operands' type
(:func:`operand_dtype`: ``torch.float8_e4m3fn``, ``"fp8-rowwise"``, ``torch.bfloat16``, ``"bf16"``, ...).

Units: a gate of ``g`` shard rows is ``g * tp`` tokens of the whole batch (:func:`whole_batch`). Where tp does not
divide a tuned count, the whole-batch gate is the next multiple of tp: the shard rows are the same in between.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import polars as pl

from sp_lab.tuning.policy import fusion_threshold
from sp_lab.tuning.predict.kernels import dtype_bytes
from sp_lab.tuning.regret import regret_table, summarize

if TYPE_CHECKING:
    from sp_lab.config import LabConfig

__all__ = ["MatmulThreshold", "ModelSpTable", "crossover_per_rank", "lasting_crossover", "model_sp_table",
           "operand_dtype", "whole_batch"]

PER_MATMUL = "per-matmul rows"
RULE = "per-matmul rule"
LAYER_SWEEP = "layer sweep"


def operand_dtype(dtype):
    """The operands' element type under one name: ``"float8"`` (every FP8 spelling: ``torch.float8_e4m3fn``,
    ``float8_e5m2``, ``"fp8"``, ``"fp8-rowwise"``, ``"fp8-tensorwise"``; the scaling is not part of a tensor's
    dtype), ``"bfloat16"`` (``bf16``), ``"float16"`` (``fp16``, ``half``) or ``"float32"`` (``fp32``, ``float``).
    Anything else is a ``ValueError`` naming the value. Dependency-free: the exported file carries it as is."""
    key = str(dtype).lower().removeprefix("torch.")
    if key.startswith(("float8", "fp8")):
        return "float8"
    names = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
             "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
    if key not in names:
        raise ValueError(f"dtype {dtype!r}: not a matmul operand type of this table; use a torch dtype or one of "
                         f"{sorted(names)}, fp8, fp8-rowwise, float8_e4m3fn")
    return names[key]


def whole_batch(per_rank, tp):
    """Shard rows per rank -> tokens of the whole batch (vLLM's ``num_tokens``, ``positions.shape[0]``): each rank
    holds ``ceil(num_tokens / tp)`` rows, so ``per_rank`` rows start at ``per_rank * tp`` tokens (the measured point;
    ``None`` stays ``None``). Dependency-free: the exported file carries it as is."""
    return None if per_rank is None else per_rank * tp


@dataclasses.dataclass(frozen=True)
class MatmulThreshold:
    """One matmul shape's gate: fused from ``min_tokens_per_rank`` shard rows on (``None``: never pays)."""

    name: str
    """``qkv``, ``o_proj``, ``gate_up``, ``down`` (or the rows' name)."""
    side: str
    """``"ag"``: all-gather + matmul; ``"rs"``: matmul + reduce-scatter."""
    k: int
    n: int
    dtype: str
    tp: int
    min_tokens_per_rank: int | None
    basis: str
    """Where the gate comes from: :data:`PER_MATMUL` (per-matmul rows), :data:`RULE` (the config's per-matmul rule)
    or :data:`LAYER_SWEEP` (the layer sweep's AsyncTP threshold)."""


@dataclasses.dataclass(frozen=True)
class ModelSpTable:
    """Per-matmul fusion gates and the per-layer SP gate, with where they come from and what they cost."""

    matmuls: tuple[MatmulThreshold, ...]
    sp_min_tokens_per_rank: int | None
    """Tokens per rank from which SP (+ AsyncTP) pays per layer; ``None``: it never did on the rows."""
    provenance: dict[str, Any]
    """Device, torch, source, tp, model, dtype, the rows' hash, and per-matmul rows' device where used."""
    regret: dict[str, Any]
    """``layer``: the layer gate's regret on the sweep rows (the config's ranges, every matmul fused; ``worst``,
    ``total``); ``per_matmul``: the relative regret of the gates on the per-matmul rows against the faster choice
    per row (``None`` without such rows)."""

    @property
    def sp_min_tokens(self) -> int | None:
        """:attr:`sp_min_tokens_per_rank` in tokens of the whole batch (:func:`whole_batch`): vLLM's unit."""
        return whole_batch(self.sp_min_tokens_per_rank, self.provenance.get("tp") or 1)

    def _by_key(self) -> dict[tuple[int, int, str, int], tuple[int | None, str]]:
        """One gate per ``(k, n, operand dtype, tp)``: matmuls of one shape on both sides (qkv and down of a square
        layer) fuse only where both paid, so the larger gate (``None``: never) wins."""
        out: dict[tuple[int, int, str, int], tuple[int | None, str]] = {}
        for m in self.matmuls:
            key, name = (m.k, m.n, operand_dtype(m.dtype), m.tp), f"{m.name} ({m.side}), {m.basis}"
            if key in out:
                gate, names = out[key]
                both = None if gate is None or m.min_tokens_per_rank is None else max(gate, m.min_tokens_per_rank)
                out[key] = (both, f"{names}; {name}")
            else:
                out[key] = (m.min_tokens_per_rank, name)
        return out

    def lookup(self, k: int, n: int, dtype: Any, tp: int) -> int | None:
        """The table's answer for one shape in shard rows (what the generated ``min_tokens_per_rank`` returns)."""
        return self._by_key().get((k, n, operand_dtype(dtype), tp), (None, ""))[0]

    def to_dict(self) -> dict[str, Any]:
        return {"matmuls": [dataclasses.asdict(m) for m in self.matmuls],
                "sp_min_tokens_per_rank": self.sp_min_tokens_per_rank, "sp_min_tokens": self.sp_min_tokens,
                "regret": self.regret, "provenance": self.provenance}

    def function_source(self) -> str:
        """The model-level gates as a Python file with no imports, to paste into model code (module docstring)."""
        p = self.provenance
        entries = "\n".join(f"    {key!r}: {gate!r},  # {names}" for key, (gate, names) in self._by_key().items())
        per_matmul = self.regret.get("per_matmul")
        cost = "" if per_matmul is None else f" Regret on the per-matmul rows: {100 * per_matmul:.2f}%."
        layer = self.regret.get("layer") or {}
        helpers = "\n\n".join(inspect.getsource(f) for f in (operand_dtype, whole_batch))
        return f'''"""Model-level SP gates tuned by sp_lab: from how many tokens fusing a matmul with its collective pays.

From sp_lab's {p.get("source")} rows on {p.get("device")} (torch {p.get("torch")}, model {p.get("model")}, tp
{p.get("tp")}, {p.get("dtype")}, rows {p.get("data_hash")}). SP itself paid per layer from SP_MIN_TOKENS tokens of
the whole batch (SP_MIN_TOKENS_PER_RANK per rank; worst regret {100 * layer.get("worst", 0.0):.1f}%, total
{100 * layer.get("total", 0.0):.1f}% on the sweep rows).{cost}

Two units: per rank (shard rows, ceil(num_tokens / tp), what a fused kernel sees: x.shape[0] of the shard) and
whole batch (num_tokens, positions.shape[0]: what vLLM's is_sequence_parallel_active(is_enabled, num_tokens,
min_tokens) compares). min_tokens_per_rank and SP_MIN_TOKENS_PER_RANK are per rank; min_tokens and SP_MIN_TOKENS are
the whole batch (per rank * tp).

k, n: the matmul as one rank runs it: k the in-features of the rank's weight shard, n its out-features, i.e.
w.shape[1], w.shape[0] of the nn.Linear weight on that rank (qkv and gate_up: n is the per-rank share of the
column-parallel output; o_proj and down: k is the per-rank share of the row-parallel input). The unsharded
out-features are not in the table: None. dtype: the operands' type in any spelling (torch.bfloat16, "bf16",
torch.float8_e4m3fn, "fp8-rowwise", ...). None: it never paid where measured, or the shape, dtype or tp was not
measured (keep the collective and the matmul apart).
"""

SP_MIN_TOKENS_PER_RANK = {self.sp_min_tokens_per_rank!r}
SP_MIN_TOKENS = {self.sp_min_tokens!r}

_GATES_PER_RANK = {{  # (k, n, operand dtype, tp): shard rows from which the fused form pays (None: never)
{entries}
}}


{helpers}

def min_tokens_per_rank(k, n, dtype, tp):
    """Shard rows (tokens per rank) from which fusing this matmul with its all-gather / reduce-scatter pays."""
    return _GATES_PER_RANK.get((k, n, operand_dtype(dtype), tp))


def min_tokens(k, n, dtype, tp):
    """The same gate in tokens of the whole batch (num_tokens = positions.shape[0]), vLLM's min_tokens unit."""
    return whole_batch(min_tokens_per_rank(k, n, dtype, tp), tp)
'''


def lasting_crossover(points: Iterable[tuple[int, bool]]) -> int | None:
    """The smallest count of ``(count, wins)`` points from which ``wins`` holds at every larger count (``None``:
    it loses at the largest). A win below a later loss is noise, not a start. The one crossover scan: per-matmul
    gates here and the performance model's crossovers (:func:`sp_lab.tuning.predict.crossover.crossover_tokens`).
    Points of one count (two token counts giving the same shard rows, a repeated measurement) win together only if
    each wins: a loss there is not outweighed by a win, whatever the points' order."""
    wins_at: dict[int, bool] = {}
    for count, wins in points:
        wins_at[count] = wins_at.get(count, True) and bool(wins)
    start = None
    for count in sorted(wins_at):
        start = (count if start is None else start) if wins_at[count] else None
    return start


def crossover_per_rank(rows: pl.DataFrame) -> int | None:
    """Shard rows from which the fused form was faster at every larger measured count (one shape's rows).

    ``rows``: ``m`` (tokens), ``tp``, ``fused_us``, ``unfused_us`` (``m_padded`` when present). ``None`` when the
    fused form lost at the largest count measured.
    """
    rows = rows.filter(pl.col("fused_us").is_not_null() & pl.col("unfused_us").is_not_null())
    m_col = "m_padded" if "m_padded" in rows.columns else "m"
    wins = rows.select((pl.col(m_col) / pl.col("tp")).ceil().cast(pl.Int64), pl.col("fused_us") < pl.col("unfused_us"))
    return lasting_crossover(wins.iter_rows())


def _per_matmul(matmul_rows: pl.DataFrame) -> tuple[list[MatmulThreshold], float]:
    keys = ("name", "side", "k", "n", "dtype", "tp")
    gates, chosen, oracle = [], 0.0, 0.0
    for key, group in matmul_rows.group_by(keys, maintain_order=True):
        gate = crossover_per_rank(group)
        gates.append(MatmulThreshold(*key, min_tokens_per_rank=gate, basis=PER_MATMUL))
        m_col = "m_padded" if "m_padded" in group.columns else "m"
        for m, tp, fused, unfused in group.select(m_col, "tp", "fused_us", "unfused_us").iter_rows():
            if fused is None or unfused is None:
                continue
            use_fused = gate is not None and math.ceil(m / tp) >= gate
            chosen += fused if use_fused else unfused
            oracle += min(fused, unfused)
    return gates, (chosen - oracle) / oracle if oracle else 0.0


def _rule_gate(config: LabConfig, shape: Any, tp: int, fuse_per_rank: int, width: int) -> int | None:
    """Shard rows from which ``config.heuristic`` fuses ``shape`` (``width``-byte operands) at every larger
    power-of-two token count, not below ``fuse_per_rank`` (where AsyncTP starts)."""
    counts = [2**i for i in range(config.max_num_tokens.bit_length()) if 2**i <= config.max_num_tokens]
    fuses = []
    for m in counts:
        choice = config.heuristic.decide(m, shape.n, shape.k, tp, dtype_bytes=width)
        fuses.append((math.ceil(m / tp), (config.heuristic_default if choice == "unsure" else choice) == "fuse"))
    start = lasting_crossover(fuses)
    return None if start is None else max(start, fuse_per_rank)


def _model_shapes(model: str, tp: int) -> list[Any]:
    """The four fusable matmul shapes of ``model`` (a preset, ``toy`` or a checkpoint) at ``tp``, or [] if unknown."""
    from sp_lab.models.registry import resolve_config
    from sp_lab.tuning.microbench import tp_matmul_shapes

    try:
        return tp_matmul_shapes(resolve_config(model), tp)
    except (ValueError, OSError, TypeError, KeyError):
        return []


def model_sp_table(rows: pl.DataFrame, config: LabConfig, *, matmul_rows: pl.DataFrame | None = None,
                   data_hash: str | None = None) -> ModelSpTable:
    """The model-level table for the setup of sweep ``rows`` tuned to ``config``.

    ``rows``: sweep rows of one setup (the tuned config's regret is computed on them); ``matmul_rows``: per-matmul
    rows (``measure_matmuls``) for per-shape gates; without them every matmul of the model gets the layer's gate.
    """
    if rows.height == 0:
        raise ValueError("no sweep rows: run a sweep first (python -m sp_lab run)")
    row = rows.row(0, named=True)
    tp = int(row["tp"])
    sp_per_rank = math.ceil(config.sp_start / tp) if config.enable_sp and tp > 1 else None
    # a matmul fuses only where AsyncTP runs: from async_tp_min_tokens (which may lie above where SP starts)
    fuse_per_rank = fusion_threshold(config) if tp > 1 else None
    fuse_per_rank = None if fuse_per_rank is None else math.ceil(fuse_per_rank / tp)
    # the layer gate's regret: the config's ranges with every matmul fused (a per-matmul rule's own program is
    # timed only by rows of the tuned config, which a layer sweep may not have)
    total, worst = summarize(regret_table(rows, dataclasses.replace(config, heuristic=None), warn=False))
    regret: dict[str, Any] = {"layer": {"worst": worst, "total": total}, "per_matmul": None}
    prov: dict[str, Any] = {"device": row.get("device_name"), "torch": row.get("torch_version"),
                            "source": row.get("source"), "backend": row.get("backend"), "model": row.get("model"),
                            "tp": tp, "dtype": row.get("dtype"), "data_hash": data_hash}
    if matmul_rows is not None and matmul_rows.height:
        gates, per_matmul = _per_matmul(matmul_rows)
        regret["per_matmul"] = per_matmul
        first = matmul_rows.row(0, named=True)
        prov["matmul_rows"] = {"device": first.get("device"), "torch": first.get("torch"),
                               "source": first.get("source"), "rows": matmul_rows.height}
    else:
        dtype, shapes = str(row.get("dtype")), _model_shapes(str(row["model"]), tp)
        if config.heuristic is not None and fuse_per_rank is not None:
            width = dtype_bytes(row.get("dtype"))  # an FP8 matmul is judged as FP8, not as its bf16 twin
            gates = [MatmulThreshold(s.name, s.side, s.k, s.n, dtype, tp,
                                     _rule_gate(config, s, tp, fuse_per_rank, width), RULE) for s in shapes]
        else:
            gates = [MatmulThreshold(s.name, s.side, s.k, s.n, dtype, tp, fuse_per_rank, LAYER_SWEEP) for s in shapes]
    return ModelSpTable(tuple(gates), sp_per_rank, prov, regret)
