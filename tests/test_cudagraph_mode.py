"""LabConfig.cudagraph_mode (vLLM's CUDA-graph modes): validation, the cudagraphs shorthand, vLLM names, and
which graph kind serves each capture size. Capture itself runs in tests/test_gpu_cudagraphs.py."""

from __future__ import annotations

import pytest

from sp_lab.compiler.cudagraphs import CudaGraphPlan
from sp_lab.config import ConfigError, LabConfig
from sp_lab.effective import enable_sp_and_async_tp


def test_cudagraphs_is_a_shorthand_that_follows_the_mode():
    assert LabConfig().cudagraph_mode == "none" and not LabConfig().cudagraphs
    assert LabConfig(cudagraphs=True).cudagraph_mode == "piecewise"
    for mode in ("piecewise", "full", "full_and_piecewise"):
        config = LabConfig(cudagraph_mode=mode)
        assert config.cudagraphs and config.cudagraph_mode == mode
        assert LabConfig.from_dict(config.to_dict()) == config
    assert not LabConfig(cudagraph_mode="none").cudagraphs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cudagraph_mode": "full_decode_only"}, "cudagraph_mode: expected one of 'none', 'piecewise', 'full'"),
        ({"cudagraph_mode": "full_piecewise"}, r"did you mean .full_and_piecewise.\?"),
        ({"cudagraphs": True, "cudagraph_mode": "none"}, "cudagraphs=True contradicts cudagraph_mode='none'"),
    ],
)
def test_bad_modes_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LabConfig(**kwargs)


def test_to_vllm_keeps_the_chosen_mode():
    vllm_names = {"none": "NONE", "piecewise": "PIECEWISE", "full": "FULL", "full_and_piecewise": "FULL_AND_PIECEWISE"}
    for mode, vllm in vllm_names.items():
        exported = LabConfig(tp_size=1, enable_sp=False, enable_async_tp=False, cudagraph_mode=mode).to_vllm("0.31")
        assert exported["cudagraph_mode"] == vllm  # written even for NONE: vLLM's default would capture graphs
    # With SP vLLM compiles the whole graph, so no mode can have per-piece graphs; graphs are never switched on:
    # "none" stays NONE, "piecewise" becomes NONE, "full_and_piecewise" (full where SP is off) full decode graphs.
    with_sp = {"none": "NONE", "piecewise": "NONE", "full": "FULL", "full_and_piecewise": "FULL_DECODE_ONLY"}
    for mode, vllm in with_sp.items():
        assert LabConfig(tp_size=2, cudagraph_mode=mode).to_vllm("0.31")["cudagraph_mode"] == vllm


def test_plan_full_and_piecewise_takes_full_graphs_where_sp_is_off():
    ladder = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    plan = CudaGraphPlan.build("full_and_piecewise", ladder, sp_on=lambda size: size >= 128)
    assert plan.full_sizes == {1, 2, 4, 8, 16, 32, 64} and plan.piecewise_sizes == {128, 256, 512}
    assert (plan.padded(3), plan.kind(plan.padded(3))) == (4, "full")
    assert (plan.padded(100), plan.kind(plan.padded(100))) == (128, "piecewise")
    assert (plan.padded(600), plan.kind(600)) == (600, "none")  # above the ladder: no graph, no padding


def test_plan_other_modes():
    sizes = [1, 8]
    assert CudaGraphPlan.build("full", sizes, sp_on=lambda s: True).full_sizes == {1, 8}
    assert CudaGraphPlan.build("piecewise", sizes, sp_on=lambda s: False).piecewise_sizes == {1, 8}
    none = CudaGraphPlan.build("none", sizes, sp_on=lambda s: False)
    assert none.padded(3) == 3 and none.kind(3) == "none"
    with pytest.raises(ValueError, match="cudagraph_mode='fully'"):
        CudaGraphPlan.build("fully", sizes, sp_on=lambda s: False)


def test_effective_mode_is_none_where_graphs_are_dropped(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    effective = enable_sp_and_async_tp(LabConfig(tp_size=1, cudagraph_mode="full"))
    assert effective.cudagraph_mode == "none" and not effective.cudagraphs
    assert any(r.startswith("cudagraphs: CUDA is not available") for r in effective.reasons)
