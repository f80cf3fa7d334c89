"""The piecewise backend: ``sp_lab.compile(model, config)``.

Pipeline, per token range (one artifact each, compiled on first use and dispatched by ``num_tokens``):

    Dynamo graph (token count symbolic) ──┬─ compile_mode="full_graph": Inductor on the whole graph, SP +
                                          │  AsyncTP as its post-grad pass
                                          ├─ boundary in {none, gather_erase, gather}: split at attention,
                                          │  each piece through Inductor with SP + AsyncTP inside the piece
                                          │  (vLLM's design) and the boundary policy at its edges
                                          └─ boundary="sharded": AOT-trace the whole graph to aten, apply SP
                                             to all of it, *then* split: the residual crosses boundaries as a
                                             token shard and each piece is compiled for the shapes it really
                                             receives; AsyncTP runs inside each piece
Splitting ops run eagerly between pieces. Pieces with the same structural fingerprint (every decoder layer)
share one compiled artifact, so an 80-layer model costs a handful of compiles per range; Inductor's own
FX-graph cache is turned off for pieces because a cache hit would skip the passes whose record the report
is made of (the C++/Triton code caches stay on).
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import inspect
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch._dynamo.source import ConstantSource, LocalSource
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._guards import detect_fake_mode
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import sp_lab.compiler.fused_ops  # noqa: F401  (registers the CPU fused ops)
from sp_lab.compiler.cudagraphs import CudaGraphPiece, CudaGraphPlan, FullCudaGraphs, StaticTokens
from sp_lab.compiler.passes.boundary import policy_for
from sp_lab.compiler.passes.graph_builder import same_size
from sp_lab.compiler.passes.post_grad import PieceObservation, SpLabPostGradPass
from sp_lab.compiler.passes.sequence_parallel import apply_sequence_parallel
from sp_lab.compiler.ranges import CompileRange, plan_ranges
from sp_lab.compiler.report import (
    BoundaryFailure,
    CompileReport,
    PieceRecord,
    RangeReport,
    shape_json,
    structural_fingerprint,
)
from sp_lab.compiler.split import SplitGraph, split_at
from sp_lab.config import EffectiveConfig, LabConfig, enable_sp_and_async_tp

log = logging.getLogger(__name__)

_RECOMPILE_LIMIT = 64

__all__ = ["BoundaryError", "CompiledModel", "compile"]


class BoundaryError(RuntimeError):
    """SP broke a piece boundary (strategy ``none``); the report's ``failures`` holds the details."""


def compile(
    model: torch.nn.Module, config: LabConfig, *, inspect_only: bool | None = None
) -> CompiledModel:
    """Compile ``model`` piecewise with SP + AsyncTP as ``config`` asks; call on every rank.

    ``model``: any module whose first forward argument has the token count as dim 0 (sp_lab's models, or
    plain PyTorch written with functional collectives). Nothing is compiled until the first call.

    ``inspect_only`` (default: True when the model's parameters are on the meta device): capture, split and
    run every pass exactly as a real compile does and fill the CompileReport, but skip Inductor's code
    generation; calls then run the captured graph as it is (on meta tensors: shapes only). This is how an
    80-layer 70B-shaped model at tp 8 is inspected on a laptop under ``fake_process_group(8)``.
    """
    if not isinstance(config, LabConfig):
        raise TypeError(f"config: expected sp_lab.LabConfig, got {type(config).__name__}")
    if inspect_only is None:
        inspect_only = any(p.is_meta for p in model.parameters())
    return CompiledModel(model, config, inspect_only=inspect_only)


