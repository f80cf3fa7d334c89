"""CUDA graphs as vLLM captures them (GPU only): per piece, or the whole forward, per capture size.

``LabConfig.cudagraph_mode`` (vLLM's names, lower-case) chooses, for each capture size, one of:

- ``"piecewise"``: each compiled piece is captured once per input-shape signature (:class:`CudaGraphPiece`);
  splitting ops (attention) run eagerly between pieces, outside any graph;
- ``"full"``: the whole forward -- pieces, attention, collectives -- is one graph per capture size
  (:class:`FullCudaGraphs`): no Python between pieces at all;
- ``"full_and_piecewise"``: full graphs at the capture sizes whose compile range has SP off (decode-sized
  batches, where host overhead dominates: 1.6-1.8x of ``torch.compile(mode="reduce-overhead")`` for
  piecewise graphs on a 4-layer Llama-3-8B on an H200), piecewise graphs at those where SP is on (there the
  piece boundaries are what sp_lab studies). vLLM's FULL_AND_PIECEWISE likewise keeps full graphs for
  decode batches and piecewise ones for larger batches;
- ``"none"``: no graphs.

Token counts above the largest capture size run without graphs (they are padded to no size). Replay copies
the inputs whose storage moved into the captured buffers; weights keep their storage and are not copied.
Piece graphs of a device share one memory pool (they never run concurrently); each whole-forward graph has
its own. The host overhead graphs remove matters most at small token counts (docs/measured-h200.md: an
eager fused op costs ~0.2-0.33 ms of host time).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["CudaGraphPiece", "CudaGraphPlan", "FullCudaGraphs", "StaticTokens", "counters"]

counters: Counter[str] = Counter()
"""Graphs captured in this process, by kind (``"piece"``, ``"full"``): something tests can assert on."""

_POOL: dict[int, Any] = {}


def _pool(device: int) -> Any:
    if device not in _POOL:
        _POOL[device] = torch.cuda.graph_pool_handle()
    return _POOL[device]


class CudaGraphPiece:
    """Replays ``fn`` from a CUDA graph per input-shape signature (captured on second sight).

    ``should_capture()`` says whether the current call is at a capture size; other calls run ``fn`` as it is,
    so token counts above the largest capture size never pile up graphs and their memory.
    """

    def __init__(self, fn: Callable, should_capture: Callable[[], bool]):
        self.fn = fn
        self.should_capture = should_capture
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Any], Any]] = {}
        self.seen: set[tuple] = set()

    def __call__(self, *args: Any) -> Any:
        if not self.should_capture():
            return self.fn(*args)
        key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        if key in self.graphs:
            graph, static_args, static_out = self.graphs[key]
            for static, arg in zip(static_args, args):
                if isinstance(arg, torch.Tensor) and static.data_ptr() != arg.data_ptr():
                    static.copy_(arg)
            graph.replay()
            return static_out
        if key not in self.seen:  # first sight is the warm-up (also lets Inductor autotune outside capture)
            self.seen.add(key)
            return self.fn(*args)
        static_args = list(args)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, pool=_pool(torch.cuda.current_device())):
            static_out = self.fn(*static_args)
        counters["piece"] += 1
        self.graphs[key] = (graph, static_args, static_out)
        graph.replay()
        return static_out


@dataclass(frozen=True)
class CudaGraphPlan:
    """Which kind of CUDA graph serves each token count: decided once per compiled model.

    ``full_sizes`` and ``piecewise_sizes`` partition the capture sizes (both empty without graphs).
    """

    full_sizes: frozenset[int] = frozenset()
    """Capture sizes replayed as one whole-forward graph."""
    piecewise_sizes: frozenset[int] = frozenset()
    """Capture sizes replayed as one graph per compiled piece."""

    @classmethod
    def build(cls, mode: str, capture_sizes: Iterable[int], sp_on: Callable[[int], bool]) -> CudaGraphPlan:
        """The plan for ``mode`` (a ``LabConfig.cudagraph_mode``); ``sp_on(size)`` says whether SP is applied
        in the compile range serving ``size`` (it decides ``"full_and_piecewise"``)."""
        sizes = frozenset(capture_sizes)
        if mode == "none":
            return cls()
        if mode == "piecewise":
            return cls(piecewise_sizes=sizes)
        if mode == "full":
            return cls(full_sizes=sizes)
        if mode == "full_and_piecewise":
            piecewise = frozenset(s for s in sizes if sp_on(s))
            return cls(full_sizes=sizes - piecewise, piecewise_sizes=piecewise)
        raise ValueError(f"cudagraph_mode={mode!r}: expected 'none', 'piecewise', 'full' or 'full_and_piecewise'")

    def padded(self, num_tokens: int) -> int:
        """The smallest capture size holding ``num_tokens`` (vLLM pads batches up to it), or ``num_tokens``."""
        sizes = [s for s in (*self.full_sizes, *self.piecewise_sizes) if s >= num_tokens]
        return min(sizes) if sizes else num_tokens

    def kind(self, padded: int) -> Literal["full", "piecewise", "none"]:
        """How a call of ``padded`` tokens (from :meth:`padded`) is served."""
        if padded in self.full_sizes:
            return "full"
        return "piecewise" if padded in self.piecewise_sizes else "none"


class FullCudaGraphs:
    """Replays ``forward(tokens)`` -- the whole compiled model -- from one CUDA graph per token count.

    Every call of a size runs on that size's static token buffer (as vLLM's runner does): the first call
    copies the tokens in and runs ``forward`` as it is (it compiles the range and lets Inductor autotune
    outside any capture), the second captures, later ones copy and replay. Each graph has its own memory
    pool: graphs captured later are replayed in any order, so none may reuse another's freed intermediates.
    The returned tensor is the graph's output buffer, overwritten by the next replay: callers copy it.
    """

    def __init__(self, forward: Callable[[torch.Tensor], Any]):
        self.forward = forward
        self.graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.static_tokens: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, tokens: torch.Tensor) -> Any:
        size = tuple(tokens.shape)  # the token count, in whichever dim holds it
        static = self.static_tokens.get(size)
        if static is None:
            self.static_tokens[size] = static = tokens.clone()
            return self.forward(static)
        static.copy_(tokens)
        if size in self.graphs:
            graph, static_out = self.graphs[size]
            graph.replay()
            return static_out
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            static_out = self.forward(static)
        counters["full"] += 1
        self.graphs[size] = (graph, static_out)
        graph.replay()
        return static_out


class StaticTokens:
    """One token buffer per capture size, owned here: graphs read their inputs from the buffers they were
    captured with, so a caller's tensor must never become one (a later replay would copy other tokens into
    it). :meth:`stage` copies the call's tokens in, zero-padded to the capture size."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}

    def stage(self, tokens: torch.Tensor, padded: int, dim: int = 0) -> torch.Tensor:
        """``tokens`` (``T`` tokens in dim ``dim``) copied into the buffer of ``padded >= T`` tokens, the
        tokens past ``T`` zero."""
        shape = list(tokens.shape)
        shape[dim] = padded
        buffer = self.buffers.get(padded)
        if buffer is None or list(buffer.shape) != shape or buffer.device != tokens.device or buffer.dtype != tokens.dtype:
            buffer = self.buffers[padded] = tokens.new_zeros(shape)
        num_tokens = tokens.shape[dim]
        buffer.narrow(dim, 0, num_tokens).copy_(tokens)
        if num_tokens < padded:
            buffer.narrow(dim, num_tokens, padded - num_tokens).zero_()
        return buffer
