"""Compiling one token range's artifact from one Dynamo graph, and filling its RangeReport.

Three strategies, chosen per range from the config (a range with SP off takes the split path):

- ``compile_mode="full_graph"``: Inductor on the whole graph, SP + AsyncTP as its post-grad pass;
- boundary in {none, gather_erase, gather}: split at the splitting ops, each piece through Inductor with
  SP + AsyncTP inside the piece (vLLM's design) and the boundary policy at its edges;
- boundary ``sharded``: AOT-trace the whole graph to aten, apply SP to all of it, *then* split, so the
  residual crosses boundaries as a token shard and each piece is compiled (Inductor's inner compile) for
  the shapes it really receives; AsyncTP runs inside each piece.

Pieces with the same structural fingerprint (every decoder layer) share one compiled artifact.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import fx
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_passes.post_grad import remove_noop_ops

from sp_lab.compiler.crossings import input_names, record_boundaries
from sp_lab.compiler.cudagraphs import CudaGraphPiece
from sp_lab.compiler.failures import BoundaryError, copy_epilogue_failure, explain, guard_inputs, in_range
from sp_lab.compiler.fake_inputs import TokenGuards, meta_devices_to_cpu, range_inputs
from sp_lab.compiler.inspection import structural_fingerprint, tensor_spec
from sp_lab.compiler.passes.boundary import BoundaryPolicy
from sp_lab.compiler.passes.post_grad import PostGradPassManager, sp_lab_passes
from sp_lab.compiler.passes.sequence_parallel import apply_sequence_parallel
from sp_lab.compiler.piece_compilers import CompiledPiece, PieceCompiler, choose_piece_compiler
from sp_lab.compiler.report import PieceRecord, RangeReport
from sp_lab.compiler.split import SplitGraph, split_at
from sp_lab.compiler.tensor_names import TensorNames
from sp_lab.config import BoundaryStrategy

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sp_lab.compiler.passes.sequence_parallel import SPResult
    from sp_lab.compiler.ranges import CompileRange
    from sp_lab.config import LabConfig
    from sp_lab.effective import EffectiveConfig

__all__ = ["RangeCompiler"]


class RangeCompiler:
    """Compiles the artifact of one token range from one Dynamo graph and fills ``report`` (its entry)."""

    def __init__(
        self,
        *,
        config: LabConfig,
        effective: EffectiveConfig,
        compile_range: CompileRange,
        report: RangeReport,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        fake_mode: FakeTensorMode | None,
        token_index: int,
        inspect_only: bool,
        at_capture_size: Callable[[], bool],
        hint: int | None = None,
    ):
        self.config, self.effective, self.range, self.report = config, effective, compile_range, report
        self.gm_to_run = gm
        self.gm = meta_devices_to_cpu(gm) if inspect_only else gm
        self.token_index, self.inspect_only, self.at_capture_size = token_index, inspect_only, at_capture_size
        self.example_inputs, self.fake_mode = range_inputs(
            example_inputs, token_index, compile_range, fake_mode, inspect_only=inspect_only,
            token_dim=config.token_dim, hint=hint,
        )
        self.token_guards = TokenGuards()  # what the trace assumed about N: known once compile() has run
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group_name = dist.group.WORLD.group_name if dist.is_initialized() else None
        self.splitting_ops = frozenset(config.splitting_ops)
        self.names = TensorNames(self.gm, self.splitting_ops)
        self._dedup: dict[str, CompiledPiece] = {}

    def compile(self) -> Callable:
        start = time.perf_counter()
        if self.config.compile_mode == "full_graph":
            fn = self._compile_full_graph()
        elif self.config.boundary.sp_before_split and self.range.enable_sp:
            fn = self._compile_sharded()
        else:
            pieces = choose_piece_compiler(inspect_only=self.inspect_only, aten=False)
            fn = self._compile_split(self.gm, self.example_inputs, pieces, in_piece_sp=self.range.enable_sp)
        self.report.compile_time_s = time.perf_counter() - start
        self.report.compiled = True
        token_size = self.example_inputs[self.token_index].shape[self.config.token_dim]
        self.token_guards = TokenGuards.of(getattr(self.fake_mode, "shape_env", None), token_size)
        self.report.token_guards = self.token_guards.describe()
        if self.effective.fused_op_impl == "symm_mem" and not self.inspect_only:
            self._reserve_symm_mem_workspace()
        if self.inspect_only:
            return self.gm_to_run  # the report is complete; calls run the captured graph as it is
        return fn

    def pass_uuid(self) -> str:
        """The ``uuid()`` of the passes this range's compile runs, whole-graph SP included (``sharded`` runs SP
        before splitting, its pieces without it): their sources and settings, for the range's cache key."""
        return self._passes(sp=self.range.enable_sp, boundary=self.config.boundary).uuid()

    def _reserve_symm_mem_workspace(self) -> None:
        """Size the symmetric-memory workspace for the largest fused matmul of the range, up front.

        The fused kernels grow the workspace on demand by re-allocating it; a CUDA graph captured before that
        would keep pointing at the freed buffer. Reserving for ``hi`` tokens before any capture avoids it.
        """
        from torch.distributed._symmetric_memory import get_symm_mem_workspace

        rows = self.range.hi + self.effective.tp_size  # padded to a multiple of tp
        widths = [
            d.k if d.pattern == "all_gather_matmul" else d.n
            for piece in self.report.pieces
            for d in piece.async_tp_decisions
            if d.decision == "fuse" and d.k is not None
        ]
        if widths:
            get_symm_mem_workspace(self.group_name, min_size=rows * max(widths) * 4)  # 4 bytes: fp32 worst case

    def _passes(self, *, sp: bool, boundary: BoundaryStrategy, index: int = 0, name: str = "graph") -> PostGradPassManager:
        """The post-grad passes of one piece; ``sp=False`` where SP already ran on the whole graph."""
        passes = sp_lab_passes(
            tp_size=self.effective.tp_size,
            rank=self.rank,
            group_name=self.group_name,
            boundary=boundary,
            m_low=self.range.lo,
            use_symm_mem=self.effective.fused_op_impl == "symm_mem",
            rule=self.config.heuristic,
            heuristic_default=self.config.heuristic_default,
            token_dim=self.config.token_dim,
            sp=sp,
        )
        return PostGradPassManager(passes, self.range, self.group_name, self.splitting_ops, index, name)

    # -- strategies ------------------------------------------------------------------------------------------------
    def _compile_full_graph(self) -> Callable:
        pieces = choose_piece_compiler(inspect_only=self.inspect_only, aten=False)
        passes = self._passes(sp=self.range.enable_sp, boundary=BoundaryStrategy.SHARDED)  # one graph: SP on all of it
        start = time.perf_counter()
        compiled = pieces(self.gm, self.example_inputs, passes)
        self.report.pieces = [dataclasses.replace(
            compiled.record, compile_time_s=time.perf_counter() - start, inductor_cache_hit=compiled.inductor_cache_hit,
            inputs=_input_specs(self.gm, self.example_inputs))]
        return compiled.fn

    def _compile_sharded(self) -> Callable:
        """SP on the whole AOT (aten) graph, then split: boundaries carry token shards."""
        pieces = choose_piece_compiler(inspect_only=self.inspect_only, aten=True)
        whole_graph_sp: list[SPResult] = []

        def forward_compiler(aten_gm: fx.GraphModule, aten_inputs: list[Any]) -> Callable:
            # An in-place collective on a local tensor (transformers' tp_plan: ``dist.all_reduce(out)``) leaves
            # ``copy(out, reduced)`` after functionalisation; Inductor drops such copies per piece, too late: SP would
            # read it as a consumer needing every token, gather there and leave the matmul unfused.
            remove_noop_ops(aten_gm.graph)
            whole_graph_sp.append(apply_sequence_parallel(
                aten_gm.graph, tp_size=self.effective.tp_size, rank=self.rank, group_name=self.group_name,
                policy=BoundaryPolicy(BoundaryStrategy.SHARDED), token_dim=self.config.token_dim,
            ))
            aten_gm.recompile()
            # split_module hands a piece the symbols its inputs' sizes use (the token count, when a piece only
            # receives ``2 * ((N + 1) // 2)``-sized DTensor shards, which Inductor cannot solve for N) by reading
            # ``example_value``, which Dynamo's graphs carry and AOT's carry as ``val``.
            for node in aten_gm.graph.nodes:
                if "val" in node.meta:
                    node.meta.setdefault("example_value", node.meta["val"])
            return make_boxed_func(self._compile_split(aten_gm, aten_inputs, pieces, in_piece_sp=False))

        # AOT must trace in Dynamo's fake mode (its ShapeEnv owns the token-count symbol).
        with torch._guards.tracing(torch._guards.TracingContext(self.fake_mode)):
            compiled = aot_module_simplified(
                self.gm, self.example_inputs, fw_compiler=forward_compiler, decompositions=select_decomp_table(),
                keep_inference_input_mutations=True,
            )
        for sp in whole_graph_sp:
            # Whole-graph SP (its rewrites, and the gathers and copies at the whole graph's edges) is attributed to
            # the range as a whole, on the first compiled piece.
            i = next(i for i, p in enumerate(self.report.pieces) if p.kind == "compiled")
            first = self.report.pieces[i]
            matches = dict(first.matches)
            for key, n in sp.matches().items():
                matches[key] = matches.get(key, 0) + n
            self.report.pieces[i] = dataclasses.replace(
                first, matches=matches, sp_rewrites=first.sp_rewrites + tuple(sp.rewrites),
                copies=first.copies + tuple(sp.boundary.copies))
        return compiled

    def _compile_split(self, gm: fx.GraphModule, inputs: list[Any], pieces: PieceCompiler, *, in_piece_sp: bool) -> Callable:
        split = split_at(gm, self.config.splitting_ops)
        fake_mode = detect_fake_mode(inputs) or self.fake_mode
        fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(
            x, torch._subclasses.FakeTensor) else x for x in inputs]
        walk = _PieceWalk(split.module, split)
        with fake_mode:
            walk.run(*fake_inputs)
            compiled = self._compile_pieces(walk.jobs, pieces, sp=in_piece_sp,
                                            names=input_names(split, self.names))
        self.report.pieces = [compiled[x.name].record if isinstance(x, _PieceJob) else x for x in walk.order]
        token_node = [n for n in split.module.graph.nodes if n.op == "placeholder"][self.token_index]
        self.report.boundaries = record_boundaries(
            split, walk.values, walk.values[token_node].shape[: self.config.token_dim + 1], self.report.pieces,
            self.names, self.effective.tp_size)

        for piece in split.compiled_pieces:
            fn = compiled[piece.name].fn
            if self.effective.cudagraphs:
                fn = CudaGraphPiece(fn, self.at_capture_size)
            split.module.__dict__[piece.name] = guard_inputs(
                fn, lambda index=piece.index: self.report.pieces[index], self.report)

        def run(*args: Any) -> Any:
            return split.module(*args)

        return run

    def _compile_pieces(self, jobs: list[_PieceJob], pieces: PieceCompiler, *, sp: bool,
                        names: dict[tuple[int, int], str]) -> dict[str, CompiledPiece]:
        """Every piece of the walk, compiled, by name. A piece that another process is compiling at this moment is
        left for last, then loaded from the cache: the ranks of a launch split a range's pieces between them, each
        taking the next one nobody holds, instead of each generating all of them (``piece_compilers``).

        ``names``: the model's name of each piece input an earlier piece made (``crossings.input_names``)."""
        done: dict[str, CompiledPiece] = {}
        held = []
        for job in jobs:
            compiled = self._compile_piece(job, pieces, sp=sp, wait=False, names=names)
            if compiled is None:
                held.append(job)
            else:
                done[job.name] = compiled
        for job in held:
            done[job.name] = self._compile_piece(job, pieces, sp=sp, wait=True, names=names)
        return done

    def _compile_piece(self, job: _PieceJob, pieces: PieceCompiler, *, sp: bool, wait: bool,
                       names: dict[tuple[int, int], str]) -> CompiledPiece | None:
        """``job`` compiled (or served by an identical piece of this range); None when ``wait`` is off and another
        process is compiling it."""
        submod, args, index, name = job
        named = {position: n for (piece, position), n in names.items() if piece == index}
        fingerprint = structural_fingerprint(submod, args)
        if fingerprint in self._dedup:
            hit = self._dedup[fingerprint]
            return dataclasses.replace(hit, record=_with_model_names(dataclasses.replace(
                hit.record, index=index, name=name, cache_hit=True, compile_time_s=0.0), named))
        passes = self._passes(sp=sp, boundary=self.config.boundary, index=index, name=name)
        start = time.perf_counter()
        try:
            compiled = pieces(submod, args, passes, wait=wait)
        except Exception as e:
            record = passes.record
            if record is not None:
                record = _with_model_names(dataclasses.replace(record, inputs=_input_specs(submod, args)), named)
            failure = copy_epilogue_failure(e, record)
            if failure is None:
                raise
            failure = in_range(failure, self.range.lo, self.range.hi)
            self.report.failures.append(failure)
            raise BoundaryError(explain(failure, self.config.boundary)) from e
        if compiled is None:
            return None
        record = dataclasses.replace(
            compiled.record, compile_time_s=time.perf_counter() - start, fingerprint=fingerprint, cache_hit=False,
            inductor_cache_hit=compiled.inductor_cache_hit, inputs=_input_specs(submod, args))
        # Kept under the graph's own names: an identical piece of another layer takes the model's names of its inputs.
        self._dedup[fingerprint] = compiled = dataclasses.replace(compiled, record=record)
        return dataclasses.replace(compiled, record=_with_model_names(record, named))


