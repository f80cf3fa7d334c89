"""Serving traffic priced on a sweep's own rows: what the HTML report, the exported config and the tuner share.

A sweep measures a few token counts of one setup. :func:`rows_traffic` turns those rows into a serving question
they can answer: a named workload (``chat`` unless told otherwise; 300 requests from 64 concurrent users) under a
vLLM-style scheduler whose token budget is the largest count both the baseline and the SP + AsyncTP rows cover
(at most vLLM's 8192), so that no step is priced outside the rows. Where the rows cannot price a serving step (no
baseline or SP + AsyncTP curve, no row at one token) it raises ``ValueError`` saying why.

Three views use it, so they cannot disagree:

- the HTML report's "On serving traffic" section (:func:`sp_lab.viz.traffic.traffic_section_html`);
- the exported config's ``serving`` section (:func:`serving_answer` -> :class:`ServingAnswer`, written by
  :func:`sp_lab.tuning.export.export_config`): the speedup against baseline with its interval, or why there is none;
- the tuner's traffic-weighted regret (:func:`weighted_regret`: a regret table weighted by each token count's share
  of baseline's step time, :func:`sp_lab.serving.verdict.count_weights` and :func:`sp_lab.tuning.regret.traffic_regret`).

The rows time the decoder layers alone: no KV-cache or LM-head reads are added (``python -m sp_lab traffic --gpu``
models those for a preset), which the answers say.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sp_lab.vocabulary import BASELINE, SP_ASYNC_TP

if TYPE_CHECKING:
    import polars as pl

    from sp_lab.config import LabConfig
    from sp_lab.serving.scheduler import Schedule, SchedulerLimits
    from sp_lab.serving.step_costs import LatencyCurves
    from sp_lab.serving.traffic import Traffic
    from sp_lab.serving.verdict import TrafficVerdict

__all__ = ["CONCURRENCY", "LAYERS_ONLY", "MAX_BUDGET", "REQUESTS", "RowsTraffic", "ServingAnswer", "WeightedRegret",
           "rows_traffic", "serving_answer", "weighted_regret"]

REQUESTS = 300
"""Requests of the workload priced on a sweep's rows (enough for steady decode batches, fast to schedule)."""
CONCURRENCY = 64
"""Concurrent users sending them (closed loop, as ``vllm bench serve --max-concurrency``)."""
MAX_BUDGET = 8192
"""The budget's cap: vLLM's ``max_num_batched_tokens`` on GPUs with at least 70 GiB."""
LAYERS_ONLY = ("none: the rows price the decoder layers alone (python -m sp_lab traffic --gpu adds the KV-cache and "
               "LM-head reads of a GPU)")
"""What is added to every step here (nothing), as the answers say it."""


@dataclass(frozen=True)
class RowsTraffic:
    """A workload scheduled on a sweep's rows: the curves, the traffic and the scheduler's limits."""

    workload: str
    """The workload's name (:mod:`sp_lab.serving.workloads`)."""
    curves: LatencyCurves
    """The rows' latency per variant (one source)."""
    traffic: Traffic
    """The requests."""
    limits: SchedulerLimits
    """Budget (the largest count the rows cover, at most :data:`MAX_BUDGET`) and sequence cap."""

    @property
    def source(self) -> str:
        """``measured``, ``predicted``, ``replayed`` ...: the rows' one source."""
        return self.curves.source

    def describe(self) -> str:
        """One line: the traffic and the scheduler's budget, with why that budget."""
        return (f"{self.traffic.describe()}; a vLLM-style scheduler with a budget of "
                f"{self.limits.max_num_batched_tokens} tokens (the largest count the rows cover)")

    def baseline_schedule(self) -> Schedule:
        """The traffic's steps under baseline (what the traffic-weighted threshold and regret weigh by)."""
        from sp_lab.serving.policies import ServingPolicy
        from sp_lab.serving.scheduler import schedule

        budget = self.limits.max_num_batched_tokens
        price = self.curves.price(ServingPolicy.constant(BASELINE).variants(budget), budget)
        return schedule(self.traffic, self.limits, price)

    def weights(self, counts: Sequence[int]) -> dict[int, float]:
        """Each of ``counts``' share of baseline's step time on this traffic
        (:func:`~sp_lab.serving.verdict.count_weights`; ``ValueError`` when steps fall outside ``counts``)."""
        from sp_lab.serving.verdict import count_weights

        return count_weights(self.baseline_schedule(), counts)

    def verdict(self, config: LabConfig | None = None) -> TrafficVerdict:
        """:func:`~sp_lab.serving.verdict.evaluate` on this traffic (``config``: one more policy, the tuned one)."""
        from sp_lab.serving.verdict import evaluate

        return evaluate(self.curves, self.traffic, limits=self.limits, config=config)


def rows_traffic(rows: pl.DataFrame, workload: str = "chat", *, requests: int = REQUESTS,
                 concurrency: int = CONCURRENCY) -> RowsTraffic:
    """``workload`` scheduled on ``rows`` (one setup; measured or replayed rows before any other source, never
    mixed). ``ValueError`` saying why when the rows cannot price a serving step, or naming the workloads for an
    unknown one."""
    from sp_lab.serving.scheduler import SchedulerLimits
    from sp_lab.serving.step_costs import LatencyCurves, SharedTerms
    from sp_lab.serving.workloads import workload as named_workload
    from sp_lab.tuning.regret import one_source
    from sp_lab.vocabulary import MEASURED, PREDICTED, REHEARSAL, REPLAYED, SIMULATED

    chosen = named_workload(workload)  # an unknown name fails before any work
    rows = one_source(rows, prefer=(MEASURED, REPLAYED, PREDICTED, REHEARSAL, SIMULATED))
    curves = LatencyCurves.from_rows(rows, shared=SharedTerms(description=LAYERS_ONLY))
    first, last = zip(*(curves.coverage(v) for v in (BASELINE, SP_ASYNC_TP)), strict=True)
    if max(first) > 1:
        raise ValueError(f"the rows start at {max(first)} tokens; a decode step of one token cannot be priced "
                         "(sweep from --tokens 1)")
    budget = min(MAX_BUDGET, min(last))
    traffic = chosen.traffic(requests, concurrency=concurrency, max_model_len=MAX_BUDGET)
    return RowsTraffic(workload, curves, traffic, SchedulerLimits(budget, min(1024, budget)))


