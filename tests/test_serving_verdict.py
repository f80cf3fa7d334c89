"""Step costs and the serving verdict on traffic whose answer is worked out by hand: the weighting of step sizes,
the traffic-weighted threshold, the refusal of counts outside the rows, and the delta-method interval."""

from __future__ import annotations

import itertools
import math

import numpy as np
import polars as pl
import pytest

from sp_lab.serving.policies import ServingPolicy, standard_policies
from sp_lab.serving.scheduler import SchedulerLimits, replay_steps
from sp_lab.serving.step_costs import LatencyCurves, predicted_token_grid
from sp_lab.serving.traffic import Request, Traffic
from sp_lab.serving.verdict import evaluate, per_count_threshold, speedup_interval, traffic_weighted_threshold

Z95 = 1.959963984540054
# baseline / sp+async_tp latency (us) and standard error at three token counts: fusion loses small, wins at 4096
BASE = {1: (10.0, 1.0), 64: (100.0, 2.0), 4096: (1000.0, 50.0)}
FUSED = {1: (20.0, 2.0), 64: (120.0, 3.0), 4096: (800.0, 40.0)}


def rows(*, with_ci: bool = True, source: str = "measured") -> pl.DataFrame:
    out = []
    for variant, table in (("baseline", BASE), ("sp+async_tp", FUSED)):
        for t, (us, se) in table.items():
            ci = (us - Z95 * se, us + Z95 * se) if with_ci else (None, None)
            out.append({"num_tokens": t, "variant": variant, "latency_us": us, "ci_low_us": ci[0], "ci_high_us": ci[1],
                        "source": source, "model": "m", "tp": 8})
    return pl.DataFrame(out)


def test_a_step_list_is_weighted_by_how_often_each_size_occurs():
    # 90 decode steps of 1 token and 10 prefill steps of 4096: baseline 90*10 + 10*1000 us, the threshold
    # policy (from 4096, the rows' crossover) 90*10 + 10*800
    v = evaluate(LatencyCurves.from_rows(rows()), [1] * 90 + [4096] * 10)
    assert v.threshold.per_count == 4096
    judged = v.result("sp+async_tp from 4096")
    assert judged.busy_s == pytest.approx(8900e-6)
    assert v.result("baseline").busy_s == pytest.approx(10900e-6)
    assert judged.speedup == pytest.approx(10900 / 8900)
    assert v.result("sp+async_tp always").speedup == pytest.approx(10900 / (90 * 20 + 10 * 800))
    shares = {(b.low, b.high): (b.step_share, b.time_share) for b in v.histogram}
    assert shares[(1, 1)] == pytest.approx((0.9, 900 / 10900))
    assert shares[(4096, 8191)] == pytest.approx((0.1, 10000 / 10900))
    assert "pays" in v.sentence and "1.22x" in v.sentence


def test_steps_between_rows_are_interpolated_linearly():
    # 2000 tokens lies between the rows at 64 and 4096: weight (4096 - 2000) / 4032 on the row at 64
    v = evaluate(LatencyCurves.from_rows(rows()), [2000])
    w = (4096 - 2000) / (4096 - 64)
    assert v.result("baseline").busy_s == pytest.approx((w * 100 + (1 - w) * 1000) * 1e-6)
    assert v.result("sp+async_tp always").busy_s == pytest.approx((w * 120 + (1 - w) * 800) * 1e-6)
    assert v.result("baseline").interpolated_share == 1.0


def test_traffic_weighted_threshold_counts_each_run_by_its_steps():
    curves = LatencyCurves.from_rows(rows())
    # 100 steps of 64 tokens (fusion loses 20 us each) and one of 2000 (fusion wins ~86 us): never fusing is best
    best, best_s, times = traffic_weighted_threshold(curves, np.array([64, 2000]), np.array([100, 1]))
    base_2000 = 100 + 900 * 1936 / 4032
    fused_2000 = 120 + 680 * 1936 / 4032
    assert times[64] == pytest.approx((100 * 120 + fused_2000) * 1e-6)
    assert times[None] == pytest.approx((100 * 100 + base_2000) * 1e-6)
    assert best is None and best_s == pytest.approx(times[None])
    # one step of each: fusing from 64 wins (the 2000-token step saves more than the 64-token one loses)
    best, _, _ = traffic_weighted_threshold(curves, np.array([64, 2000]), np.array([1, 1]))
    assert best == 64