class _PieceJob(NamedTuple):
    """A piece to compile, with the fake arguments the walk gave it."""

    submod: fx.GraphModule
    args: list[Any]
    index: int
    name: str


class _PieceWalk(fx.Interpreter):
    """Runs a split graph over fake inputs, collecting every non-splitting piece with the fake args it gets.

    Afterwards: ``order`` (per piece its job, or the record of a splitting op), ``jobs`` (the pieces to compile,
    in order) and ``values`` (the fake value of every node of the split graph).
    """

    def __init__(self, module: fx.GraphModule, split: SplitGraph):
        super().__init__(module)
        self.pieces = {p.name: p for p in split.pieces}
        self.order: list[PieceRecord | _PieceJob] = []
        self.values: dict[fx.Node, Any] = {}

    @property
    def jobs(self) -> list[_PieceJob]:
        return [x for x in self.order if isinstance(x, _PieceJob)]

    def run_node(self, n: fx.Node) -> Any:
        self.values[n] = super().run_node(n)
        return self.values[n]

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        submod = self.fetch_attr(target)
        piece = self.pieces[target]
        if piece.splitting_op is not None:
            self.order.append(PieceRecord(piece.index, target, "splitting_op", op=piece.splitting_op))
            return submod(*args, **kwargs)
        # Pieces compile after the walk: Inductor rewrites a piece that returns one value to return a list, in
        # place, so a compiled submodule would hand the next op a list.
        self.order.append(_PieceJob(submod, list(args), piece.index, target))
        return submod(*args, **kwargs)