class CompiledModel:
    """Callable like the model; each call is served by the artifact of the range holding its token count."""

    def __init__(self, model: torch.nn.Module, config: LabConfig, *, inspect_only: bool = False):
        self.model = model
        self.config = config
        self.inspect_only = inspect_only
        self.effective: EffectiveConfig = enable_sp_and_async_tp(config)
        self.at_capture_size = False  # whether the call in flight replays per-piece CUDA graphs
        for reason in self.effective.reasons:
            log.info("sp_lab.compile: %s", reason)
        self.ranges = plan_ranges(config, self.effective)
        self._graphs = CudaGraphPlan.build(
            self.effective.cudagraph_mode,
            config.resolved_capture_sizes(),
            sp_on=lambda size: next(r.enable_sp for r in self.ranges if size in r),
        )
        self.report = CompileReport(
            requested=config.to_dict(),
            effective=self.effective.to_dict(),
            provenance=_provenance(self.effective),
            model=model.spec.to_dict() if hasattr(model, "spec") else {"name": type(model).__name__},
            ranges=[
                RangeReport(r.lo, r.hi, r.enable_sp, r.enable_async_tp, config.boundary, config.compile_mode)
                for r in self.ranges
            ],
        )
        self._token_arg = next(iter(inspect.signature(model.forward).parameters))
        # Every sp_lab.compile of a model adds cache entries (1 token, and symbolic) to the same forward code
        # object; a sweep compiles 4 variants of one model. Dynamo's default limit (8) would end such a sweep
        # with FailOnRecompileLimitHit, so allow more (fullgraph=True still fails loudly past it, never eager).
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _RECOMPILE_LIMIT)
        self._dynamo = torch.compile(model, backend=self._backend, fullgraph=True, dynamic=False)
        self._full_graphs = FullCudaGraphs(self._forward)
        self._static_tokens = StaticTokens()

    def __call__(self, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        num_tokens = tokens.shape[0]
        self.config.range_for(num_tokens)  # rejects counts outside [1, max_num_tokens] by name
        padded = self._graphs.padded(num_tokens)
        kind = self._graphs.kind(padded)
        self.at_capture_size = kind == "piecewise"
        if kind == "piecewise":
            # The first piece's graph keeps the tensor it was captured with as its input and copies later
            # tokens into it: that must be sp_lab's buffer, never the caller's (it would be overwritten).
            tokens = self._static_tokens.stage(tokens, padded)
        elif padded != num_tokens:
            # Pad to the captured size as vLLM does; causal attention keeps the first rows exact.
            tokens = torch.cat([tokens, tokens.new_zeros((padded - num_tokens, *tokens.shape[1:]))])
        with torch.no_grad():
            if kind == "full" and not args and not kwargs:  # a whole-forward graph holds the tokens only
                out = self._full_graphs(tokens)
            else:
                out = self._forward(tokens, *args, **kwargs)
        if kind != "none":
            out = out[:num_tokens].clone()  # the graph's output buffer is reused by the next replay
        return out

    def _forward(self, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tokens.shape[0] > 1:
            # Symbolic within the range; 1 is specialised by Dynamo (and compiles apart) anyway.
            torch._dynamo.maybe_mark_dynamic(tokens, 0)
        return self._dynamo(tokens, *args, **kwargs)

    # -- Dynamo backend -------------------------------------------------------------------------------------------
    def _backend(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        token_index = _token_input_index(gm, self._token_arg)
        fake_mode = detect_fake_mode(example_inputs)
        # Dynamo hands over real tensors; the symbolic shapes live in the placeholders' fake values.
        example_inputs = [
            n.meta.get("example_value", x)
            for n, x in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs)
        ]
        artifacts: dict[int, Callable] = {}

        def dispatch(*args: Any) -> Any:
            num_tokens = args[token_index].shape[0]
            index = next(i for i, r in enumerate(self.ranges) if num_tokens in r)
            if index not in artifacts:
                compiler = _RangeCompiler(self, index, gm, example_inputs, fake_mode, token_index)
                artifacts[index] = compiler.compile()
            return artifacts[index](*args)

        return dispatch


def _range_inputs(
    example_inputs: list[Any], token_index: int, rng: CompileRange, fake_mode, *, inspect_only: bool = False
) -> tuple[list, Any]:
    """Fresh fake inputs for one range: the token count is a new symbol bounded to ``[lo, hi]``.

    Dynamo's inputs carry the hint of whichever call captured the graph. If that was 2 tokens at tp 2, the
    token shard has size 1 and Inductor specialises it (size-1 dims broadcast), baking "2 tokens" into an
    artifact that must serve the whole range -- and guards Inductor adds after Dynamo has finished are never
    checked. Tracing each range with its own bounded symbol and a hint inside the range avoids both.
    """
    token = example_inputs[token_index]
    old_size = token.shape[0]

    def device(x: torch.Tensor) -> torch.device:
        # A meta-device model is traced as if on the CPU (fake tensors allocate nothing either way): Inductor's
        # pattern matcher skips nodes whose values live on the meta device, and the report must show the fusions.
        return torch.device("cpu") if inspect_only and x.device.type == "meta" else x.device

    if isinstance(old_size, int):  # Dynamo specialised this graph (1 token): nothing symbolic to re-hint
        return example_inputs, fake_mode
    # The symbol's bounds only inform Inductor; widening the top keeps tiny ranges (e.g. [2, tp + 1]) from
    # being specialised to one size, and lets the hint sit where no shard size is degenerate.
    lo = max(rng.lo, 2)
    hi = max(rng.hi, lo + 64)
    hint = max(lo, 61)  # odd and > any tp
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    new_token = mode.from_tensor(
        torch.empty((hint, *token.shape[1:]), dtype=token.dtype, device="meta"),
        symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (token.dim() - 1)
        ),
        source=ConstantSource("sp_lab_num_tokens"),
    )
    symbol = new_token.shape[0]
    mode.shape_env.constrain_symbol_range(symbol.node.expr, compiler_min=lo, compiler_max=hi)
    inputs = []
    for i, x in enumerate(example_inputs):
        if i == token_index:
            with mode:
                inputs.append(torch.empty(new_token.shape, dtype=token.dtype, device=device(token)))
        elif isinstance(x, torch.SymInt):
            inputs.append(symbol if same_size(x, old_size) else int(x.node.hint))
        elif isinstance(x, torch.Tensor):
            if any(not isinstance(d, int) for d in x.shape):
                raise NotImplementedError(
                    f"graph input {i} has a symbolic shape {tuple(x.shape)} besides the token input; sp_lab "
                    "compiles one symbolic token dimension per range"
                )
            with mode:
                inputs.append(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device(x)))
        else:
            inputs.append(x)
    return inputs, mode


