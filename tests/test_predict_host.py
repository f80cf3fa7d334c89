"""The eager host time of a tp-way fused call: the one-rank call's (measured) plus the op calls PyTorch's fused ops
issue per remote chunk, each at the host time of one eager op call. Checked by hand from the shipped rows."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from sp_lab.resources import h200_file
from sp_lab.tuning.microbench import MatmulShape
from sp_lab.tuning.predict import validation as V
from sp_lab.tuning.predict.kernels import KernelModel, default_table, fused_host_us, launch_host_us
from sp_lab.tuning.predict.layer import Target, predict_matmul

ROWS = json.loads(h200_file("symm_mem_ws1.json").read_text())["rows"]
ONE_CALL = min(ROWS, key=lambda r: r["M"])["mm_ag_eager"]  # 15.62 us: device time 7.33 us, so host-bound
ONE_RANK = {"ag": statistics.median(r["fused_ag_mm_eager"] for r in ROWS),
            "rs": statistics.median(r["fused_mm_rs_eager"] for r in ROWS)}


def test_one_eager_op_call_is_the_host_bound_plain_matmul():
    smallest = min(ROWS, key=lambda r: r["M"])
    assert smallest["mm_ag_graph"] < smallest["mm_ag_eager"]  # the device is idle part of each eager call
    assert launch_host_us() == pytest.approx(15.62)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fused_host_time_by_hand(tp):
    # all_gather side, per remote chunk: copy_ of the peer's shard + mm.out of it (2 calls);
    # reduce_scatter side, per remote chunk: mm.out, barrier, copy_, barrier (4 calls), plus one _sleep at tp > 1.
    assert fused_host_us("ag", tp) == pytest.approx(ONE_RANK["ag"] + (tp - 1) * 2 * ONE_CALL)
    assert fused_host_us("rs", tp) == pytest.approx(ONE_RANK["rs"] + ((tp - 1) * 4 + (tp > 1)) * ONE_CALL)


def test_tp8_values():
    assert fused_host_us("ag", 8) == pytest.approx(329.555 + 14 * 15.62)  # 548.2 us
    assert fused_host_us("rs", 8) == pytest.approx(199.065 + 29 * 15.62)  # 652.0 us


def test_bad_side_and_tp_are_refused():
    with pytest.raises(ValueError, match="side must be one of"):
        fused_host_us("a2a", 8)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        fused_host_us("ag", 0)


def test_eager_prediction_uses_the_tp_way_host_time_and_graph_none():
    shape = MatmulShape("o_proj", n=8192, k=1024, collective="reduce_scatter")
    for timing, want in (("eager", fused_host_us("rs", 8)), ("graph", 0.0)):
        target = Target.of("h200", timing=timing, collected_tables=False)
        p = predict_matmul(KernelModel(default_table(), target.gpu), target, shape, 8, 8, 8192)
        assert p.host_us["fused"] == pytest.approx(want)
        if timing == "eager":  # at 8 tokens the call is host-bound: the fused time is the host time
            assert p.fused_us == pytest.approx(want)


def test_vllm_thresholds_are_predicted_eagerly_with_the_graph_crossover_beside():
    # vLLM runs batches above its largest CUDA-graph size (<= 512 tokens by default) without a graph
    for fid in ("vllm-sp-threshold-hopper", "vllm-sp-threshold-h100", "vllm-sp-threshold-b200"):
        fig = next(f for f in V.figures() if f.id == fid)
        assert fig.setup["timing"] == "eager"
    fig = next(f for f in V.figures() if f.id == "vllm-sp-threshold-b200")
    graph, _ = V.predict_figure(dataclasses.replace(fig, setup={**fig.setup, "timing": "graph"}))
    eager, _ = V.predict_figure(fig)
    assert eager > graph  # host time only ever adds
    assert V.miss_breakdown(fig).endswith(f"Timed as device time (CUDA graphs) instead, the crossover is "
                                          f"{V._fmt(graph, fig.unit)}.")
