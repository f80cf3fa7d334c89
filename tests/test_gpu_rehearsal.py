"""GPU: the multi-rank path rehearsed on one GPU -- N gloo ranks sharing it, symmetric memory on overlapping devices.

Checked here: the effective config of a rehearsal rank, every collective sp_lab emits on gloo with CUDA
tensors (eager and compiled), and the compiled model at tp 2 and tp 4 for every boundary strategy against
tp 1 (toy in fp32, a 2-layer Llama-3-8B shape in bf16), with PyTorch's symm_mem fused kernels in the graphs.

What this mode cannot check: overlap of communication with compute (the ranks take turns on one GPU, so no
latency here is a multi-GPU latency) and CUDA-graph capture of the collectives (gloo runs them on the host;
the effective config drops ``cudagraphs`` with that reason). Those need several GPUs (benchmarks/multigpu).
"""

from __future__ import annotations

import pytest
import torch

import sp_lab
from sp_lab.bench.rehearsal import BOUNDARIES, CASES, rehearse_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (symm_mem kernels are CUDA-only)"),
]

def _effective(cudagraphs: bool) -> dict:
    import torch.distributed as dist

    from sp_lab.distributed.collectives import rehearse_on_one_gpu

    rehearse_on_one_gpu()
    config = sp_lab.LabConfig(tp_size=dist.get_world_size(), cudagraphs=cudagraphs)
    return sp_lab.enable_sp_and_async_tp(config).to_dict()


def test_effective_config_says_cuda_symm_mem_and_shared_gpu():
    effective = sp_lab.launch(_effective, True, world_size=2, backend="gloo", timeout=240)[0]
    assert effective["device"] == "cuda:0" and effective["backend"] == "gloo"
    assert effective["fused_op_impl"] == "symm_mem" and effective["symm_mem"] and effective["rehearsal"]
    assert effective["enable_sp"] and effective["enable_async_tp"]
    assert any("2 ranks share one GPU" in note for note in effective["notes"]), effective["notes"]
    assert not effective["cudagraphs"]
    assert any(r.startswith("cudagraphs: rehearsal mode") for r in effective["reasons"]), effective["reasons"]


def _collectives() -> dict[str, float]:
    """Every collective sp_lab's models and passes emit, on CUDA tensors over gloo, eager and compiled."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from sp_lab.distributed.collectives import rehearse_on_one_gpu
    from sp_lab.models.layers import _all_gather_single, gather_last_dim

    device = rehearse_on_one_gpu()
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    x = torch.arange(24.0, device=device).view(4, 6) * (rank + 1)
    shards = [torch.arange(24.0, device=device).view(4, 6) * (r + 1) for r in range(world)]
    cases = {
        "all_reduce": (lambda t: funcol.all_reduce(t, "sum", group), sum(shards)),
        "all_gather dim 0": (lambda t: _all_gather_single(t, 0, group), torch.cat(shards, 0)),
        "logits gather (LM head)": (lambda t: gather_last_dim(t, world, group), torch.cat(shards, 1)),
        "reduce_scatter": (lambda t: funcol.reduce_scatter_tensor(t.repeat(world, 1), "sum", 0, group),
                           sum(shards)),
    }
    errors = {}
    for name, (fn, want) in cases.items():
        errors[f"eager {name}"] = float((fn(x) - want).abs().max())
        compiled = torch.compile(lambda t, fn=fn: fn(t * 1.0), fullgraph=True)
        errors[f"compiled {name}"] = float((compiled(x) - want).abs().max())
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_collective_works_on_gloo_with_cuda_tensors(world_size):
    for rank, errors in enumerate(sp_lab.launch(_collectives, world_size=world_size, backend="gloo", timeout=300)):
        assert errors and all(err == 0.0 for err in errors.values()), (rank, errors)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_tp_model_matches_tp1_with_fused_symm_mem_ops(case, tp):
    bound = CASES[case].bound
    rows = rehearse_case(CASES[case], tp, timeout=540)
    assert {r.boundary for r in rows} == set(BOUNDARIES) and {r.num_tokens for r in rows} == set(CASES[case].token_counts)
    for row in rows:
        where = f"{row.boundary} at {row.num_tokens} tokens"
        assert row.source == "rehearsal" and row.fused_op_impl == "symm_mem", where
        assert row.eager_max_abs_err <= bound, (where, row)
        if row.error:
            # Only the strategy that exists to show the failure may fail, and only where SP shards the residual.
            assert row.boundary == "none" and row.sp_active and row.error.startswith("BoundaryError"), (where, row)
            continue
        assert row.max_abs_err <= bound, (where, row)
        if row.sp_active:
            assert row.fused_all_gather_matmul > 0 and row.fused_matmul_reduce_scatter > 0, (where, row)
        else:
            assert row.fused_all_gather_matmul == row.fused_matmul_reduce_scatter == 0, (where, row)