def _token_input_index(gm: fx.GraphModule, arg_name: str) -> int:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        source = getattr(node.meta.get("grapharg"), "source", None)
        if isinstance(source, LocalSource) and source.local_name == arg_name:
            return i
    raise RuntimeError(f"could not find the forward argument {arg_name!r} among the captured graph's inputs")


def _provenance(effective: EffectiveConfig) -> dict[str, Any]:
    device = effective.device
    if device.startswith("cuda"):
        device = torch.cuda.get_device_name(torch.device(device))
    return {
        "torch": torch.__version__,
        "device": device,
        "backend": effective.backend,
        "tp_size": effective.tp_size,
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


@dataclass
class _CompiledPiece:
    fn: Callable
    record: PieceRecord


class _RangeCompiler:
    """Compiles the artifact of one token range and fills its RangeReport."""

    def __init__(self, owner: CompiledModel, index: int, gm: fx.GraphModule, example_inputs, fake_mode, token_index):
        self.config, self.effective = owner.config, owner.effective
        self.range: CompileRange = owner.ranges[index]
        self.report: RangeReport = owner.report.ranges[index]
        self.gm, self.token_index = gm, token_index
        self.inspect_only = owner.inspect_only
        self.at_capture_size = lambda: owner.at_capture_size
        if self.inspect_only:
            self.gm_to_run, self.gm = gm, _meta_devices_to_cpu(gm)
        self.example_inputs, self.fake_mode = _range_inputs(
            example_inputs, token_index, self.range, fake_mode, inspect_only=owner.inspect_only
        )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group_name = dist.group.WORLD.group_name if dist.is_initialized() else None
        self.splitting_ops = frozenset(self.config.splitting_ops)
        self._dedup: dict[str, _CompiledPiece] = {}
        self._aten_pieces = False

    def compile(self) -> Callable:
        start = time.perf_counter()
        if self.config.compile_mode == "full_graph":
            fn = self._compile_full_graph()
        elif self.config.boundary == "sharded" and self.range.enable_sp:
            fn = self._compile_sharded()
        else:
            fn = self._compile_piecewise(self.gm, self.example_inputs, in_piece_sp=self.range.enable_sp)
        self.report.compile_time_s = time.perf_counter() - start
        self.report.compiled = True
        if self.effective.fused_op_impl == "symm_mem" and not self.inspect_only:
            self._reserve_symm_mem_workspace()
        if self.inspect_only:
            return self.gm_to_run  # the report is complete; calls run the captured graph as it is
        return fn

    def _reserve_symm_mem_workspace(self) -> None:
        """Size the symmetric-memory workspace for the largest fused matmul of the range, up front.

        The fused kernels grow the workspace on demand by re-allocating it; a CUDA graph captured before that
        would keep pointing at the freed buffer. Reserving for ``hi`` tokens before any capture avoids it.
        """
        from torch.distributed._symmetric_memory import get_symm_mem_workspace

        rows = self.range.hi + self.effective.tp_size  # padded to a multiple of tp
        widths = [
            d["k"] if d["pattern"] == "all_gather_matmul" else d["n"]
            for piece in self.report.pieces
            for d in piece.async_tp_decisions
            if d["decision"] == "fuse" and d["k"] is not None
        ]
        if widths:
            get_symm_mem_workspace(self.group_name, min_size=rows * max(widths) * 4)  # 4 bytes: fp32 worst case

    # -- the post-grad pass for one piece ---------------------------------------------------------------------------
    def _pass(self, *, sp: bool, policy: str) -> SpLabPostGradPass:
        return SpLabPostGradPass(
            tp_size=self.effective.tp_size,
            rank=self.rank,
            group_name=self.group_name,
            enable_sp=sp,
            enable_async_tp=self.range.enable_async_tp,
            boundary=policy,
            m_low=self.range.lo,
            use_symm_mem=self.effective.fused_op_impl == "symm_mem",
            rule=self.config.heuristic,
            heuristic_default=self.config.heuristic_default,
            splitting_ops=self.splitting_ops,
        )

    def _inductor(self, gm: fx.GraphModule, inputs: list[Any], sp_pass: SpLabPostGradPass) -> tuple[Callable, bool]:
        """Compile with Inductor (FX-graph cache on); returns the artifact and whether the cache served it.

        On a cache hit our post-grad pass does not run, so what it observed the first time (the report's
        source) is kept beside Inductor's cache under the same identity: the pass's ``uuid()`` (every setting)
        plus the piece's structural fingerprint (graph and input shapes). Without that record the piece is
        compiled again with the cache off, so a report is never made up.
        """
        if self.inspect_only:
            return _run_passes_only(gm, inputs, sp_pass), False
        record = _observation_path(sp_pass.uuid(), structural_fingerprint(gm, inputs))
        compile_one = _compile_aten_piece if self._aten_pieces else compile_fx
        with torch._inductor.config.patch({"post_grad_custom_post_pass": sp_pass, "fx_graph_cache": True}):
            fn = compile_one(gm, inputs)
        if sp_pass.observation.ran:
            sp_pass.observation.save(record)
            return fn, False
        if sp_pass.observation.load(record):
            return fn, True
        with torch._inductor.config.patch({"post_grad_custom_post_pass": sp_pass, "fx_graph_cache": False}):
            fn = compile_one(gm, inputs)
        sp_pass.observation.save(record)
        return fn, False

    # -- modes -----------------------------------------------------------------------------------------------------
    def _compile_full_graph(self) -> Callable:
        sp_pass = self._pass(sp=self.range.enable_sp, policy="whole_graph")
        start = time.perf_counter()
        fn, inductor_hit = self._inductor(self.gm, self.example_inputs, sp_pass)
        record = self._record(0, "graph", self.gm, self.example_inputs, sp_pass.observation, start)
        record.inductor_cache_hit = inductor_hit
        self.report.pieces = [record]
        return fn

    def _compile_sharded(self) -> Callable:
        """SP on the whole AOT (aten) graph, then split: boundaries carry token shards."""

        def forward_compiler(aten_gm: fx.GraphModule, aten_inputs: list[Any]) -> Callable:
            sp = apply_sequence_parallel(
                aten_gm.graph,
                tp_size=self.effective.tp_size,
                rank=self.rank,
                group_name=self.group_name,
                policy=policy_for("whole_graph"),
            )
            aten_gm.recompile()
            self._whole_graph_sp = sp
            self._aten_pieces = True  # already functional aten: Inductor's inner compile, no second AOT trace
            runner = self._compile_piecewise(aten_gm, aten_inputs, in_piece_sp=False)
            return make_boxed_func(runner)

        self._whole_graph_sp = None
        # AOT must trace in Dynamo's fake mode (its ShapeEnv owns the token-count symbol).
        with torch._guards.tracing(torch._guards.TracingContext(self.fake_mode)):
            compiled = aot_module_simplified(
                self.gm,
                self.example_inputs,
                fw_compiler=forward_compiler,
                decompositions=select_decomp_table(),
                keep_inference_input_mutations=True,
            )
        sp = self._whole_graph_sp
        if sp is not None:
            # Whole-graph SP rewrites are attributed to the range as a whole, on the first piece.
            first = next(p for p in self.report.pieces if p.kind == "compiled")
            for form in ("first", "middle", "last"):
                first.matches[f"sp_{form}"] = first.matches.get(f"sp_{form}", 0) + sp.count(form)
        return compiled

    def _compile_piecewise(self, gm: fx.GraphModule, inputs: list[Any], *, in_piece_sp: bool) -> Callable:
        split = split_at(gm, self.config.splitting_ops)
        policy = self.config.boundary if in_piece_sp else "whole_graph"
        compiled, values, tokens = self._compile_pieces(split, inputs, sp=in_piece_sp, policy=policy)
        self._record_boundaries(split, values, tokens)
        failures = self.report.failures

        def run(*args: Any) -> Any:
            return split.module(*args)

        for piece in split.compiled_pieces:
            fn = compiled[piece.name]
            if self.effective.cudagraphs:
                fn = CudaGraphPiece(fn, self.at_capture_size)
            split.module.__dict__[piece.name] = _guarded(fn, piece.index, self.report, failures)
        return run

    def _compile_pieces(self, split: SplitGraph, inputs: list[Any], *, sp: bool, policy: str):
        """Walk the split graph over fake inputs, compiling every non-splitting piece with its real fake args.

        Returns the compiled pieces by name, the fake value of every node of the split graph, and the token
        count (an int or SymInt).
        """
        compiled: dict[str, Callable] = {}
        values: dict[fx.Node, Any] = {}
        records: list[PieceRecord] = []
        outer = self

        class PieceCompiler(fx.Interpreter):
            def run_node(self, n):
                values[n] = super().run_node(n)
                return values[n]

            def call_module(self, target, args, kwargs):
                submod = self.fetch_attr(target)
                piece = next(p for p in split.pieces if p.name == target)
                if piece.splitting_op is not None:
                    records.append(PieceRecord(piece.index, target, "splitting_op", op=piece.splitting_op))
                    return submod(*args, **kwargs)
                # Run the piece before compiling it: Inductor rewrites a piece that returns one value to return a
                # list, in place, so the submodule would hand the next op a list afterwards.
                out = submod(*args, **kwargs)
                fn, record = outer._compile_piece(submod, list(args), piece.index, target, sp=sp, policy=policy)
                compiled[target] = fn
                records.append(record)
                return out

        fake_mode = detect_fake_mode(inputs) or self.fake_mode
        fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(
            x, torch._subclasses.FakeTensor) else x for x in inputs]
        with fake_mode:
            PieceCompiler(split.module).run(*fake_inputs)
        self.report.pieces = records
        token_node = [n for n in split.module.graph.nodes if n.op == "placeholder"][self.token_index]
        return compiled, values, values[token_node].shape[0]

    def _compile_piece(self, submod, args, index, name, *, sp: bool, policy: str):
        fingerprint = structural_fingerprint(submod, args)
        if fingerprint in self._dedup:
            hit = self._dedup[fingerprint]
            record = PieceRecord(**{**hit.record.__dict__, "index": index, "name": name, "cache_hit": True,
                                    "compile_time_s": 0.0})
            return hit.fn, record
        sp_pass = self._pass(sp=sp, policy=policy)
        start = time.perf_counter()
        try:
            fn, inductor_hit = self._inductor(submod, args, sp_pass)
        except Exception as e:
            failure = _copy_epilogue_failure(e, index, sp_pass.observation)
            if failure is None:
                raise
            failure.lo, failure.hi = self.range.lo, self.range.hi
            self.report.failures.append(failure)
            raise BoundaryError(_explain(failure, self.range, self.config.boundary)) from e
        record = self._record(index, name, submod, args, sp_pass.observation, start)
        record.fingerprint = fingerprint
        record.cache_hit = False
        record.inductor_cache_hit = inductor_hit
        self._dedup[fingerprint] = _CompiledPiece(fn, record)
        return fn, record

    def _record(self, index, name, gm, inputs, obs: PieceObservation, start: float) -> PieceRecord:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        boundary = obs.boundary
        return PieceRecord(
            index=index,
            name=name,
            kind="compiled",
            compile_time_s=time.perf_counter() - start,
            matches=dict(obs.matches),
            op_counts_before=obs.counts_before,
            op_counts_after=obs.counts_after,
            graph_before=obs.graph_before,
            graph_after=obs.graph_after,
            changed=obs.changed,
            inputs=[
                {"name": p.name, "shape": shape_json(x), "dtype": str(getattr(x, "dtype", "")).removeprefix("torch.")}
                for p, x in zip(placeholders, inputs)
            ],
            outputs=obs.outputs,
            async_tp_decisions=obs.decisions,
            erased_copies=list(boundary.erased_copies) if boundary is not None else [],
        )

    def _record_boundaries(self, split: SplitGraph, values: dict[fx.Node, Any], tokens: Any) -> None:
        """For each splitting op: the tensors produced before it and used at or after it, with their shapes.

        ``shape_before`` is what the tensor would be without SP (what the next piece expects in the in-piece
        strategies); ``shape`` is what really crosses after the passes; ``sharded`` marks a token shard.
        """
        index_of = {n: next(p.index for p in split.pieces if p.name == n.target)
                    for n in split.module.graph.nodes if n.op == "call_module"}
        records = {p.index: p for p in self.report.pieces}

        def producer(node: fx.Node) -> tuple[fx.Node, int] | None:
            if node.op == "call_module":
                return node, 0
            if node.op == "call_function" and node.args and node.args[0] in index_of:
                return node.args[0], node.args[1]
            return None

        boundaries = []
        for piece in split.pieces:
            if piece.splitting_op is None:
                continue
            crossing = []
            for node in split.module.graph.nodes:
                made = producer(node)
                val = values.get(node)
                if made is None or index_of[made[0]] >= piece.index or not isinstance(val, torch.Tensor):
                    continue
                if not any(index_of.get(u, -1) >= piece.index for u in node.users):
                    continue
                source, out_index = made
                outputs = records[index_of[source]].outputs if index_of[source] in records else []
                after = next((o["shape"] for o in outputs if o["index"] == out_index), None) or shape_json(val)
                before = next((o["shape_before"] for o in outputs if o["index"] == out_index), None) or shape_json(val)
                sharded = after is not None and str(after[0]) != str(shape_json(val)[0]) or not same_size(
                    val.shape[0], tokens)
                crossing.append({
                    "name": node.name,
                    "dtype": str(val.dtype).removeprefix("torch."),
                    "shape_before": before if not sharded or before != after else _full_rows(after, tokens),
                    "shape_after": after,
                    "sharded_before": False,
                    "sharded_after": bool(sharded),
                    "bytes_per_token_after": _bytes_per_token(val, sharded, self.effective.tp_size),
                })
            boundaries.append({"index": len(boundaries), "splitting_op": piece.splitting_op,
                               "after_piece": piece.index - 1, "before_piece": piece.index + 1,
                               "tensors": crossing})
        self.report.boundaries = boundaries


