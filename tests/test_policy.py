"""The one regret (sp_lab.tuning.regret) and noise-aware policy recommendations (sp_lab.tuning.policy)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from sp_lab.bench.timing import median_ci
from sp_lab.config import LabConfig
from sp_lab.tuning.policy import Policy, candidate_policies, recommend, threshold_text
from sp_lab.tuning.regret import REGRET_COLUMNS, medians, regret_table, variant_run

TOKENS = [16, 64, 128, 256, 512, 1024]


def noisy_rows(latency: dict, *, noise: float = 0.02, samples: int = 30, seed: int = 0) -> pl.DataFrame:
    """Rows as a sweep writes them: each the median of ``samples`` calls with relative ``noise``, and its CI."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in TOKENS:
        for variant, mean in latency.items():
            calls = list(mean(t) * (1 + noise * rng.standard_normal(samples)))
            lo, hi = median_ci(calls)
            rows.append({"num_tokens": t, "variant": variant, "latency_us": float(np.median(calls)),
                         "ci_low_us": lo, "ci_high_us": hi, "source": "measured"})
    return pl.DataFrame(rows)


# baseline = 100 + t, fused = 200 + t/2: they cross at t = 200 (fusion wins from 256 on); sp never wins
CROSSING = {"baseline": lambda t: 100.0 + t, "sp": lambda t: 150.0 + t, "sp+async_tp": lambda t: 200.0 + 0.5 * t}


def test_regret_table_needs_only_tokens_variant_latency():
    rows = [{"num_tokens": t, "variant": v, "latency_us": f(t)} for t in TOKENS for v, f in CROSSING.items()]
    table = regret_table(rows, LabConfig(async_tp_min_tokens=64))  # fuses too early at 64 and 128
    assert table.columns == list(REGRET_COLUMNS)
    assert table["variant_run"].to_list() == ["baseline"] + ["sp+async_tp"] * 5
    assert table["best_variant"].to_list() == ["baseline"] * 3 + ["sp+async_tp"] * 3
    assert table["regret_rel"].to_list() == pytest.approx([0, 232 / 164 - 1, 264 / 228 - 1, 0, 0, 0])


def test_regret_is_against_the_fastest_variant_at_each_token_count_not_the_baseline():
    # At 16 tokens sp is fastest, at 256 sp+async_tp; baseline is never the best.
    latency = {(16, "baseline"): 100.0, (16, "sp"): 80.0, (16, "sp+async_tp"): 120.0,
               (256, "baseline"): 400.0, (256, "sp"): 380.0, (256, "sp+async_tp"): 300.0}
    rows = [{"num_tokens": t, "variant": v, "latency_us": us} for (t, v), us in latency.items()]
    never = regret_table(rows, LabConfig(enable_sp=False, enable_async_tp=False))
    assert never["variant_run"].to_list() == ["baseline", "baseline"]
    assert never["best_variant"].to_list() == ["sp", "sp+async_tp"]
    assert never["best_us"].to_list() == [80.0, 300.0]
    assert never["regret_rel"].to_list() == pytest.approx([(100 - 80) / 80, (400 - 300) / 300])
    fused = regret_table(rows, LabConfig(async_tp_min_tokens=16))  # sp+async_tp at both token counts
    assert fused["regret_rel"].to_list() == pytest.approx([(120 - 80) / 80, 0.0])


def test_repeated_rows_of_a_point_pool_by_their_median():
    """Three sweeps measured each point; one of them was disturbed at 16 tokens (a 10x slower baseline row)."""
    latency = {(16, "baseline"): [100.0, 104.0, 1000.0], (16, "sp+async_tp"): [120.0, 121.0, 119.0],
               (256, "baseline"): [400.0, 396.0, 410.0], (256, "sp+async_tp"): [300.0, 3000.0, 306.0]}
    rows = [{"num_tokens": t, "variant": v, "latency_us": us} for (t, v), runs in latency.items() for us in runs]
    pooled = medians(rows)
    assert pooled["n"].to_list() == [3, 3, 3, 3]
    assert pooled["latency_us"].to_list() == [104.0, 120.0, 400.0, 306.0]  # medians, not means (368, 1202)
    table = regret_table(rows, LabConfig(async_tp_min_tokens=16))
    assert table["best_variant"].to_list() == ["baseline", "sp+async_tp"]
    assert table["regret_rel"].to_list() == pytest.approx([(120 - 104) / 104, 0.0])


def test_what_a_config_runs_follows_its_gates():
    assert variant_run(LabConfig(enable_sp=False, enable_async_tp=False), 4096) == "baseline"
    assert variant_run(LabConfig(async_tp_min_tokens=64, enable_async_tp=False), 64) == "sp"
    two = LabConfig(sp_min_tokens=16, async_tp_min_tokens=256)
    assert [variant_run(two, t) for t in (8, 16, 255, 256)] == ["baseline", "sp", "sp", "sp+async_tp"]
    assert variant_run(LabConfig(tp_size=1), 4096) == "baseline"  # nothing to rewrite with one rank


def test_fusion_missing_rows_never_count_and_sources_never_mix():
    rows = pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": f(t), "source": "measured",
                          "fusion_missing": False} for t in TOKENS for v, f in CROSSING.items()])
    fake = rows.filter(pl.col("num_tokens") == 1024, pl.col("variant") == "sp").with_columns(
        latency_us=pl.lit(1.0), fusion_missing=pl.lit(True))
    with pytest.warns(UserWarning, match="fusion did not fire"):
        table = regret_table(pl.concat([rows, fake]), LabConfig(async_tp_min_tokens=256))
    assert table.filter(pl.col("num_tokens") == 1024)["best_us"].item() == 712.0
    with pytest.raises(ValueError, match="mix sources"):
        regret_table(pl.concat([rows, rows.with_columns(source=pl.lit("rehearsal"))]), LabConfig())
    with pytest.raises(ValueError, match=r"runs \['sp'\] .* no rows of \['sp'\]"):
        regret_table(rows.filter(pl.col("variant") != "sp"), LabConfig(enable_async_tp=False))


