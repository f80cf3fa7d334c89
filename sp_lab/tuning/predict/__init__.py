"""The performance model -- sp_lab's one model of SP / AsyncTP latency -- for GPUs that are not here.

- :mod:`.hardware`: GPUs and interconnects (datasheet peaks, alpha-beta costs with their sources);
- :mod:`.collected`: multi-GPU tables collected on real systems (NCCL, vLLM's all-reduce, vLLM's GEMMs) from
  NVIDIA's ``aiconfigurator-core`` where installed, and vLLM's all-reduce choice;
- :mod:`.kernels`: single-GPU kernel times measured on one H200, scaled to the target GPU;
- :mod:`.pipeline`: a fused kernel's chunk pipeline (fill, contention, drain);
- :mod:`.layer`: a decoder layer per variant and token count, and per-matmul training rows
  (``source="predicted"`` everywhere: the CLI, the tuner's overlay and demo replay, the report, fixtures);
- :mod:`.crossover`: where fusion starts to pay, with a band;
- :mod:`.advice`: what ``python -m sp_lab predict`` prints (curves, crossovers, a predicted config);
- :mod:`.steps`: :func:`~.steps.step_latency_rows`, predicted step latency per token count and variant with a
  band and per-term provenance (the rows the serving simulation consumes);
- :mod:`.validation`: the model against published multi-GPU figures;
- :mod:`.crosscheck`: the baseline beside NVIDIA AIConfigurator's estimate;
- :mod:`.measured`: the prediction beside measured rows of the same setup.
"""