def _full_rows(shape: list, tokens: Any) -> list:
    return [tokens if isinstance(tokens, int) else str(tokens), *shape[1:]]


def _bytes_per_token(val: torch.Tensor, sharded: bool, tp: int) -> float:
    row = val[0].numel() * val.element_size() if val.dim() else val.element_size()
    return float(row) / (tp if sharded else 1)


def _guarded(fn: Callable, index: int, report: RangeReport, failures: list) -> Callable:
    """Run a compiled piece; turn Inductor's input-guard failure into a structured BoundaryError."""

    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except AssertionError as e:
            if "expected size" not in str(e):
                raise
            record = next(p for p in report.pieces if p.index == index)
            failure = _input_guard_failure(e, record, args)
            failure.lo, failure.hi = report.lo, report.hi
            failures.append(failure)
            raise BoundaryError(_explain(failure, None, report.boundary)) from e

    return run


def _compile_aten_piece(gm: fx.GraphModule, inputs: list[Any]) -> Callable:
    """Inductor's inner compile for a piece that is already a functional aten graph (the sharded path)."""
    single = _with_tuple_output(gm)
    # A tracing context of its own: the enclosing one belongs to the whole graph's AOT trace.
    with torch._guards.tracing(torch._guards.TracingContext(detect_fake_mode(inputs))):
        compiled = compile_fx_inner(single if single is not None else gm, inputs, is_inference=True)

    def run(*args: Any) -> Any:
        out = compiled(list(args))
        return out[0] if single is not None else out

    return run