def _input_specs(gm: fx.GraphModule, inputs: list[Any]) -> tuple:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(tensor_spec(p.name, x) for p, x in zip(placeholders, inputs))


def _with_model_names(record: PieceRecord, named: dict[int, str]) -> PieceRecord:
    """``record`` with the inputs an earlier piece made, and the ``copy_``s into them, under the model's names
    (``named``: position among the piece's inputs -> name) instead of the graph's (Dynamo's ``hidden``, AOT's
    ``arg3_1``), so the failure message, the boundary table and the explorer name one tensor alike.

    A copy's target is a placeholder of the graph the passes saw (AOT's, one per piece input, in order), found by
    its position there; the record's snapshot of that graph gives the order. Other inputs keep their names.
    """
    if not named:
        return record
    inputs = tuple(dataclasses.replace(spec, name=named.get(i, spec.name)) for i, spec in enumerate(record.inputs))
    seen = [n.name for n in record.graph_before.nodes if n.op == "placeholder"] if record.graph_before else []
    position = {n: i for i, n in enumerate(seen)} if len(seen) == len(record.inputs) else {}
    copies = tuple(dataclasses.replace(c, target=named.get(position.get(c.target, -1), c.target))
                   for c in record.copies)
    return dataclasses.replace(record, inputs=inputs, copies=copies)
