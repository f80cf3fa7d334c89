"""The calibrated performance model: predicted SP / AsyncTP latency for GPUs that are not here.

- :mod:`.hardware`: GPUs and interconnects (datasheet peaks, alpha-beta costs with their sources);
- :mod:`.kernels`: single-GPU kernel times measured on one H200, scaled to the target GPU;
- :mod:`.pipeline`: a fused kernel's chunk pipeline (fill, contention, drain);
- :mod:`.layer`: a decoder layer per variant and token count (``source="predicted"``);
- :mod:`.crossover`: where fusion starts to pay, with a band;
- :mod:`.validation`: the model against published multi-GPU figures.
"""
