"""The piecewise backend: ``sp_lab.compile(model, config)``.

Per token range one artifact, compiled on first use and dispatched by ``num_tokens``; how a range is
compiled (full graph, pieces with in-piece SP, or the sharded path) is in ``range_compiler.py``, how a
piece is compiled in ``piece_compilers.py``. Splitting ops run eagerly between pieces. Pieces with the same
structural fingerprint (every decoder layer) share one compiled artifact, so an 80-layer model costs a
handful of compiles per range.

Dynamo captures the model once, with the token count symbolic from the first call (1 token included), and
later calls run the captured bytecode without Dynamo's guards (``capture.py``); a call that breaks what a
capture assumed (another batch size, a token count its trace excluded) is captured afresh. Each capture
compiles the ranges its calls reach, and the report keeps an entry per (range, Dynamo graph), with Dynamo's
capture time, so its compile times add up to what the first calls cost. Compiles of one model's variants can
share its captures (``captures=SharedCaptures(model)``): each variant then compiles its ranges from the graph
another one captured.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import fx

import sp_lab.compiler.fused_ops  # noqa: F401  (registers the CPU fused ops)
from sp_lab.compiler.artifact_cache import ArtifactCache, range_key
from sp_lab.compiler.capture import Capture, CapturedGraph, Dispatch, SharedCaptures, call_signature, capture
from sp_lab.compiler.cudagraphs import CudaGraphPlan, FullCudaGraphs, StaticTokens
from sp_lab.compiler.even_shards import EvenShards, even_shards
from sp_lab.compiler.failures import BoundaryError
from sp_lab.compiler.fake_inputs import TokenGuards
from sp_lab.compiler.range_compiler import RangeCompiler
from sp_lab.compiler.ranges import plan_ranges
from sp_lab.compiler.report import CompileReport, DynamoGraph, RangeReport
from sp_lab.config import LabConfig
from sp_lab.effective import EffectiveConfig, enable_sp_and_async_tp

if TYPE_CHECKING:
    from sp_lab.compiler.ranges import CompileRange

log = logging.getLogger(__name__)

__all__ = ["BoundaryError", "CompiledModel", "SharedCaptures", "compile"]


def compile(
    model: torch.nn.Module, config: LabConfig, *, inspect_only: bool | None = None,
    captures: SharedCaptures | None = None,
) -> CompiledModel:
    """Compile ``model`` piecewise with SP + AsyncTP as ``config`` asks; call on every rank.

    ``model``: any module whose first forward argument holds the tokens in dim ``config.token_dim`` (sp_lab's
    models, plain PyTorch with functional collectives, models parallelised with DTensor plans, Hugging Face
    ``tp_plan`` models). Nothing is compiled until the first call.

    ``inspect_only`` (default: True when the model's parameters are on the meta device): capture, split and
    run every pass exactly as a real compile does and fill the CompileReport, but skip Inductor's code
    generation; calls then run the captured graph as it is (on meta tensors: shapes only). This is how an
    80-layer 70B-shaped model at tp 8 is inspected on a laptop under ``fake_process_group(8)``. What only code
    generation finds is not reported: under ``boundary="none"`` a shard that leaves a piece through
    functionalization's ``copy_`` epilogue (an in-place residual) fails a real compile with a BoundaryError, while
    an inspect-only compile of the same model reports its pieces and no failure.

    ``captures``: a :class:`SharedCaptures` of ``model`` shared with its other compiles (other configs): a call
    that one of them captured already is not captured again, only this config's ranges are compiled.
    """
    if not isinstance(config, LabConfig):
        raise TypeError(f"config: expected sp_lab.LabConfig, got {type(config).__name__}")
    if captures is not None and captures.model is not model:
        raise ValueError(
            f"captures: a SharedCaptures of another model ({type(captures.model).__name__} at "
            f"{id(captures.model):#x}, this one is {type(model).__name__} at {id(model):#x}); share captures only "
            "among compiles of one model object, or pass captures=None")
    if inspect_only is None:
        inspect_only = any(p.is_meta for p in model.parameters())
    return CompiledModel(model, config, inspect_only=inspect_only, captures=captures)


class CompiledModel:
    """Callable like the model; each call is served by the artifact of the range holding its token count."""

    def __init__(self, model: torch.nn.Module, config: LabConfig, *, inspect_only: bool = False,
                 captures: SharedCaptures | None = None):
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
            ranges=[_planned(r, config) for r in self.ranges],
        )
        # By call_signature (one per batch size, as a rule): each capture with this model's dispatch of its graph.
        self._captures: dict[tuple, list[tuple[Capture, Dispatch]]] = {}
        self._shared = captures
        self._full_graphs = FullCudaGraphs(self._forward)
        self._static_tokens = StaticTokens()
        self._even_shards = EvenShards()  # what the captured graphs ask of the token count (DTensor shards)

    def __call__(self, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        dim = self.config.token_dim
        num_tokens = self.config.num_tokens(tokens.shape)  # batch * seq; rejects a token_dim past the rank
        self.config.range_for(num_tokens)  # rejects counts outside [1, max_num_tokens] by name
        batch = num_tokens // tokens.shape[dim]
        if batch != 1 and self.effective.cudagraph_mode != "none":
            # Refused at every size, not only at capture sizes: a batch that ran without graphs at one size and
            # failed at the next would be a surprise.
            raise NotImplementedError(
                f"CUDA graphs are captured per token count of a batch-1 input; this call has shape "
                f"{tuple(tokens.shape)} (batch {batch}, token_dim={dim}): flatten the batch into the token "
                "dimension, or set cudagraph_mode='none'"
            )
        padded = self._graphs.padded(num_tokens)
        kind = self._graphs.kind(padded)
        # Before Dynamo: a count the model cannot run at would otherwise be traced afresh, then abort in gloo.
        # DTensor shards each sequence of a batch: the requirement is on the sequence length.
        self._even_shards.check(padded // batch)
        self.at_capture_size = kind == "piecewise"
        if kind == "piecewise":
            # The first piece's graph keeps the tensor it was captured with as its input and copies later
            # tokens into it: that must be sp_lab's buffer, never the caller's (it would be overwritten).
            tokens = self._static_tokens.stage(tokens, padded, dim)
        elif padded != num_tokens:
            # Pad to the captured size as vLLM does; causal attention keeps the first rows exact.
            pad_shape = list(tokens.shape)
            pad_shape[dim] = padded - num_tokens
            tokens = torch.cat([tokens, tokens.new_zeros(pad_shape)], dim=dim)
        with torch.no_grad():
            if kind == "full" and not args and not kwargs:  # a whole-forward graph holds the tokens only
                out = self._full_graphs(tokens)
            else:
                out = self._forward(tokens, *args, **kwargs)
        if kind != "none":
            out = out.narrow(dim, 0, num_tokens).clone()  # the graph's output buffer is reused by the next replay
        return out

    def pending_compile(self, num_tokens: int) -> CompileRange | None:
        """The range a call of ``num_tokens`` tokens (batch 1) would compile first; None when it is compiled.

        A sweep asks this to say what is compiling, and to measure the variants that are ready first."""
        padded = self._graphs.padded(num_tokens)  # what __call__ runs at
        lo, hi = self.config.range_for(padded)
        if self._captures and self.report.range_for(padded).compiled:
            return None
        return next(r for r in self.ranges if (r.lo, r.hi) == (lo, hi))

    def _forward(self, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """One call: the capture that fits it, without Dynamo; one another variant made (``captures``) if none
        does; else a new capture."""
        dim = self.config.token_dim
        signature = call_signature(tokens, dim, args, kwargs)
        seq = tokens.shape[dim]
        for known, dispatch in self._captures.get(signature, ()):
            if known.token_guards.hold(seq):
                return known.run(dispatch, self.model, tokens, *args, **kwargs)
        key = SharedCaptures.key(signature)
        shared = self._shared.find(key, seq) if self._shared is not None else None
        if shared is not None:
            dispatch = self._adopt(shared.graph, shared=True)
            self._captures.setdefault(signature, []).append((shared, dispatch))
            return shared.run(dispatch, self.model, tokens, *args, **kwargs)
        return self._capture(signature, key, tokens, args, kwargs)

    def _capture(self, signature: tuple, key: tuple, tokens: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """Capture with Dynamo and run the call, recording Dynamo's own time."""
        graphs, compile_s = len(self.report.graphs), _range_compile_s(self.report)
        started = time.perf_counter()

        def keep(captured: Capture, dispatch: Dispatch) -> None:
            self._captures.setdefault(signature, []).append((captured, dispatch))
            if self._shared is not None:
                self._shared.add(key, captured)

        out = capture(self.model, tokens, self.config.token_dim, args, kwargs,
                      adopt=functools.partial(self._adopt, shared=False), keep=keep)
        if len(self.report.graphs) > graphs:
            # Dynamo's share of this call: everything but the range compiles it triggered.
            spent = time.perf_counter() - started - (_range_compile_s(self.report) - compile_s)
            self.report.graphs[-1] = dataclasses.replace(self.report.graphs[-1], capture_time_s=max(spent, 0.0))
        return out

    # -- serving a captured graph ---------------------------------------------------------------------------------
    def _adopt(self, captured: CapturedGraph, *, shared: bool) -> Dispatch:
        """This model's dispatch of a captured graph: its report entry, and its range artifacts compiled on first
        use. ``shared``: the graph was captured by another compile of the model (no capture time of ours)."""
        gm, example_inputs, token_index = captured.gm, captured.example_inputs, captured.token_index
        fake_mode = captured.fake_mode
        tokens = self.config.num_tokens(example_inputs[token_index].shape)
        graph = DynamoGraph(len(self.report.graphs), tokens if isinstance(tokens, int) else None,
                            0.0 if shared else captured.capture_time_s, shared_capture=shared)
        self.report.graphs.append(graph)
        shards = even_shards(gm, example_inputs[token_index].shape[self.config.token_dim], self.effective.tp_size)
        self._even_shards = self._even_shards.merged(shards)
        # Per range, the artifacts compiled from this graph with what each one's trace assumed about the token
        # count; ``served`` remembers the choice per count (checking guards costs more than a forward at 1 token).
        artifacts: dict[int, list[tuple[TokenGuards, Callable]]] = {}
        served: dict[int, Callable] = {}

        def dispatch(*args: Any) -> Any:
            seq = args[token_index].shape[self.config.token_dim]  # B is static in this graph: seq <-> count
            if seq not in served:
                shards.check(seq)  # this graph may have been captured at such a count
                served[seq] = self._artifact_for(self.config.num_tokens(args[token_index].shape), seq, artifacts,
                                                 graph, gm, example_inputs, fake_mode, token_index)
            return served[seq](*args)

        return dispatch

    def _artifact_for(
        self, num_tokens: int, seq: int, artifacts: dict[int, list[tuple[TokenGuards, Callable]]],
        graph: DynamoGraph, gm: fx.GraphModule, example_inputs: list[Any], fake_mode: Any, token_index: int,
    ) -> Callable:
        """The artifact of ``num_tokens``'s range whose trace holds for it, compiled if there is none.

        A range is traced once with a hint; if what that trace assumed (e.g. that tp divides N) does not hold
        for the call, the count gets an artifact of its own, traced at that count -- as Dynamo recompiles
        when its guards fail. ``num_tokens`` (``batch * seq``) picks the range; the trace's symbol and guards
        are the sequence length ``seq`` (the batch is static in the graph)."""
        index = next(i for i, r in enumerate(self.ranges) if num_tokens in r)
        compiled = artifacts.setdefault(index, [])
        for guards, fn in compiled:
            if guards.hold(seq):
                return fn
        if compiled:
            log.info("sp_lab.compile: %d tokens violate %s assumed by range %s's artifact; compiling one for it",
                     num_tokens, compiled[0][0].violated(seq), self.ranges[index].label)
        compiler = RangeCompiler(
            config=self.config,
            effective=self.effective,
            compile_range=self.ranges[index],
            report=self._entry(self.ranges[index], graph),
            gm=gm,
            example_inputs=example_inputs,
            fake_mode=fake_mode,
            token_index=token_index,
            inspect_only=self.inspect_only,
            at_capture_size=lambda: self.at_capture_size,
            hint=seq if compiled else None,
        )
        fn = self._compile_through_cache(compiler, gm, example_inputs, index, hint=seq if compiled else None)
        compiled.append((compiler.token_guards, fn))
        return fn

    def _compile_through_cache(self, compiler: RangeCompiler, gm: fx.GraphModule, example_inputs: list[Any],
                               index: int, hint: int | None) -> Callable:
        """``compiler.compile()`` with the range's on-disk entry loaded first and saved after."""
        cache = None if self.inspect_only else ArtifactCache.default()
        if cache is None:
            compiler.report.artifact_cache = "off"
            return compiler.compile()
        key = range_key(gm, example_inputs, self.config, self.effective.to_dict(), self.ranges[index],
                        compiler.pass_uuid(), hint=hint)
        with cache.serve(key) as serving:
            fn = compiler.compile()
            serving.compiled_anything = any(
                p.kind == "compiled" and not p.cache_hit and not p.inductor_cache_hit for p in compiler.report.pieces)
        compiler.report.artifact_cache = serving.outcome
        return fn

    def _entry(self, rng: CompileRange, graph: DynamoGraph) -> RangeReport:
        """The report entry of ``rng`` compiled from ``graph``: the planned one if still free, else a new one."""
        same = [i for i, r in enumerate(self.report.ranges) if (r.lo, r.hi) == (rng.lo, rng.hi)]
        entry = self.report.ranges[same[0]]
        if entry.dynamo_graph is not None:
            entry = _planned(rng, self.config)
            self.report.ranges.insert(same[-1] + 1, entry)
        entry.dynamo_graph, entry.static_tokens = graph.index, graph.static_tokens
        return entry


def _planned(rng: CompileRange, config: LabConfig) -> RangeReport:
    return RangeReport(rng.lo, rng.hi, rng.enable_sp, rng.enable_async_tp, config.boundary, config.compile_mode)


def _range_compile_s(report: CompileReport) -> float:
    return sum(r.compile_time_s for r in report.ranges)


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