def test_policies_map_to_configs_and_back():
    base = LabConfig(tp_size=2)
    for policy in candidate_policies(TOKENS, ["baseline", "sp", "sp+async_tp"], thresholds=2):
        config = policy.to_config(base)
        assert Policy.of(config) == policy, policy.name
        assert all(variant_run(config, t) == policy.variant_at(t) for t in TOKENS), policy.name
    assert Policy.gate("baseline", "sp+async_tp", None).name == "baseline everywhere (SP and AsyncTP never)"
    with pytest.raises(ValueError, match="move to more rewriting variants"):
        Policy(((1, "sp+async_tp"), (64, "baseline")))


@pytest.mark.parametrize("seed", range(5))
def test_a_clear_crossing_gives_the_same_recommendation_under_noise(seed):
    rec = recommend(noisy_rows(CROSSING, seed=seed), LabConfig())
    assert rec.policy.name == "baseline below 256, sp+async_tp from 256"
    assert not rec.ambiguous and rec.worst_regret == pytest.approx(0.0, abs=0.01)
    assert rec.total_interval[0] <= rec.total_regret <= rec.total_interval[1]
    assert rec.table.equals(regret_table(noisy_rows(CROSSING, seed=seed), rec.config))  # the one regret


@pytest.mark.parametrize("seed", range(5))
def test_equal_variants_are_reported_not_distinguishable_and_the_least_rewriting_wins(seed):
    same = {"baseline": lambda t: 100.0 + t, "sp+async_tp": lambda t: 100.0 + t}
    rec = recommend(noisy_rows(same, seed=seed), LabConfig())
    assert rec.ambiguous and "not distinguishable" in rec.noise_line()
    assert rec.policy.name == "baseline everywhere (SP and AsyncTP never)"  # rewrites nothing
    assert not rec.config.enable_sp and rec.threshold is None
    assert rec.to_dict()["async_tp_min_tokens"] == "never"


def test_the_recommendations_async_tp_min_tokens_is_where_its_config_fuses():
    """Not the policy's first switch: "sp+async_tp everywhere" fuses from 1 token, "baseline below 64, sp from 64"
    never fuses; tune --json and an exported file's provenance must say the same as the config itself."""
    everywhere = {"baseline": lambda t: 100.0 + t, "sp+async_tp": lambda t: 0.5 * (100.0 + t)}
    staged = {"baseline": lambda t: 100.0 + t, "sp": lambda t: (100.0 + t) * (1.2 if t < 64 else 0.8),
              "sp+async_tp": lambda t: (100.0 + t) * 1.5}
    for latency, name, written in ((everywhere, "sp+async_tp everywhere", 1),
                                   (staged, "baseline below 64, sp from 64", "never"),
                                   (CROSSING, "baseline below 256, sp+async_tp from 256", 256)):
        rows = [{"num_tokens": t, "variant": v, "latency_us": f(t)} for t in TOKENS for v, f in latency.items()]
        rec = recommend(rows, LabConfig())
        assert rec.policy.name == name
        assert rec.to_dict()["async_tp_min_tokens"] == written
        assert threshold_text(rec.config) == str(written)  # what `tune` prints and the provenance records


def test_thresholds_within_noise_are_named_and_the_later_one_is_chosen():
    # fusion wins by 10% from 256 on and is within 0.5% of baseline at 64 and 128: 64, 128 and 256 all fit
    near = {"baseline": lambda t: 100.0 + t,
            "sp+async_tp": lambda t: (100.0 + t) * (1.3 if t < 64 else 1.005 if t < 256 else 0.9)}
    rec = recommend(noisy_rows(near, noise=0.03, seed=1), LabConfig())
    assert rec.ambiguous and rec.policy.threshold == 256
    assert "and 256 (baseline -> sp+async_tp) are not distinguishable" in rec.noise_line()


def test_without_noise_information_the_choice_says_so():
    rows = [{"num_tokens": t, "variant": v, "latency_us": f(t)} for t in TOKENS for v, f in CROSSING.items()]
    rec = recommend(rows, LabConfig())
    assert not rec.noise_known and "ignores noise" in rec.noise_line()
    assert rec.policy.threshold == 256


def test_a_second_threshold_is_reported_with_its_gain():
    # sp pays from 64, sp+async_tp from 512: one threshold cannot express it
    staged = {"baseline": lambda t: 100.0 + t,
              "sp": lambda t: (100.0 + t) * (1.2 if t < 64 else 0.9),
              "sp+async_tp": lambda t: (100.0 + t) * (1.5 if t < 512 else 0.7)}
    rec = recommend(noisy_rows(staged, noise=0.01), LabConfig())
    second = rec.second_threshold
    assert second.policy.name == "baseline below 64, sp from 64, sp+async_tp from 512"
    assert second.gain > 0.1 and second.beyond_noise
    assert "a second threshold (baseline below 64, sp from 64, sp+async_tp from 512)" in rec.describe()
    config = second.policy.to_config(LabConfig())
    assert (config.sp_min_tokens, config.async_tp_min_tokens) == (64, 512)  # LabConfig runs it; vLLM cannot


