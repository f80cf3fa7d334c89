"""GPU: every cudagraph_mode captures what it says and replays the eager model's numbers (toy, fp32, tp 1).

Also checks that replays follow new inputs of the same size (the tokens are copied into the graph's input)
and that a count above the capture sizes runs without any graph.
"""

from __future__ import annotations

import pytest
import torch

import sp_lab
from sp_lab.compiler import cudagraphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SIZES = [1, 4, 16]


@pytest.fixture(scope="module")
def model():
    return sp_lab.models.build("toy", device="cuda")


@pytest.mark.parametrize(
    ("mode", "full", "pieces"),
    # The toy has 2 layers: 3 compiled pieces around 2 attention calls, deduplicated to... still 3 graphs
    # per size (one per piece call site), captured once each.
    [("none", 0, 0), ("piecewise", 0, 3), ("full", 1, 0), ("full_and_piecewise", 1, 0)],
)
def test_mode_captures_and_matches_eager(model, mode, full, pieces):
    config = sp_lab.LabConfig(tp_size=1, enable_sp=False, enable_async_tp=False, cudagraph_mode=mode,
                              cudagraph_capture_sizes=SIZES, async_tp_min_tokens=32, max_num_tokens=64)
    compiled = sp_lab.compile(model, config)
    assert compiled.effective.cudagraph_mode == mode
    before = cudagraphs.counters.copy()
    for n in [3, *SIZES, 40]:  # 3 pads to 4; 40 is above every capture size
        for seed in range(3):  # warm-up, capture, replay -- with different tokens each time
            ids = torch.randint(0, 256, (n,), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
            with torch.no_grad():
                want = model(ids)
            got = compiled(ids)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    captured = cudagraphs.counters - before
    assert captured["full"] == full * len(SIZES), captured
    assert captured["piece"] == pieces * len(SIZES), captured


@pytest.mark.parametrize("mode", ["piecewise", "full", "full_and_piecewise"])
def test_graphs_of_every_size_replay_new_tokens_after_all_are_captured(model, mode):
    """Capture at every size of two compile ranges first, then replay each with tokens it has not seen.

    (Replays in capture order right after each capture can hide graphs that read a stale input or memory a
    later capture reused.)"""
    sizes = [4, 8, 16, 32]
    config = sp_lab.LabConfig(tp_size=1, enable_sp=False, enable_async_tp=False, cudagraph_mode=mode,
                              cudagraph_capture_sizes=sizes, async_tp_min_tokens=10, max_num_tokens=64)
    compiled = sp_lab.compile(model, config)
    before = cudagraphs.counters.copy()
    for n in sizes:
        ids = torch.randint(0, 256, (n,), device="cuda")
        compiled(ids), compiled(ids)  # warm-up, capture
    captured = cudagraphs.counters - before
    # SP is off at every size, so full_and_piecewise captures whole-forward graphs; piecewise captures the
    # toy's 3 compiled pieces per size
    full, pieces = {"piecewise": (0, 3), "full": (1, 0), "full_and_piecewise": (1, 0)}[mode]
    assert (captured["full"], captured["piece"]) == (full * len(sizes), pieces * len(sizes)), captured
    for n in [*sizes, 3, 12]:
        for _ in range(2):
            ids = torch.randint(0, 256, (n,), device="cuda")
            with torch.no_grad():
                want = model(ids)
            torch.testing.assert_close(compiled(ids), want, atol=1e-4, rtol=1e-4)
    # 3 and 12 pad to the captured 4 and 16: the replays above captured nothing new
    assert cudagraphs.counters - before == captured, cudagraphs.counters - before


def test_piecewise_graphs_never_write_into_the_callers_tokens(model):
    """The first piece's graph copies each call's tokens into the tensor it was captured with; that tensor
    must be sp_lab's own buffer (the bug this guards against overwrote the caller's earlier token tensor)."""
    config = sp_lab.LabConfig(tp_size=1, enable_sp=False, enable_async_tp=False, cudagraph_mode="piecewise",
                              cudagraph_capture_sizes=[16], async_tp_min_tokens=32, max_num_tokens=64)
    compiled = sp_lab.compile(model, config)
    first = torch.randint(0, 256, (16,), device="cuda")
    kept = first.clone()
    before = cudagraphs.counters.copy()
    compiled(first), compiled(first)  # warm-up, capture
    captured = cudagraphs.counters - before
    assert captured["piece"] == 3 and captured["full"] == 0, captured  # the toy's 3 pieces, at 16 tokens
    compiled(torch.randint(0, 256, (16,), device="cuda"))  # replay with other tokens
    assert cudagraphs.counters - before == captured  # a replay, not a new capture
    assert torch.equal(first, kept)
