"""The serving answer checked against what is known, from predicted rows (``python -m sp_lab traffic --validate``):

1. **the seed's serving result**: its own benchmark on one NVLink node found no meaningful benefit -- Llama-2-7b
   at tp 2 1.01-1.02x, Llama-3-70B at tp 8 0.98x -- so chat traffic on those setups must come out inside
   :data:`~sp_lab.serving.verdict.NOISE_BAND` for the threshold policy and for the draft's own setting;
2. **a static batch against AIConfigurator** (NVIDIA's serving estimator, ``aiconfigurator cli estimate``,
   aiconfigurator-core 0.12.0, Llama-3.1-70B, h200_sxm, vLLM backend, tp 8): TTFT of one prompt alone and TPOT
   of a batch decoding together, within 10%; the figures were produced with that package and are written below
   with their command (it is not a dependency: a user with it installed can re-run them);
3. **where it pays**: the same model over workloads and GPUs, to show the traffic and hardware where SP + AsyncTP
   from its threshold gains more than the noise band, if anywhere.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

from sp_lab.serving.scheduler import SchedulerLimits
from sp_lab.serving.step_costs import predicted_curves
from sp_lab.serving.traffic import Request, Traffic
from sp_lab.serving.verdict import NOISE_BAND, TrafficVerdict, evaluate
from sp_lab.serving.workloads import workload

__all__ = ["AICONFIGURATOR_FIGURES", "SEED_CASES", "Check", "StaticFigure", "pays_grid",
           "seed_checks", "static_checks", "validation_text"]



@dataclass(frozen=True)
class Check:
    """One validation line: what, the number, the band it must fall in, and whether it does."""

    what: str
    value: float
    low: float
    high: float
    unit: str = "x"

    @property
    def ok(self) -> bool:
        """Inside the band."""
        return self.low <= self.value <= self.high

    def line(self) -> str:
        """``PASS``/``FAIL`` with the number and its band."""
        return (f"{'PASS' if self.ok else 'FAIL'}  {self.what}: {self.value:.3f}{self.unit} "
                f"(band {self.low:.2f}-{self.high:.2f}{self.unit})")


SEED_CASES = (("llama-2-7b", 2, "h100"), ("llama-2-7b", 2, "h200"), ("llama-3-70b", 8, "h100"), ("llama-3-70b", 8, "h200"))
"""The seed's serving setups (one NVLink node; H100 or H200 -- both are checked)."""
SEED_POLICY = "sp+async_tp from"
"""The policy judged against the seed: SP + AsyncTP from the rows' threshold."""
DRAFT_POLICY = "draft: per-matmul rule from"
"""Printed beside it: the draft's own setting, with the rule the predicted rows imply (not the draft's tree)."""


def _max_model_len(model: str) -> int:
    from sp_lab.resources import load_preset

    return int(load_preset(model)["max_position_embeddings"])


def seed_checks(n: int = 1000, concurrency: int = 64) -> list[tuple[Check, TrafficVerdict]]:
    """Chat traffic (``n`` requests, ``concurrency`` users) on each of :data:`SEED_CASES`: SP + AsyncTP from the
    rows' threshold must lie in the noise band."""
    out = []
    for model, tp, gpu in SEED_CASES:
        traffic = workload("chat").traffic(n, concurrency=concurrency, max_model_len=_max_model_len(model))
        v = evaluate(predicted_curves(model, tp, gpu), traffic)
        r = v.result(v.judged)
        out.append((Check(f"{model} tp {tp} {gpu}, chat, {r.policy}", r.speedup, *NOISE_BAND), v))
    return out


@dataclass(frozen=True)
class StaticFigure:
    """An AIConfigurator estimate for a static batch: every request sent at once with the same lengths."""

    metric: str
    """``ttft`` or ``tpot``."""
    batch: int
    """Requests in the batch."""
    isl: int
    """Prompt tokens."""
    ms: float
    """AIConfigurator's figure."""
    command: str
    """How it was produced."""


_AIC = ("aiconfigurator cli estimate --model-path meta-llama/Meta-Llama-3.1-70B --system h200_sxm --backend vllm "
        "--tp-size 8")
