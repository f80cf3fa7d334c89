"""CUDA graphs per piece per capture size (GPU only), as vLLM's piecewise mode does.

Each compiled piece is captured once per input-shape signature (one per capture size). Replay copies the
inputs whose storage moved into the captured buffers; weights keep their storage and are not copied.
Splitting ops (attention) run eagerly between pieces, outside any graph. All pieces share one memory pool.
The host overhead this removes matters most at small token counts (docs/measured-h200.md: an eager fused
op costs ~0.2-0.33 ms of host time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CudaGraphPiece"]

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
        self.graphs[key] = (graph, static_args, static_out)
        graph.replay()
        return static_out
