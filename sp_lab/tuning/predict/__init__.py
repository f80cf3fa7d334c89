"""The performance model -- sp_lab's one model of SP / AsyncTP latency -- for GPUs that are not here.

- :mod:`.hardware`: GPUs and interconnects (datasheet peaks, alpha-beta costs with their sources);
- :mod:`.kernels`: single-GPU kernel times measured on one H200, scaled to the target GPU;
- :mod:`.pipeline`: a fused kernel's chunk pipeline (fill, contention, drain);
- :mod:`.layer`: a decoder layer per variant and token count, and per-matmul training rows
  (``source="predicted"`` everywhere: the CLI, the tuner's overlay and demo replay, the report, fixtures);
- :mod:`.crossover`: where fusion starts to pay, with a band;
- :mod:`.advice`: what ``python -m sp_lab predict`` prints (curves, crossovers, a predicted config);
- :mod:`.validation`: the model against published multi-GPU figures;
- :mod:`.measured`: the prediction beside measured rows of the same setup.
"""