def test_per_count_threshold_is_the_lasting_crossover_of_the_rows():
    assert per_count_threshold(LatencyCurves.from_rows(rows())) == 4096
    never = rows().with_columns(latency_us=pl.when(pl.col("variant") == "sp+async_tp").then(pl.col("latency_us") * 2)
                                .otherwise(pl.col("latency_us")))
    assert per_count_threshold(LatencyCurves.from_rows(never)) is None


def test_counts_outside_the_rows_are_refused():
    curves = LatencyCurves.from_rows(rows())
    with pytest.raises(ValueError, match=r"\[5000\] tokens lie outside the measured rows of 'baseline' \(1..4096"):
        evaluate(curves, [1, 5000])
    traffic = Traffic((Request(0, 10, 2),))
    with pytest.raises(ValueError, match="outside the measured rows"):  # the budget reaches past the rows
        evaluate(curves, traffic, limits=SchedulerLimits(8192, 256))
    evaluate(curves, traffic, limits=SchedulerLimits(4096, 256))  # within the rows: priced


def test_rows_of_two_sources_are_never_pooled():
    mixed = pl.concat([rows(), rows(source="predicted")])
    with pytest.raises(ValueError, match="mix sources"):
        LatencyCurves.from_rows(mixed)


def test_interval_is_the_delta_method_over_the_rows_each_policy_uses():
    curves = LatencyCurves.from_rows(rows())
    steps = [1] * 90 + [4096] * 10
    v = evaluate(curves, steps)
    tb, tp = 10900.0, 8900.0
    # d log Tb - d log Tp per row: the 1-token baseline row is used by both (90 steps each); the 4096 rows by one
    var = ((90 / tb - 90 / tp) * 1.0) ** 2 + (10 / tb * 50.0) ** 2 + (10 / tp * 40.0) ** 2
    ratio = tb / tp
    lo, hi = v.result("sp+async_tp from 4096").interval
    assert lo == pytest.approx(ratio * math.exp(-Z95 * math.sqrt(var)))
    assert hi == pytest.approx(ratio * math.exp(Z95 * math.sqrt(var)))
    # the same policy against itself: every row cancels
    base = ServingPolicy.constant("baseline")
    s = v.schedules["baseline"]
    assert speedup_interval(curves, (base, s), (base, s)) == pytest.approx((1.0, 1.0))


def test_interval_splits_an_interpolated_step_between_its_two_rows():
    curves = LatencyCurves.from_rows(rows())
    base, fused = ServingPolicy.constant("baseline"), ServingPolicy.constant("sp+async_tp")
    price = {p: curves.price(p.variants(2000), 2000) for p in (base, fused)}
    sb, sf = (replay_steps([2000], price[p]) for p in (base, fused))
    w = (4096 - 2000) / 4032
    tb, tf = w * 100 + (1 - w) * 1000, w * 120 + (1 - w) * 800
    var = (w / tb * 2) ** 2 + ((1 - w) / tb * 50) ** 2 + (w / tf * 3) ** 2 + ((1 - w) / tf * 40) ** 2
    lo, hi = speedup_interval(curves, (base, sb), (fused, sf))
    assert math.log(hi / lo) / 2 == pytest.approx(Z95 * math.sqrt(var))


def test_rows_without_intervals_give_no_interval_and_say_so():
    v = evaluate(LatencyCurves.from_rows(rows(with_ci=False, source="predicted")), [1] * 90 + [4096] * 10)
    assert all(r.interval is None for r in v.results)
    assert v.interval_method.startswith("none: predicted rows carry no interval")
    assert v.text().splitlines()[0].startswith("PREDICTED")


def test_requests_get_ttft_and_tpot_per_policy():
    traffic = Traffic.of([Request(0, 64, 3), Request(0, 1, 5)])
    v = evaluate(LatencyCurves.from_rows(rows()), traffic, limits=SchedulerLimits(4096, 8))
    r = v.result("baseline")
    # step 1: 65 prompt tokens (64 + 1) priced between the rows at 64 and 4096; then decode steps of 2 and 1 tokens
    assert r.output_tokens == 8 and r.ttft is not None and r.tpot is not None
    assert r.steps == 1 + 4


