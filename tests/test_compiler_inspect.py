"""Inspect-only compiles: a meta-device model under the fake group gets the same report as a real compile."""

import torch

import sp_lab
from sp_lab.distributed.collectives import fake_process_group

SHRUNK_LLAMA = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 8, "num_kv_heads": 8,
                "vocab_size": 256}


def _report(device: str, tp: int = 8):
    torch._dynamo.reset()
    model = sp_lab.models.build("llama-3-8b", tp_rank=0, tp_size=tp, device=device, **SHRUNK_LLAMA)
    compiled = sp_lab.compile(model, sp_lab.LabConfig(tp_size=tp, async_tp_min_tokens=8, max_num_tokens=64))
    out = compiled(torch.arange(12, device=device))
    return compiled, out


def test_meta_model_is_inspected_without_codegen_and_reports_like_a_real_compile():
    with fake_process_group(8):
        inspected, out = _report("meta")
        real, _ = _report("cpu")
    assert inspected.inspect_only and not real.inspect_only
    assert out.device.type == "meta" and tuple(out.shape) == (12, 256)
    assert inspected.report.op_counts(12) == real.report.op_counts(12)
    assert inspected.report.op_counts(12)["fused_all_gather_matmul"] == 5
    # The residual crosses every attention boundary as a token shard, in both.
    for compiled in (inspected, real):
        tensors = [t for b in compiled.report.range_for(12).boundaries for t in b.tensors]
        assert any(t.sharded_after for t in tensors)


def test_one_token_graph_in_an_sp_range_is_sequence_parallel():
    # Dynamo specialises one token ([1, H]: every size-1 dim "holds the tokens"); SP must still find the rows.
    with fake_process_group(2):
        model = sp_lab.models.build("toy", tp_rank=0, tp_size=2)
        config = sp_lab.LabConfig(tp_size=2, async_tp_min_tokens=1, max_num_tokens=64)
        compiled = sp_lab.compile(model, config, inspect_only=True)
        compiled(torch.randint(0, model.spec.vocab_size, (1,)))
    counts = compiled.report.op_counts(1)
    assert compiled.report.sp_rewrites(1) == 5 and counts["all_reduce"] == 0, counts
    assert counts["fused_all_gather_matmul"] == 5 and counts["fused_matmul_reduce_scatter"] == 4, counts