def _with_tuple_output(gm: fx.GraphModule) -> fx.GraphModule | None:
    """A copy of ``gm`` returning ``(x,)`` where it returned ``x``; None when it already returns a tuple."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return None
    graph = copy.deepcopy(gm.graph)
    tuple_output = next(n for n in reversed(graph.nodes) if n.op == "output")
    tuple_output.args = ((tuple_output.args[0],),)
    return fx.GraphModule(gm, graph)


def _meta_devices_to_cpu(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose device constants say "cpu" where they said "meta" (see ``_range_inputs``)."""
    graph = copy.deepcopy(gm.graph)
    meta = torch.device("meta")

    def to_cpu(value: Any) -> Any:
        return torch.device("cpu") if isinstance(value, torch.device) and value == meta else value

    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, to_cpu)
        node.kwargs = fx.node.map_aggregate(node.kwargs, to_cpu)
    return fx.GraphModule(gm, graph)


def _run_passes_only(gm: fx.GraphModule, inputs: list[Any], sp_pass: SpLabPostGradPass) -> Callable:
    """AOT-trace ``gm`` to the functional aten graph Inductor would receive and run our pass on it, no codegen."""

    def forward_compiler(aten_gm: fx.GraphModule, aten_inputs: list[Any]) -> Callable:
        sp_pass(aten_gm.graph)
        aten_gm.recompile()
        return make_boxed_func(aten_gm)

    gm = _with_tuple_output(gm) or gm  # AOT wants tuple outputs; nothing runs the result
    fake_mode = detect_fake_mode(inputs)
    with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        return aot_module_simplified(
            gm, inputs, fw_compiler=forward_compiler, decompositions=select_decomp_table(),
            keep_inference_input_mutations=True,
        )