def test_a_second_threshold_inside_the_noise_is_said_to_be_within_it():
    """The same medians (sp 3% faster than baseline from 64 on, sp+async_tp 30% from 512), so the same gain, with
    95% intervals of +-1% and of +-5%: only the resamples can tell the two verdicts apart."""
    staged = {"baseline": lambda t: 100.0 + t, "sp": lambda t: (100.0 + t) * (1.2 if t < 64 else 0.97),
              "sp+async_tp": lambda t: (100.0 + t) * (1.5 if t < 512 else 0.7)}

    def rows(width: float) -> pl.DataFrame:
        return pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": f(t), "ci_low_us": f(t) * (1 - width),
                              "ci_high_us": f(t) * (1 + width), "source": "measured"}
                             for t in TOKENS for v, f in staged.items()])

    tight, wide = recommend(rows(0.01), LabConfig()), recommend(rows(0.05), LabConfig())
    for rec in (tight, wide):
        assert rec.policy.name == "baseline below 512, sp+async_tp from 512"
        assert rec.second_threshold.policy.name == "baseline below 64, sp from 64, sp+async_tp from 512"
    # From the medians alone: the one-threshold policy runs baseline at 64, 128 and 256, where sp is 1/0.97 faster
    assert tight.second_threshold.gain == pytest.approx(wide.second_threshold.gain) == pytest.approx(
        3 * (1 / 0.97 - 1), rel=1e-6)
    assert tight.second_threshold.beyond_noise and "9.3 points (beyond noise)" in tight.describe()
    assert not wide.second_threshold.beyond_noise and "9.3 points (within noise)" in wide.describe()
    assert wide.to_dict()["second_threshold"]["beyond_noise"] is False


def test_what_a_recommendation_says_and_exports():
    """The summary, the noise line, the second threshold and the exported dict of one recommendation, against the
    medians worked by hand: baseline below 512 runs baseline at 64, 128 and 256 where sp is 1/0.97 faster."""
    import re

    staged = {"baseline": lambda t: 100.0 + t, "sp": lambda t: (100.0 + t) * (1.2 if t < 64 else 0.97),
              "sp+async_tp": lambda t: (100.0 + t) * (1.5 if t < 512 else 0.7)}
    rows = pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": f(t), "ci_low_us": f(t) * 0.95,
                          "ci_high_us": f(t) * 1.05, "source": "measured"} for t in TOKENS for v, f in staged.items()])
    rec = recommend(rows, LabConfig(), n_boot=200)
    step = 1 / 0.97 - 1  # 3.1%
    name = "baseline below 512, sp+async_tp from 512"
    match = re.fullmatch(rf"{re.escape(name)}: worst regret 3\.1% \(95% interval (\S+)-(\S+)%\), summed over the token "
                         rf"counts 9\.3% \((\S+)-(\S+)%\)", rec.summary())
    assert match, rec.summary()
    worst_lo, worst_hi, total_lo, total_hi = (float(x) / 100 for x in match.groups())
    assert worst_lo <= step <= worst_hi and total_lo <= 3 * step <= total_hi
    assert rec.noise_line() == ("512 (baseline -> sp+async_tp) and 512 (sp -> sp+async_tp) are not distinguishable "
                                f"at this noise (200 resamples); chose {name} (it rewrites least)")
    assert rec.describe().splitlines() == [rec.summary(), rec.noise_line(), (
        "a second threshold (baseline below 64, sp from 64, sp+async_tp from 512) would lower the summed regret by "
        "9.3 points (within noise)")]
    exported = rec.to_dict()
    assert exported["policy"] == {"name": name, "steps": [[1, "baseline"], [512, "sp+async_tp"]], "threshold": 512}
    assert exported["async_tp_min_tokens"] == 512 and exported["resamples"] == 200
    assert exported["worst_regret"] == pytest.approx(step) and exported["total_regret"] == pytest.approx(3 * step)
    assert exported["worst_regret_95"] == pytest.approx([worst_lo, worst_hi], abs=5e-4)
    assert exported["total_regret_95"] == pytest.approx([total_lo, total_hi], abs=5e-4)
    assert exported["not_distinguishable"] == ["sp below 512, sp+async_tp from 512"]
    assert exported["noise"] == rec.noise_line()
    assert exported["second_threshold"] == {"policy": "baseline below 64, sp from 64, sp+async_tp from 512",
                                            "gain": pytest.approx(3 * step), "beyond_noise": False}
    never = recommend([{"num_tokens": t, "variant": v, "latency_us": 100.0 if v == "baseline" else 200.0}
                       for t in TOKENS for v in ("baseline", "sp+async_tp")], LabConfig())
    assert never.to_dict()["async_tp_min_tokens"] == "never" and never.to_dict()["second_threshold"] is None
    assert never.describe().splitlines()[1:] == ["the rows carry no interval: the choice ignores noise"]


def test_policies_the_noise_cannot_tell_apart_are_listed_in_few_words():
    """One phrase per shape, thresholds sorted ("64, 128 and 256 (baseline -> sp+async_tp)"), constants by name;
    two items joined by "and", three or more by "; " and a final "; and"."""
    from sp_lab.tuning.policy import _list_policies

    def switch(first: str, at: int) -> Policy:
        return Policy(((1, first), (at, "sp+async_tp")))

    never = Policy.constant("baseline")
    assert _list_policies([switch("baseline", 256), switch("baseline", 64)]) == "64 and 256 (baseline -> sp+async_tp)"
    assert _list_policies([switch("baseline", 256), never]) == (
        "256 (baseline -> sp+async_tp) and baseline everywhere (SP and AsyncTP never)")
    assert _list_policies([switch("baseline", 256), switch("baseline", 64), switch("baseline", 128),
                           switch("sp", 128), never]) == (
        "64, 128 and 256 (baseline -> sp+async_tp); 128 (sp -> sp+async_tp); "
        "and baseline everywhere (SP and AsyncTP never)")


