"""Write the split-graph explorer's test reports from REAL compiles (regenerate after a report format change).

    python tests/data/make_explorer_fixtures.py          # ~1-2 min on 2 CPU cores

Every report is what ``sp_lab.compile`` writes, compiled under the fake process group (tp 2) with Inductor
(not inspect-only: the failures of strategy ``none`` only happen in Inductor's code generation and guards):

- models: the toy (out-of-place residual), the toy with an in-place residual (``residual_inplace=True``,
  the fused add+norm form), and llama-3-8b's layer structure shrunk to hidden 128 (a Llama-family model);
- every boundary strategy: ``none``, ``gather_erase``, ``gather``, ``sharded``;
- two compile ranges: tokens below ``async_tp_min_tokens`` (SP and AsyncTP off) and above (both on);
  one token count is run in each so both ranges compile.

A compile that fails (strategy ``none``: the in-place residual's ``copy_`` epilogue fails while compiling,
the out-of-place residual's input guard at the first call) is caught and the report kept as the
compiler left it: that is exactly what the explorer must draw.

Written gzip-compressed to ``tests/data/explorer/<model>_<strategy>.json.gz``.

``schema1_toy_inplace_gather_erase.json.gz`` is the same report as written by the compiler's first report format
(``sp_lab.compile_report/1``), kept as it is for the loader's migration tests (tests/test_report.py); not rewritten.

Also the large report ``benchmarks/bench_explorer.py`` times: ``llama-3-70b`` (80 layers, bf16, meta device) at
tp 8, boundary ``sharded``, inspect-only, one call of 4096 tokens -> ``llama-3-70b_tp8_80l_sharded.json.gz``
(~0.1 MB; 20-45 s to compile on 2 idle cores). ``--large-only`` writes just that one.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "explorer"
TP = 2
STRATEGIES = ("none", "gather_erase", "gather", "sharded")
MIN_TOKENS = 8
TOKENS = (5, 13)  # one below async_tp_min_tokens, one above: both ranges compile
LLAMA_SHRINK = {"hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 256}
MODELS = {
    "toy": ("toy", {}),
    "toy_inplace": ("toy", {"residual_inplace": True}),
    "llama": ("llama-3-8b", LLAMA_SHRINK),
}


def compile_report(model_key: str, strategy: str) -> dict:
    """Compile one model with one boundary strategy under the fake group; the report as a dict."""
    import torch

    import sp_lab
    from sp_lab.distributed.collectives import fake_process_group

    name, overrides = MODELS[model_key]
    with fake_process_group(TP):
        torch._dynamo.reset()
        model = sp_lab.models.build(name, tp_rank=0, tp_size=TP, num_layers=2, **overrides)
        config = sp_lab.LabConfig(tp_size=TP, async_tp_min_tokens=MIN_TOKENS, max_num_tokens=64, boundary=strategy)
        compiled = sp_lab.compile(model, config, inspect_only=False)
        for tokens in TOKENS:
            try:
                compiled(torch.arange(tokens) % model.spec.vocab_size)
            except Exception as err:
                if strategy != "none":
                    raise
                print(f"  {model_key}/{strategy} at {tokens} tokens failed as expected: {type(err).__name__}")
        return compiled.report.to_dict()


LARGE = OUT_DIR / "llama-3-70b_tp8_80l_sharded.json.gz"


def compile_large_report(path: Path = LARGE) -> Path:
    """The 80-layer llama-3-70b tp 8 report (inspect-only: meta parameters, no code generation)."""
    import torch

    import sp_lab
    from sp_lab.distributed.collectives import fake_process_group

    with fake_process_group(8):
        torch._dynamo.reset()
        model = sp_lab.models.build("llama-3-70b", tp_rank=0, tp_size=8, num_layers=80, dtype=torch.bfloat16,
                                    device="meta")
        config = sp_lab.LabConfig(tp_size=8, async_tp_min_tokens=1024, max_num_tokens=8192, boundary="sharded")
        compiled = sp_lab.compile(model, config, inspect_only=True)
        compiled(torch.zeros(4096, dtype=torch.long, device="meta"))
        report = compiled.report.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps(report).encode(), mtime=0))
    print(f"{path.name}: {path.stat().st_size / 1e3:.0f} kB")
    return path


def write_fixtures(out_dir: Path = OUT_DIR) -> list[Path]:
    # A cold Inductor cache: what the passes observed is cached beside Inductor's graphs under the pass's uuid,
    # which does not cover the report's own code, so a warm cache could hand back a report in the old format.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="sp_lab_explorer_fixtures_")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for model_key in MODELS:
        for strategy in STRATEGIES:
            report = compile_report(model_key, strategy)
            path = out_dir / f"{model_key}_{strategy}.json.gz"
            # mtime=0: the same report gives the same bytes, so regenerating does not dirty git for nothing.
            path.write_bytes(gzip.compress(json.dumps(report, indent=0).encode(), mtime=0))
            paths.append(path)
            print(f"{path.name}: {path.stat().st_size / 1e3:.0f} kB")
    paths.append(compile_large_report(out_dir / LARGE.name))
    return paths


if __name__ == "__main__":
    if "--large-only" in sys.argv[1:]:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="sp_lab_explorer_fixtures_")
        sys.exit(0 if compile_large_report() else 1)
    sys.exit(0 if write_fixtures() else 1)