@dataclass(frozen=True)
class ServingAnswer:
    """The serving answer an exported config carries: the verdict on its own rows, or why there is none."""

    workload: str
    """The workload priced."""
    rows_hash: str
    """:func:`sp_lab.bench.store.data_hash` of the rows it was computed from (the file's own rows)."""
    source: str | None
    """The rows' source (``measured`` ...; ``None`` when the rows have none)."""
    priced: RowsTraffic | None = None
    """What was priced (``None``: see :attr:`not_priced`)."""
    verdict: TrafficVerdict | None = None
    """The verdict (``None``: see :attr:`not_priced`)."""
    not_priced: str | None = None
    """Why the rows could not price the workload."""

    def to_dict(self) -> dict[str, Any]:
        """The exported file's ``serving`` section."""
        out: dict[str, Any] = {"workload": self.workload, "source": self.source, "rows_hash": self.rows_hash}
        if self.verdict is None or self.priced is None:
            return {**out, "not_priced": self.not_priced}
        v, limits = self.verdict, self.priced.limits
        judged = v.result(v.judged)
        out.update({
            "traffic": v.traffic,
            "scheduler": {"model": "vLLM-style continuous batching with chunked prefill (sp_lab.serving.scheduler)",
                          "max_num_batched_tokens": limits.max_num_batched_tokens,
                          "max_num_seqs": limits.max_num_seqs,
                          "budget_from": "the largest token count the rows cover (at most 8192)"},
            "rows": v.provenance,
            "added_to_every_step": v.shared_terms,
            "policy": judged.policy,
            "speedup_vs_baseline": judged.speedup,
            "interval_95": None if judged.interval is None else list(judged.interval),
            "interval_method": v.interval_method,
            "speedup_is": "baseline's busy time / the policy's, each on its own schedule of the same traffic",
            "threshold": {"per_count": v.threshold.per_count, "traffic_weighted": v.threshold.traffic_weighted},
            "sentence": v.sentence,
        })
        if any(r.policy == "tuned config" for r in v.results):
            mine = v.result("tuned config")
            out["this_config"] = {"speedup_vs_baseline": mine.speedup,
                                  "interval_95": None if mine.interval is None else list(mine.interval)}
        return out


def serving_answer(rows: pl.DataFrame, *, config: LabConfig | None = None, workload: str = "chat") -> ServingAnswer:
    """The serving answer on ``rows`` (:func:`rows_traffic`; ``config`` priced too where its programs have rows), or
    the reason the rows cannot give one (never an exception for rows that cannot price a step)."""
    from sp_lab.bench.store import data_hash
    from sp_lab.serving.policies import ServingPolicy
    from sp_lab.serving.workloads import workload as named_workload

    named_workload(workload)  # an unknown name is the caller's mistake, raised, not written into the file
    rows_hash = data_hash(rows)
    source = str(rows["source"][0]) if "source" in rows.columns and rows.height else None
    try:
        priced = rows_traffic(rows, workload)
        budget = priced.limits.max_num_batched_tokens
        if config is not None and not set(ServingPolicy("", config=config).variants(budget)[1:]) <= set(
                priced.curves.curves):
            config = None  # it runs a program without rows (e.g. tuned, not measured): the standard policies only
        return ServingAnswer(workload, rows_hash, priced.source, priced=priced, verdict=priced.verdict(config))
    except ValueError as e:
        return ServingAnswer(workload, rows_hash, source, not_priced=str(e))


@dataclass(frozen=True)
class WeightedRegret:
    """A regret table weighted by a workload: each token count counts by its share of baseline's step time."""

    priced: RowsTraffic
    """The workload scheduled on the rows (what the weights come from)."""
    weights: Mapping[int, float]
    """Share of baseline's step time at each token count of the table (they sum to 1)."""
    regret_rel: float
    """``sum_T weight_T * regret_rel(T)`` (:func:`sp_lab.tuning.regret.traffic_regret`)."""

    def describe(self) -> str:
        """One line: the value, the workload, what the weights are, and the rows' source."""
        p = self.priced
        return (f"regret on {p.workload} traffic: {100 * self.regret_rel:.1f}% (each token count weighted by its share "
                f"of baseline's step time: {len(p.traffic.requests)} {p.workload} requests, "
                f"{p.traffic.arrival_process}, budget {p.limits.max_num_batched_tokens} tokens; {p.source} rows)")


def weighted_regret(rows: pl.DataFrame, table: pl.DataFrame, workload: str) -> WeightedRegret:
    """``table`` (:func:`sp_lab.tuning.regret.regret_table` of ``rows``) weighted by ``workload`` scheduled on
    ``rows`` (:func:`rows_traffic`); ``ValueError`` saying why when the rows cannot price the workload or its steps
    fall outside the table's token counts."""
    from sp_lab.tuning.regret import traffic_regret

    if not table.height:
        raise ValueError("no regret to weight: the rows have no token count where every variant was measured")
    priced = rows_traffic(rows, workload)
    weights = priced.weights(table["num_tokens"].to_list())
    return WeightedRegret(priced, weights, traffic_regret(table, weights))