def test_recommend_says_what_to_measure():
    with pytest.raises(ValueError, match="needs 'baseline' and at least one of"):
        recommend([{"num_tokens": 8, "variant": "sp", "latency_us": 1.0}], LabConfig())


def test_rows_written_before_intervals_use_their_spread(tmp_path):
    """A version-1 store part (no ci columns) still reads, and its p10-p90 spread stands in for the interval."""
    from test_store import make_row

    from sp_lab.bench.store import SweepStore

    store = SweepStore(tmp_path)
    store.append([make_row(t, variant=v, reported_variant=v, latency_us=f(t), config_hash=v, p10_us=0.9 * f(t),
                           p90_us=1.1 * f(t), repeats=9) for t in TOKENS for v, f in CROSSING.items()])
    (part,) = store.parts()
    old = pl.read_parquet(part).drop("ci_low_us", "ci_high_us").with_columns(schema_version=pl.lit(1, pl.Int32))
    old.write_parquet(part)
    rows = store.read()
    assert rows["ci_low_us"].null_count() == rows.height  # read, with the new columns null
    rec = recommend(rows, LabConfig())
    assert rec.noise_known and rec.policy.threshold == 256


def test_every_candidate_is_scored_on_the_medians_and_the_best_found():
    """No intervals: every resample equals the medians. Fusion wins by 10 us at 16 tokens, loses 10 us at 64 and wins
    100 us at 256, so no one-threshold policy follows the best variant everywhere; sp+async_tp everywhere loses least
    (10/200 at 64), and it is the only policy as good as itself."""
    latency = {(16, "baseline"): 100.0, (16, "sp+async_tp"): 90.0, (64, "baseline"): 200.0,
               (64, "sp+async_tp"): 210.0, (256, "baseline"): 400.0, (256, "sp+async_tp"): 300.0}
    rows = [{"num_tokens": t, "variant": v, "latency_us": us} for (t, v), us in latency.items()]
    rec = recommend(rows, LabConfig())
    assert rec.best == rec.policy == Policy.constant("sp+async_tp") and rec.indistinguishable == (rec.policy,)
    assert (rec.total_regret, rec.worst_regret) == pytest.approx((0.05, 0.05))
    assert rec.total_interval == rec.worst_interval == pytest.approx((0.05, 0.05))  # no noise: no spread
    assert rec.table["regret_rel"].to_list() == pytest.approx([0.0, 0.05, 0.0])
    assert rec.second_threshold is None and rec.n_boot == 400  # no sp rows: no two-threshold policy
    c = rec.candidates
    assert c.columns == ["policy", "thresholds", "total_regret", "worst_regret", "rewrites", "p_as_good",
                         "distinguishable"]
    assert c["policy"].to_list() == ["baseline everywhere (SP and AsyncTP never)", "sp+async_tp everywhere",
                                     "baseline below 64, sp+async_tp from 64", "baseline below 256, sp+async_tp from 256"]
    assert c["thresholds"].to_list() == ["never", "never", "64", "256"]
    assert c["total_regret"].to_list() == pytest.approx([10 / 90 + 100 / 300, 10 / 200, 10 / 90 + 10 / 200, 10 / 90])
    assert c["worst_regret"].to_list() == pytest.approx([100 / 300, 10 / 200, 10 / 90, 10 / 90])
    assert c["rewrites"].to_list() == [0, 6, 4, 2]
    assert c["p_as_good"].to_list() == [0.0, 1.0, 0.0, 0.0]
    assert c["distinguishable"].to_list() == [True, False, True, True]


def test_a_policy_reads_the_source_asked_for_and_refuses_a_mix():
    """Measured rows cross at 256; simulated rows of the same setup say fusion wins everywhere. Pooled unlabelled
    they would give neither answer."""
    measured = pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": f(t), "source": "measured"}
                             for t in TOKENS for v, f in CROSSING.items()])
    simulated = measured.with_columns(
        source=pl.lit("simulated"),
        latency_us=pl.when(pl.col("variant") == "sp+async_tp").then(pl.col("latency_us") / 10).otherwise(
            pl.col("latency_us")))
    both = pl.concat([measured, simulated])
    with pytest.raises(ValueError, match=r"rows mix sources \['measured', 'simulated'\]"):
        recommend(both, LabConfig())
    rec = recommend(both, LabConfig(), source="measured")
    assert rec.policy.name == "baseline below 256, sp+async_tp from 256"
    assert rec.table.equals(regret_table(measured, rec.config))  # the table of the same rows
    assert recommend(both, LabConfig(), source="simulated").policy.name == "sp+async_tp everywhere"


def test_a_policy_without_the_rows_it_needs_says_which_rows_there_are():
    def rows(points: dict[str, list[int]]) -> list[dict]:
        return [{"num_tokens": t, "variant": v, "latency_us": 100.0} for v, ts in points.items() for t in ts]

    needs = "a policy needs 'baseline' and at least one of 'sp' / 'sp+async_tp' measured at the same token counts; "
    for points, have in (({"sp": [8]}, "sp at [8]"),
                         ({"baseline": [8, 16]}, "baseline at [8, 16]"),
                         ({"baseline": [16, 8], "sp+async_tp": [32]}, "baseline at [8, 16]; sp+async_tp at [32]"),
                         ({"tuned": [8]}, "no reference variant")):
        with pytest.raises(ValueError) as refused:
            recommend(rows(points), LabConfig())
        assert str(refused.value) == needs + "the rows have " + have


