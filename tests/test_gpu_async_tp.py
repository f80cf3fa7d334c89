"""GPU: the AsyncTP pass emits PyTorch's symmetric-memory kernels, Inductor compiles them, and CUDA graphs capture them.

One GPU means a one-rank NCCL group: the fused kernels run with no peer (docs/measured-h200.md: measured
that way), which checks everything but the overlap itself -- op signatures, the getitem plumbing of
``fused_all_gather_matmul``, Inductor lowering, graph capture and numerics.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._inductor.compile_fx import compile_fx

from sp_lab.compiler.passes.post_grad import PostGradPassManager, sp_lab_passes
from sp_lab.compiler.ranges import CompileRange

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (symmetric-memory kernels are CUDA-only)"),
]


@pytest.fixture(scope="module")
def group_name():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.distributed._symmetric_memory as symm_mem

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    name = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(name)  # deprecated on 2.11-2.14 yet required (pytorch #193027)
    yield name
    dist.destroy_process_group()


def _compile(fn, inputs, group_name):
    sp_pass = PostGradPassManager(
        sp_lab_passes(tp_size=1, rank=0, group_name=group_name, boundary="sharded", m_low=64, use_symm_mem=True),
        CompileRange(64, 4096, enable_sp=False, enable_async_tp=True), group_name)

    def backend(gm, example_inputs):
        with torch._inductor.config.patch({"post_grad_custom_post_pass": sp_pass, "fx_graph_cache": False}):
            return compile_fx(gm, example_inputs)

    return torch.compile(fn, backend=backend, fullgraph=True), sp_pass


@pytest.mark.parametrize("pattern", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_symm_mem_fusion_compiles_runs_and_replays_in_a_cuda_graph(group_name, pattern):
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    group = dist.group.WORLD

    if pattern == "all_gather_matmul":
        def fn(a, b):
            return torch.mm(funcol.all_gather_tensor(a, 0, group), b)
    else:
        def fn(a, b):
            return funcol.reduce_scatter_tensor(torch.mm(a, b), "sum", 0, group)

    compiled, sp_pass = _compile(fn, [a, b], group_name)
    with torch.no_grad():
        got = compiled(a, b)
        key = "fused_all_gather_matmul" if pattern == "all_gather_matmul" else "fused_matmul_reduce_scatter"
        assert op_counts_after(sp_pass)[key] == 1
        torch.testing.assert_close(got, a @ b, atol=1e-1, rtol=2e-2)

        graph = torch.cuda.CUDAGraph()
        static = compiled(a, b)
        with torch.cuda.graph(graph):
            static = compiled(a, b)
        a.copy_(torch.randn_like(a))
        graph.replay()
        torch.testing.assert_close(static, a @ b, atol=1e-1, rtol=2e-2)


def op_counts_after(sp_pass):
    assert sp_pass.record is not None  # the pass ran and filled its record
    return sp_pass.record.op_counts_after