def test_standard_policies_reuse_the_programs():
    names = [p.name for p in standard_policies(512, variants={"baseline", "sp", "sp+async_tp", "tuned"})]
    assert [p.name for p in standard_policies(None, variants={"baseline", "sp+async_tp"})] == [
        "baseline", "sp+async_tp always", "sp+async_tp never (baseline at every step)"]
    assert names == ["baseline", "sp", "sp+async_tp always", "sp+async_tp from 512", "per-matmul rule",
                     "draft: per-matmul rule from 128"]
    draft = standard_policies(512, variants={"baseline", "sp", "sp+async_tp", "tuned"})[-1]
    assert (draft.variant_at(127), draft.variant_at(128)) == ("baseline", "tuned")


def test_predicted_grid_is_fine_at_decode_sizes_and_reaches_the_budget():
    grid = predicted_token_grid(8192)
    assert grid[:64] == list(range(1, 65)) and grid[-1] == 8192
    assert all(b / a <= 2 ** (1 / 8) + 0.01 for a, b in itertools.pairwise(grid[63:]))


def test_a_regret_weighted_by_traffic_counts_the_time_spent_at_each_size():
    from sp_lab.serving.scheduler import StepPrice
    from sp_lab.serving.verdict import count_weights
    from sp_lab.tuning.regret import traffic_regret

    # 90 one-token steps of 10 us and 10 steps of 4096 tokens of 910 us: 900 and 9100 us, shares 0.09 and 0.91
    price = StepPrice(tuple([0.0, 10.0] + [910.0] * 4095))
    sched = replay_steps([1] * 90 + [4096] * 10, price)
    weights = count_weights(sched, [1, 64, 4096])
    assert weights == pytest.approx({1: 0.09, 64: 0.0, 4096: 0.91})
    # a step of 2080 tokens lies halfway between 64 and 4096: its time splits evenly
    assert count_weights(replay_steps([2080], price), [64, 4096]) == pytest.approx({64: 0.5, 4096: 0.5})
    table = pl.DataFrame({"num_tokens": [1, 64, 4096], "regret_rel": [0.5, 0.3, 0.0]})
    # the config loses 50% at one token and nothing at 4096; the traffic spends 9% of its time at one token
    assert traffic_regret(table, weights) == pytest.approx(0.09 * 0.5)
    with pytest.raises(ValueError, match=r"steps of \[4096\] tokens lie outside the counts 1..64"):
        count_weights(sched, [1, 64])


def test_predicted_rows_are_the_rows_the_predict_command_prints(monkeypatch):
    """The adapter skips the crossovers ``advice.predict`` also computes; its rows must stay that command's rows and
    those of ``step_latency_rows`` (if the performance model changes how it makes them, this fails and the adapter
    follows). The crossovers are stubbed here: they re-predict a fine grid seven times and are not compared."""
    from sp_lab.serving.step_costs import predicted_rows
    from sp_lab.tuning.predict import advice
    from sp_lab.tuning.predict.advice import predict

    monkeypatch.setattr(advice, "predicted_crossover", lambda *args, **kwargs: None)
    predicted_rows.cache_clear()
    ours = predicted_rows("llama-2-7b", 2, "h100", max_tokens=12)
    theirs = predict("llama-2-7b", 2, "h100", tokens=list(range(1, 13))).rows
    assert ours.sort("num_tokens", "variant").equals(theirs.sort("num_tokens", "variant"))
    # and the performance model's public per-step rows (reference variants; it has no tuned curve)
    from sp_lab.tuning.predict.steps import step_latency_rows

    steps = step_latency_rows("llama-2-7b", 2, "h100", "bfloat16", [1, 5, 12]).select("num_tokens", "variant",
                                                                                    "latency_us")
    mine = ours.filter(pl.col("num_tokens").is_in([1, 5, 12]) & (pl.col("variant") != "tuned"))
    assert mine.select(steps.columns).sort("num_tokens", "variant").equals(steps.sort("num_tokens", "variant"))
    assert set(ours["source"]) == {"predicted"}
    with pytest.raises(ValueError, match="tp=16: predictions model one 8-GPU board"):
        predicted_rows("llama-3-70b", 16, "h200")