def test_a_policy_refuses_rows_of_two_setups():
    rows = pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": f(t), "dtype": dtype}
                         for t in TOKENS for v, f in CROSSING.items() for dtype in ("bfloat16", "float8")])
    with pytest.raises(ValueError, match="rows of 2 setups .*: a policy is made for one setup"):
        recommend(rows, LabConfig())


def test_the_noise_of_small_latencies_is_noise_too():
    """Kernels of tens of microseconds have standard errors well below 1 us: still noise, still resampled."""
    small = {"baseline": lambda t: 1.0 + t / 100, "sp": lambda t: 1.5 + t / 100, "sp+async_tp": lambda t: 2.0 + t / 200}
    rows = noisy_rows(small, seed=3)  # CROSSING / 100
    assert (rows["ci_high_us"] - rows["ci_low_us"]).max() < 1.0
    rec = recommend(rows, LabConfig())
    assert rec.noise_known and rec.noise_line() == "no other one-threshold policy is within noise (400 resamples)"


def test_every_two_threshold_candidate_is_scored_beside_the_one_threshold_ones():
    """Medians without intervals: sp pays from 64, sp+async_tp from 512 (the staged rows of the second-threshold
    test). The two-threshold policies are scored in the same table, their thresholds listed "64,512"."""
    staged = {"baseline": lambda t: 100.0 + t, "sp": lambda t: (100.0 + t) * (1.2 if t < 64 else 0.9),
              "sp+async_tp": lambda t: (100.0 + t) * (1.5 if t < 512 else 0.7)}
    rows = [{"num_tokens": t, "variant": v, "latency_us": f(t)} for t in TOKENS for v, f in staged.items()]
    rec = recommend(rows, LabConfig())
    c = rec.candidates
    singles = c.filter(pl.col("thresholds").str.count_matches(",") == 0)
    doubles = c.filter(pl.col("thresholds").str.count_matches(",") == 1)
    assert singles.height == 3 + 3 * 5 and doubles.height == 10  # 3 constants, 3 pairs x 5 switches; C(5, 2)
    best = doubles.filter(pl.col("policy") == "baseline below 64, sp from 64, sp+async_tp from 512").row(0, named=True)
    assert best["thresholds"] == "64,512" and best["total_regret"] == pytest.approx(0.0)
    assert best["rewrites"] == 3 * 1 + 2 * 2 and best["p_as_good"] == 1.0 and not best["distinguishable"]
    # every other one loses somewhere; as good as the best one-threshold policy (sp below 512, fused from 512: it
    # loses 20% at 16 tokens) in every resample, or in none (the resamples equal the medians)
    assert singles.sort("total_regret").row(0, named=True)["total_regret"] == pytest.approx(0.2)
    others = doubles.filter(pl.col("policy") != best["policy"])
    assert (others["total_regret"] > 0).all()
    assert others["p_as_good"].to_list() == [float(t <= 0.2 + 1e-9) for t in others["total_regret"]]
    assert others["distinguishable"].to_list() == [t > 0.2 + 1e-9 for t in others["total_regret"]]
    assert rec.second_threshold.gain == pytest.approx(rec.total_regret) and rec.second_threshold.beyond_noise


def test_the_candidates_scores_are_the_medians_scores_not_a_resamples():
    """With noise, the candidates table and the chosen policy's regret still come from the medians themselves, and
    the regret's intervals from the resamples (sp 3% faster than baseline from 64 on, fusion 30% from 512: the
    chosen one-threshold policy loses 3% at 64, 128 and 256)."""
    staged = {"baseline": lambda t: 100.0 + t, "sp": lambda t: (100.0 + t) * (1.2 if t < 64 else 0.97),
              "sp+async_tp": lambda t: (100.0 + t) * (1.5 if t < 512 else 0.7)}
    rows = pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": f(t), "ci_low_us": f(t) * 0.95,
                          "ci_high_us": f(t) * 1.05} for t in TOKENS for v, f in staged.items()])
    rec = recommend(rows, LabConfig())
    assert rec.total_interval[0] < rec.total_regret < rec.total_interval[1]
    assert rec.worst_interval[0] < rec.worst_regret < rec.worst_interval[1]
    again = recommend(rows, LabConfig())  # the resamples are seeded: the same rows, the same intervals
    assert (again.total_interval, again.worst_interval) == (rec.total_interval, rec.worst_interval)
    chosen = rec.candidates.filter(pl.col("policy") == rec.policy.name).row(0, named=True)
    assert chosen["total_regret"] == pytest.approx(rec.total_regret)
    assert chosen["worst_regret"] == pytest.approx(rec.worst_regret)
    # the best is the best on the medians, also where the noise reorders the policies in many resamples
    for seed in range(5):
        near = recommend(noisy_rows({"baseline": lambda t: 100.0 + t, "sp+async_tp": lambda t: 100.0 + t}, seed=seed),
                         LabConfig())
        singles = near.candidates.filter(pl.col("thresholds").str.count_matches(",") == 0)
        assert near.best.name == singles.sort("total_regret", "worst_regret", "rewrites")["policy"][0]
    # identical medians (and intervals): every policy ties on the medians, and the tie goes to the least rewriting
    tied = pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": 100.0 + t, "ci_low_us": 95.0 + t,
                          "ci_high_us": 105.0 + t} for t in TOKENS for v in ("baseline", "sp+async_tp")])
    assert all(recommend(tied, LabConfig(), seed=seed).best == Policy.constant("baseline") for seed in range(4))