AICONFIGURATOR_FIGURES = (
    StaticFigure("ttft", 1, 4096, 164.9, f"{_AIC} --estimate-mode static_ctx --isl 4096 --osl 2 --batch-size 1"),
    StaticFigure("ttft", 1, 1024, 44.5, f"{_AIC} --estimate-mode static_ctx --isl 1024 --osl 2 --batch-size 1"),
    StaticFigure("tpot", 1, 128, 7.79, f"{_AIC} --estimate-mode static_gen --isl 128 --batch-size 1"),
    StaticFigure("tpot", 64, 128, 9.84, f"{_AIC} --estimate-mode static_gen --isl 128 --batch-size 64"),
)
"""AIConfigurator's estimates (aiconfigurator-core 0.12.0) for Llama-3.1-70B (the shape of sp_lab's llama-3-70b
preset) on 8x H200 SXM, vLLM backend. TPOT runs use a short output (32 tokens here)."""
STATIC_TOLERANCE = 0.10


def static_checks(tolerance: float = STATIC_TOLERANCE) -> list[Check]:
    """Baseline TTFT / TPOT of each :data:`AICONFIGURATOR_FIGURES` static batch, from predicted llama-3-70b rows
    at tp 8 on the H200, within ``tolerance`` of AIConfigurator."""
    curves = predicted_curves("llama-3-70b", 8, "h200")
    out = []
    for fig in AICONFIGURATOR_FIGURES:
        output = 2 if fig.metric == "ttft" else 32
        traffic = Traffic(tuple(Request(0.0, fig.isl, output) for _ in range(fig.batch)), name="static batch")
        v = evaluate(curves, traffic, limits=SchedulerLimits(8192, fig.batch))
        base = v.result("baseline")
        got = (base.ttft.p50_ms if fig.metric == "ttft" else base.tpot.p50_ms)  # type: ignore[union-attr]
        out.append(Check(f"{fig.metric.upper()} batch {fig.batch}, isl {fig.isl}: predicted baseline "
                         f"vs AIConfigurator {fig.ms} ms", got / fig.ms, 1 - tolerance, 1 + tolerance))
    return out


def pays_grid(model: str = "llama-3-70b", tp: int = 8, gpus: Sequence[str] = ("h100", "h200", "b200"),
              workloads: Sequence[str] = ("chat", "summarization", "decode-heavy", "random"), *, n: int = 600,
              concurrency: int = 64, max_num_batched_tokens: int = 8192) -> list[tuple[str, str, float, str]]:
    """``(gpu, workload, speedup of SP + AsyncTP from its threshold, verdict word)`` over a grid."""
    from sp_lab.serving.verdict import verdict_word

    out = []
    limits = SchedulerLimits(max_num_batched_tokens, min(1024, max_num_batched_tokens))
    for gpu in gpus:
        curves = predicted_curves(model, tp, gpu, max_tokens=max_num_batched_tokens)
        for name in workloads:
            traffic = workload(name).traffic(n, concurrency=concurrency, max_model_len=_max_model_len(model))
            v = evaluate(curves, traffic, limits=limits)
            r = v.result(v.judged)
            out.append((gpu, name, r.speedup, verdict_word(r.speedup, r.interval)))
    return out


def validation_text() -> tuple[str, bool]:
    """The whole validation as text, and whether every check passed."""
    lines = ["Serving validation (PREDICTED rows: sp_lab's performance model; no GPU ran)", "",
             "1. The seed's serving result (no meaningful benefit on one NVLink node), chat traffic, 64 users:"]
    seeds = seed_checks()
    checks = [c for c, _ in seeds]
    for c, v in seeds:
        draft = next(r for r in v.results if r.policy.startswith(DRAFT_POLICY))
        lines += ["   " + c.line(), f"         beside it, {draft.policy}: {draft.speedup:.3f}x (not a check)"]
    aic = "installed" if importlib.util.find_spec("aiconfigurator") else "not installed: its recorded figures are used"
    lines += ["", f"2. A static batch against AIConfigurator (aiconfigurator {aic}):"]
    static = static_checks()
    lines += ["   " + c.line() for c in static]
    lines += ["   figures from: " + f.command for f in AICONFIGURATOR_FIGURES]
    lines += ["", "3. Where SP + AsyncTP from its threshold pays (llama-3-70b tp 8, 64 users, budget 8192 and 16384):"]
    for budget in (8192, 16384):
        for gpu, name, speedup, word in pays_grid(max_num_batched_tokens=budget):
            lines.append(f"   budget {budget:>5}  {gpu:<6} {name:<14} {speedup:.3f}x  {word}")
    checks += static
    passed = all(c.ok for c in checks)
    lines += ["", f"{sum(c.ok for c in checks)}/{len(checks)} checks pass"]
    return "\n".join(lines), passed
