"""Compiling one model several times (a sweep's variants) must not run into Dynamo's recompile limit."""

import torch

import sp_lab
from sp_lab.distributed.collectives import fake_process_group


def test_many_compiles_of_one_model_stay_compiled():
    torch._dynamo.reset()
    try:
        with fake_process_group(2):
            model = sp_lab.models.build("toy", tp_rank=0, tp_size=2)
            config = sp_lab.LabConfig(tp_size=2, async_tp_min_tokens=8, max_num_tokens=64)
            for _ in range(5):  # 5 compiles of one forward; once 2 Dynamo graphs each, 10 > the default limit of 8
                compiled = sp_lab.compile(model, config)
                compiled(torch.arange(1))
                compiled(torch.arange(5))
                assert compiled.report.range_for(5).compiled
    finally:
        torch._dynamo.reset()