def test_rows_whose_fusion_did_not_fire_are_warned_about_once():
    import warnings

    rows = pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": f(t), "fusion_missing": False}
                         for t in TOKENS for v, f in CROSSING.items()])
    fake = rows.filter(pl.col("num_tokens") == 1024, pl.col("variant") == "sp+async_tp").with_columns(
        latency_us=pl.lit(1.0), fusion_missing=pl.lit(True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = recommend(pl.concat([rows, fake]), LabConfig())
    assert [str(w.message).split(" were ")[0] for w in caught] == ["1 row(s) whose expected fusion did not fire"]
    assert rec.policy.name == "baseline below 256, sp+async_tp from 256"


def test_a_tie_goes_to_the_variant_rewriting_less_and_only_reference_variants_compete():
    """At 16 tokens all three reference variants tie, at 64 sp and sp+async_tp; a tuned row faster than all of them
    is not a reference and never "the fastest variant"; at 256 sp was not measured, so that count is left out."""
    latency = {(16, "baseline"): 100.0, (16, "sp"): 100.0, (16, "sp+async_tp"): 100.0, (16, "tuned"): 1.0,
               (64, "baseline"): 300.0, (64, "sp"): 200.0, (64, "sp+async_tp"): 200.0, (64, "tuned"): 1.0,
               (256, "baseline"): 500.0, (256, "sp+async_tp"): 400.0}
    rows = [{"num_tokens": t, "variant": v, "latency_us": us} for (t, v), us in latency.items()]
    table = regret_table(rows, LabConfig(async_tp_min_tokens=16))
    assert table["num_tokens"].to_list() == [16, 64]
    assert table["best_variant"].to_list() == ["baseline", "sp"]
    assert table["best_us"].to_list() == [100.0, 200.0] and table["regret_rel"].to_list() == [0.0, 0.0]


def test_a_regret_summed_and_at_its_worst():
    from sp_lab.tuning.regret import summarize

    rows = [{"num_tokens": t, "variant": v, "latency_us": f(t)} for t in TOKENS for v, f in CROSSING.items()]
    one = regret_table(rows, LabConfig(async_tp_min_tokens=64)).filter(pl.col("num_tokens") == 64)
    assert summarize(one) == pytest.approx((232 / 164 - 1, 232 / 164 - 1))
    empty = summarize(one.clear())
    assert all(np.isnan(x) for x in empty)


def test_a_traffic_regret_weighs_each_count_by_its_share_of_the_weights_on_the_table():
    """Weights need not sum to one (they are normalised over the table's counts); a count outside the table carries
    no weight; no weight on the table's counts: no answer (nan), never a silent zero."""
    from sp_lab.tuning.regret import traffic_regret

    table = pl.DataFrame({"num_tokens": [1, 64, 4096], "regret_rel": [0.5, 0.3, 0.0]})
    assert traffic_regret(table, {1: 2.0, 64: 6.0}) == pytest.approx((2 * 0.5 + 6 * 0.3) / 8)
    assert traffic_regret(table, {1: 1.0, 8: 100.0, 4096: 1.0}) == pytest.approx(0.25)
    assert traffic_regret(table, {1: 0.25, 64: 0.25}) == pytest.approx(0.4)  # weights summing to less than one
    assert np.isnan(traffic_regret(table, {8: 1.0}))
    assert np.isnan(traffic_regret(table, {1: 0.0, 64: 0.0}))
    assert np.isnan(traffic_regret(table, {}))  # a traffic with no steps


def test_alpha_is_at_least_for_the_choice_and_more_than_for_the_second_threshold():
    """``alpha`` at its edge, 0: every policy is as good as the best in at least 0% of the resamples, so none can be
    ruled out (none distinguishable) and the least rewriting one runs; a second threshold's saving never holds in
    more than 100% of them, so it is never beyond noise."""
    staged = {"baseline": lambda t: 100.0 + t, "sp": lambda t: (100.0 + t) * (1.2 if t < 64 else 0.9),
              "sp+async_tp": lambda t: (100.0 + t) * (1.5 if t < 512 else 0.7)}
    rows = noisy_rows(staged, noise=0.01)
    strict = recommend(rows, LabConfig())
    assert strict.second_threshold.beyond_noise and strict.candidates["distinguishable"].any()
    edge = recommend(rows, LabConfig(), alpha=0.0)
    assert edge.policy.name == "baseline everywhere (SP and AsyncTP never)"
    assert not edge.candidates["distinguishable"].any()
    assert not edge.second_threshold.beyond_noise


def test_the_second_threshold_is_the_best_on_the_medians_and_a_zero_gain_is_no_gain():
    """sp is 3% faster than baseline from 128 on and 0.2% at 64: with 5% noise the resamples reorder the
    two-threshold policies switching to sp at 64 and at 128; the one reported is the best on the medians."""
    near = {"baseline": lambda t: 100.0 + t,
            "sp": lambda t: (100.0 + t) * (1.2 if t < 64 else 0.998 if t < 128 else 0.97),
            "sp+async_tp": lambda t: (100.0 + t) * (1.5 if t < 512 else 0.7)}
    for seed in range(3):
        rec = recommend(noisy_rows(near, noise=0.05, seed=seed), LabConfig())
        doubles = rec.candidates.filter(pl.col("thresholds").str.count_matches(",") == 1).sort("total_regret")
        assert rec.second_threshold.policy.name == doubles["policy"][0]
        chosen = rec.candidates.filter(pl.col("policy") == rec.policy.name)["total_regret"][0]
        assert rec.second_threshold.gain == pytest.approx(chosen - doubles["total_regret"][0])
    # sp exactly as fast as baseline from 64 on: running it there gains nothing, and is not "beyond noise"
    same = {"baseline": lambda t: 100.0 + t, "sp": lambda t: (100.0 + t) * (1.2 if t < 64 else 1.0),
            "sp+async_tp": lambda t: (100.0 + t) * (1.5 if t < 512 else 0.7)}
    flat = recommend([{"num_tokens": t, "variant": v, "latency_us": f(t)} for t in TOKENS for v, f in same.items()],
                     LabConfig())
    assert flat.second_threshold.gain == 0.0 and not flat.second_threshold.beyond_noise
    tie = flat.candidates.filter(pl.col("policy") == flat.second_threshold.policy.name).row(0, named=True)
    assert tie["total_regret"] == 0.0 and tie["p_as_good"] == 1.0 and not tie["distinguishable"]  # as good as the best
    assert flat.describe().splitlines()[-1] == "a second threshold would gain nothing"


def test_a_regret_table_of_one_token_count_and_of_none():
    """One count measured by every variant: one row. No count measured by every variant (a sweep just started):
    an empty table with the regret's columns and types, so every view can still read it."""
    rows = [{"num_tokens": 64, "variant": v, "latency_us": f(64)} for v, f in CROSSING.items()]
    one = regret_table(rows, LabConfig(async_tp_min_tokens=64))
    assert one["num_tokens"].to_list() == [64] and one["regret_rel"].to_list() == pytest.approx([232 / 164 - 1])
    started = regret_table([rows[0], {**rows[1], "num_tokens": 16}], LabConfig())
    assert started.height == 0 and started.schema == pl.Schema(
        {"num_tokens": pl.Int64, "variant_run": pl.String, "latency_us": pl.Float64, "best_variant": pl.String,
         "best_us": pl.Float64, "regret_rel": pl.Float64})


def test_rows_of_one_source_are_chosen_by_name_or_by_preference_and_refused_naming_what_there_is():
    from sp_lab.tuning.regret import as_frame, one_source

    rows = pl.DataFrame({"num_tokens": [1, 1, 1], "variant": ["baseline"] * 3, "latency_us": [1.0, 2.0, 3.0],
                         "source": ["measured", "rehearsal", "replayed"]})
    assert one_source(rows, "rehearsal")["latency_us"].to_list() == [2.0]
    assert one_source(rows, prefer=("predicted", "replayed", "measured"))["latency_us"].to_list() == [3.0]
    assert one_source(rows.drop("source")).equals(rows.drop("source"))  # rows that say nothing of a source
    assert one_source(rows.head(1)).equals(rows.head(1))
    with pytest.raises(ValueError) as refused:
        one_source(rows, prefer=("predicted", "simulated"), option="--source ")
    assert str(refused.value) == ("no predicted or simulated rows (the rows have ['measured', 'rehearsal', "
                                  "'replayed']); pass --source measured or --source rehearsal or --source replayed "
                                  "to use those rows")
    with pytest.raises(ValueError) as refused:
        one_source(rows, prefer=("predicted",))
    assert "pass source=measured or source=rehearsal or source=replayed to use" in str(refused.value)
    with pytest.raises(ValueError) as refused:
        one_source(rows, "predicted")
    assert str(refused.value) == "no rows with source='predicted'; the rows have ['measured', 'rehearsal', 'replayed']"
    with pytest.raises(ValueError) as refused:
        as_frame([{"num_tokens": 1, "variant": "baseline"}])
    assert str(refused.value) == "rows lack columns ['latency_us']; need num_tokens, variant, latency_us (+ source)"


def test_medians_carry_the_standard_error_of_each_median():
    """From the 95% interval: its width / (2 x 1.96). From a p10-p90 spread (rows written before intervals): the
    spread / 2.563 standard deviations x 1.2533 / sqrt(repeats). Neither: 0. Rows whose fusion_missing is unknown
    (null) are kept, with no warning."""
    import warnings

    from sp_lab.tuning.regret import medians

    ci = pl.DataFrame({"num_tokens": [1, 2], "variant": ["baseline"] * 2, "latency_us": [10.0, 20.0],
                       "ci_low_us": [9.0, 18.0], "ci_high_us": [11.0, 22.0], "fusion_missing": [None, False]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pooled = medians(ci)
    assert pooled["se_us"].to_list() == pytest.approx([2 / (2 * 1.959964), 4 / (2 * 1.959964)])
    spread = pl.DataFrame({"num_tokens": [1], "variant": ["baseline"], "latency_us": [10.0], "p10_us": [8.0],
                           "p90_us": [12.0], "repeats": [16]})
    assert medians(spread)["se_us"].to_list() == pytest.approx([4 / 2.563 * 1.2533 / 4])
    bare = medians(spread.drop("p10_us"))
    assert bare["se_us"].to_list() == [0.0] and bare["n"].to_list() == [1]
    grid = pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": 1.0} for v in ("sp+async_tp", "sp", "baseline")
                         for t in reversed(TOKENS)])
    assert medians(grid).select("num_tokens", "variant").rows() == [(t, v) for t in TOKENS
                                                                     for v in ("baseline", "sp", "sp+async_tp")]


def _rows_whose_fusion_did_not_fire_at_1024() -> pl.DataFrame:
    return pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": f(t), "fusion_missing": t == 1024 and v != "baseline"}
                         for t in TOKENS for v, f in CROSSING.items()])