def _observation_path(pass_uuid: str, fingerprint: str) -> Path:
    key = hashlib.sha256(f"{pass_uuid}:{fingerprint}".encode()).hexdigest()[:32]
    return Path(cache_dir()) / "sp_lab_observations" / f"{key}.json"


def _input_guard_failure(error: AssertionError, record: PieceRecord, args) -> BoundaryFailure:
    """Name the input whose size broke Inductor's ``assert_size_stride`` ("expected size 6==12 ... at dim=0")."""
    message = str(error).splitlines()[0]
    found = re.search(r"expected size (\d+)==(\d+).*at dim=(\d+)", message)
    if found:
        actual, dim = int(found.group(1)), int(found.group(3))
        for spec, arg in zip(record.inputs, args):
            if isinstance(arg, torch.Tensor) and spec["shape"] and arg.dim() > dim and arg.shape[dim] == actual:
                return BoundaryFailure(record.index, spec["name"], "assert_size_stride", spec["shape"],
                                       list(arg.shape), message)
    return BoundaryFailure(record.index, "<unknown>", "assert_size_stride", None, None, message)


def _copy_epilogue_failure(error: Exception, index: int, obs: PieceObservation) -> BoundaryFailure | None:
    kept = getattr(obs.boundary, "kept_copies", None)
    if not kept:
        return None
    copy = kept[0]
    return BoundaryFailure(index, copy["target"], "copy_epilogue", copy["dst_shape"], copy["src_shape"],
                           str(error).strip().splitlines()[-1][:400])


def _explain(failure: BoundaryFailure, rng: CompileRange | None, boundary: str = "none") -> str:
    where = f" in range {rng.label}" if rng is not None else ""
    return (
        f"boundary={boundary!r}{where}: sequence parallelism sharded tensor {failure.tensor!r} at piece "
        f"{failure.piece} ({failure.check} failed: expected shape {failure.expected_shape}, got "
        f"{failure.actual_shape}). The residual leaves the piece as a token shard while the next piece was "
        "compiled for the full token count. Use boundary='gather' (re-gather at every boundary) or "
        "'sharded' (keep the residual sharded and compile pieces for it). Inductor said: " + failure.message
    )
