"""Rehearsal mode on the CPU: what it refuses, and that nothing changes for ranks that did not ask for it.

The rehearsal itself (N ranks on one GPU) runs in tests/test_gpu_rehearsal.py.
"""

from __future__ import annotations

import pytest
import torch

import sp_lab
from sp_lab.distributed.collectives import device_for_rank, rehearsal_device, rehearse_on_one_gpu


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        rehearse_on_one_gpu()


def _refusal() -> str:
    try:
        rehearse_on_one_gpu()
    except RuntimeError as e:
        return str(e)
    return "accepted"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refuses_without_cuda_and_leaves_the_rank_on_the_cpu():
    def rank_fn():
        message = _refusal()
        return message, rehearsal_device(), str(device_for_rank(0)), sp_lab.enable_sp_and_async_tp(
            sp_lab.LabConfig(tp_size=2)).to_dict()

    message, shared, device, effective = sp_lab.launch(rank_fn, world_size=2, backend="gloo", timeout=120)[0]
    assert "needs a CUDA GPU" in message and "chunked reference ops" in message
    assert shared is None and device == "cpu"
    assert effective["device"] == "cpu" and effective["fused_op_impl"] == "cpu_chunked"
    assert not effective["rehearsal"] and not any("share one GPU" in n for n in effective["notes"])