def test_the_fusion_warning_names_the_rows():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        regret_table(_rows_whose_fusion_did_not_fire_at_1024(), LabConfig())
    assert [str(w.message) for w in caught] == [
        ("2 row(s) whose expected fusion did not fire were left out ([('sp', 1024), ('sp+async_tp', 1024)]): they "
         "time another program than their variant")]


def test_the_fusion_warning_points_at_the_caller():
    """Not run under mutation (benchmarks/bench_mutation.py): mutmut's trampolines add stack frames."""
    import warnings

    rows = _rows_whose_fusion_did_not_fire_at_1024()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        regret_table(rows, LabConfig())
        recommend(rows, LabConfig())
    assert [w.filename for w in caught] == [__file__] * 2  # the lines that called sp_lab, not sp_lab's own


def test_a_recommendation_without_noise_says_its_figures_and_why_it_cannot_judge_the_noise():
    """Fusion wins by 10% at 16 tokens, loses 50% at 64, wins 25% at 256: the switch at 256 loses 1/9 at 16; with
    no intervals each interval is the figure itself. The staged rows' second threshold gains 20 points and cannot
    be judged against noise."""
    latency = {(16, "baseline"): 100.0, (16, "sp+async_tp"): 90.0, (64, "baseline"): 200.0,
               (64, "sp+async_tp"): 300.0, (256, "baseline"): 400.0, (256, "sp+async_tp"): 300.0}
    rec = recommend([{"num_tokens": t, "variant": v, "latency_us": us} for (t, v), us in latency.items()], LabConfig())
    assert rec.summary() == ("baseline below 256, sp+async_tp from 256: worst regret 11.1% (95% interval 11.1-11.1%), "
                             "summed over the token counts 11.1% (11.1-11.1%)")
    staged = {"baseline": lambda t: 100.0 + t, "sp": lambda t: (100.0 + t) * (1.2 if t < 64 else 0.9),
              "sp+async_tp": lambda t: (100.0 + t) * (1.5 if t < 512 else 0.7)}
    rec = recommend([{"num_tokens": t, "variant": v, "latency_us": f(t)} for t in TOKENS for v, f in staged.items()],
                    LabConfig())
    assert rec.describe().splitlines()[1:] == [
        "the rows carry no interval: the choice ignores noise",
        ("a second threshold (baseline below 64, sp from 64, sp+async_tp from 512) would lower the summed regret by "
         "20.0 points (rows carry no interval)")]


def test_candidate_policies_have_one_threshold_unless_asked_for_more():
    three = ["baseline", "sp", "sp+async_tp"]
    assert len(candidate_policies(TOKENS, three)) == 3 + 3 * 5  # constants; three pairs x five switch points
    assert all(len(p.thresholds) <= 1 for p in candidate_policies(TOKENS, three))
    assert len(candidate_policies(TOKENS, three, thresholds=2)) == 3 + 3 * 5 + 10  # and C(5, 2) two-switch chains


def test_a_variant_measured_more_often_than_another_weighs_the_same():
    """Baseline swept twice, the other variants once: the medians pool each, and the recommendation is that of the
    rows swept once."""
    once = pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": f(t)} for t in TOKENS for v, f in CROSSING.items()])
    twice = pl.concat([once, once.filter(pl.col("variant") == "baseline")])
    rec, ref = recommend(twice, LabConfig()), recommend(once, LabConfig())
    assert rec.policy == ref.policy and rec.candidates.equals(ref.candidates)


def test_rows_outside_the_complete_counts_and_a_second_threshold_that_still_loses_somewhere():
    """A count only baseline reached (a sweep in progress) changes nothing. Fusion loses its lead at 1024 tokens
    (0.95 against sp's 0.9), so even the best two-threshold policy keeps a regret there: the gain is the difference
    of the two policies' regrets, not either alone."""
    staged = {"baseline": lambda t: 100.0 + t, "sp": lambda t: (100.0 + t) * (1.2 if t < 64 else 0.9),
              "sp+async_tp": lambda t: (100.0 + t) * (1.5 if t < 512 else 0.7 if t < 1024 else 0.95)}
    rows = pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": f(t)} for t in TOKENS for v, f in staged.items()])
    rec = recommend(rows, LabConfig())
    extra = recommend(pl.concat([rows, pl.DataFrame({"num_tokens": [2048], "variant": ["baseline"],
                                                     "latency_us": [1.0]})]), LabConfig())
    assert extra.policy == rec.policy and extra.candidates.equals(rec.candidates)
    second = rec.second_threshold
    assert second.policy.name == "baseline below 64, sp from 64, sp+async_tp from 512"
    chosen = rec.candidates.filter(pl.col("policy") == rec.policy.name)["total_regret"][0]
    assert second.gain == pytest.approx(chosen - (0.95 / 0.9 - 1)) and 0 < second.gain < chosen


def test_of_policies_the_noise_cannot_tell_apart_that_rewrite_as_much_the_later_threshold_is_chosen():
    """sp from 256 (two counts rewritten one level) and sp+async_tp from 1024 (one count, two levels) rewrite
    equally and the 5% intervals cannot tell them apart: the later threshold runs the unrewritten program longer."""
    table = {16: (100, 100, 101), 64: (100, 103, 110), 256: (110, 100, 110), 1024: (110, 110, 100)}
    rows = pl.DataFrame([{"num_tokens": t, "variant": v, "latency_us": float(lat), "ci_low_us": lat * 0.95,
                          "ci_high_us": lat * 1.05}
                         for t, lats in table.items() for v, lat in zip(("baseline", "sp", "sp+async_tp"), lats,
                                                                        strict=True)])
    rec = recommend(rows, LabConfig())
    assert "baseline below 256, sp from 256" in {p.name for p in rec.indistinguishable}
    assert rec.policy.name == "baseline below 1024, sp+async_tp from 1024", rec.policy.name
