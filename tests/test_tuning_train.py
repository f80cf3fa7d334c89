"""Per-matmul microbenchmarks (sp_lab.tuning.microbench) and rule training (sp_lab.tuning.train).

The training data is tests/data/tuning_fixture_rows.json: a SYNTHETIC table (source="predicted")
produced by tests/data/make_tuning_fixture.py from the performance model (measured H200 kernel tables,
the chunk pipeline, an NVLink alpha-beta model), so the right decisions are known and "the rule reproduces them" can fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from sp_lab.rules import Leaf, MatmulRule, Split
from sp_lab.tuning import train as T
from sp_lab.tuning.microbench import MatmulShape, measure_matmuls, tp_matmul_shapes

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "tuning_fixture_rows.json"


@pytest.fixture(scope="module")
def rows() -> pl.DataFrame:
    return pl.DataFrame(json.loads(FIXTURE.read_text())["rows"])


@pytest.fixture(scope="module")
def trained(rows) -> T.TrainedRule:
    return T.train_rule(rows)


# ------------------------------------------------------------------------------------ microbench


def test_shapes_match_the_measured_llama70b_tp8_table():
    # Per-rank (K, N) of the shipped chunking table: qkv 8192x1280, o_proj 1024x8192, gate_up 8192x7168, down 3584x8192.
    shapes = {s.name: (s.k, s.n, s.side) for s in tp_matmul_shapes("llama-3-70b", 8)}
    assert shapes == {"qkv": (8192, 1280, "ag"), "o_proj": (1024, 8192, "rs"),
                      "gate_up": (8192, 7168, "ag"), "down": (3584, 8192, "rs")}


def test_shapes_from_hf_dict_replicate_kv_heads_below_tp():
    spec = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 64}
    qkv = tp_matmul_shapes(spec, 4)[0]
    assert (qkv.k, qkv.n) == (512, (2 + 2 * 1) * 64)  # 2 heads, kv 2//4 -> 1 replicated kv head
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        tp_matmul_shapes(spec, 3)
    with pytest.raises(ValueError, match="unknown model preset"):
        tp_matmul_shapes("no-such-model", 2)


def test_measure_matmuls_with_a_stand_in_fused_op():
    calls = []

    def chunked(a, b, shape: MatmulShape):  # what a 2-way fused kernel computes, without the collective
        calls.append(shape.side)
        full = a.repeat(2, 1) if shape.side == "ag" else a
        return torch.cat([c @ b for c in full.chunk(2)])

    def broken(a, b, shape):
        raise RuntimeError("kernel missing")

    shapes = [MatmulShape("qkv", n=32, k=16, collective="all_gather"),
              MatmulShape("down", n=16, k=32, collective="reduce_scatter")]
    df = measure_matmuls(shapes, [3, 8], tp=2, device="cpu", dtype=torch.float32, fused_impl=chunked,
                         calls=1, replays=2)
    assert df.height == 4 and set(calls) == {"ag", "rs"}
    assert df["m_padded"].to_list() == [4, 8, 4, 8]  # padded to a multiple of tp
    assert (df["source"] == "measured").all() and df["error"].is_null().all()
    assert (df["fused_us"] > 0).all() and (df["unfused_us"] > 0).all()
    assert {"device", "torch", "date", "ratio", "side"} <= set(df.columns) and (df["timer"] == "perf_counter").all()
    bad = measure_matmuls(shapes[:1], [4], tp=2, dtype=torch.float32, fused_impl=broken, calls=1, replays=1)
    assert "kernel missing" in bad["error"][0] and bad["fused_us"][0] is None


def test_bench_script_cpu_smoke_and_refusal(tmp_path):
    script = ROOT / "benchmarks" / "bench_matmul_h200.py"
    if torch.cuda.is_available():
        pytest.skip("the refusal path needs a machine without CUDA")
    refused = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True,
                             check=False)
    assert refused.returncode == 2 and "--cpu-smoke" in refused.stderr
    done = subprocess.run([sys.executable, str(script), "--cpu-smoke", "--max-tokens", "4", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "matmul_single_gpu.json").read_text())
    assert data["meta"]["source"] == "measured" and data["meta"]["torch"] == torch.__version__
    by_variant = {v: [r for r in data["rows"] if r["variant"] == v] for v in ("mm", "mm_chunked", "fused_ws1")}
    assert all(by_variant.values()), {v: len(rows) for v, rows in by_variant.items()}  # every variant has rows
    assert all(r["us"] > 0 for r in by_variant["mm"] + by_variant["mm_chunked"])
    assert all(r["us"] is None and "symmetric memory" in r["error"] for r in by_variant["fused_ws1"])


def test_microbench_imports_without_polars():
    """benchmarks/bench_matmul_h200.py runs on GPU machines without polars: importing sp_lab.tuning.microbench
    (and so sp_lab.tuning) must not import it."""
    code = ("import sys, importlib.abc\n"
            "class NoPolars(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] == 'polars': raise ImportError('no polars here')\n"
            "sys.meta_path.insert(0, NoPolars())\n"
            "import sp_lab.tuning.microbench\n"
            "print('polars' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    import sp_lab.tuning

    assert sp_lab.tuning.regret_table is __import__("sp_lab.tuning.regret").tuning.regret.regret_table


def test_one_dtype_width_for_every_spelling():
    """Rows say "fp8-rowwise" (a sweep's setup), "float8" (a prediction), "float8_e4m3fn" (an FP8 benchmark):
    all are 1-byte operands, as the compiler sees them; no dtype column means bf16."""
    from sp_lab.tuning.predict.kernels import dtype_bytes

    assert T.dtype_bytes is dtype_bytes  # one definition, shared by training and predictions
    spellings = ("fp8-rowwise", "fp8-tensorwise", "float8", "float8_tensorwise", "float8_e4m3fn", "bfloat16",
                 "float16", "float32", None)
    assert [dtype_bytes(d) for d in spellings] == [1, 1, 1, 1, 1, 2, 2, 4, 2]
    with pytest.raises(ValueError, match="unsupported dtype 'int3'"):
        dtype_bytes("int3")
    rows = pl.DataFrame({"m": [64, 64], "n": [8, 8], "k": [8, 8], "tp": [2, 2], "fused_us": [1.0, 1.0],
                         "unfused_us": [2.0, 2.0], "dtype": ["float8", "bfloat16"], "source": ["predicted"] * 2})
    with pytest.raises(ValueError, match=r"rows mix matmul dtypes \['bfloat16', 'float8'\]"):
        T.label_rows(rows)


# -------------------------------------------------------------------------------------- training


def test_rule_trained_on_fixture_reproduces_its_decisions(trained, rows):
    # On the rows it learnt from, and on shapes it never saw, the rule picks what the fixture says. The
    # performance model's fused time (chunk pipeline, measured fused-op cost) leaves more rows within a few
    # percent of the fuse/no-fuse boundary than the old what-if model's max(chunked, comm) did: a depth-5 tree
    # gets ~97% of the training rows and ~90% of unseen shapes right, its wrong answers where both choices
    # cost about the same -- which the regret checks below hold it to.
    assert trained.train_report.accuracy >= 0.96
    test = trained.test_report
    assert test.accuracy >= 0.88 and test.unsure_fraction <= 0.1
    # Regret against the per-shape oracle: small, and far below both constant rules.
    assert test.regret_rel < 0.01
    assert test.regret_rel < 0.1 * min(test.baselines.values())
    full = T.evaluate_rule(trained.rule, rows)
    assert full.accuracy >= 0.94 and full.regret_rel < 0.01
    assert not set(trained.splits["test"]) & set(trained.splits["train"])  # held-out by shape


def test_rule_does_not_fuse_decode_gemm_the_draft_tree_fused(trained):
    # docs/thresholds.md: the draft's tree said "fuse" for M=1, K=8192, N=28672 (Llama-70B gate_up at TP=2).
    for tp in (2, 4, 8):
        assert trained.rule.decide(1, 28672, 8192, tp) in ("no_fuse", "unsure")
    assert trained.rule.decide(16384, 28672, 8192, 2) == "fuse"


def test_exported_rule_is_data_and_round_trips(trained, rows, tmp_path):
    json_path, txt_path = T.export_rule(trained, str(tmp_path / "rule"))
    loaded = MatmulRule.from_json(Path(json_path))
    assert loaded == trained.rule and loaded.uuid() == trained.rule.uuid()
    assert loaded.meta["source"] == "predicted" and loaded.meta["confidence_threshold"] == trained.confidence_threshold
    for m, n, k, tp in rows.select("m", "n", "k", "tp").iter_rows():
        assert loaded.decide(m, n, k, tp) == trained.rule.decide(m, n, k, tp)
    text = Path(txt_path).read_text()
    assert "if " in text and "held-out shapes: regret" in text


def test_tree_to_rule_follows_sklearn_exactly(rows):
    from sklearn.tree import DecisionTreeClassifier

    labelled = T.label_rows(rows)
    x = T.feature_matrix(labelled)
    tree = DecisionTreeClassifier(max_depth=4, random_state=0).fit(x, labelled["label"].to_numpy())
    rule = T.tree_to_rule(tree, T.DEFAULT_FEATURES)
    ours = [rule.decide(m, n, k, tp) for m, n, k, tp in labelled.select("m", "n", "k", "tp").iter_rows()]
    assert ours == tree.predict(x).tolist()


def test_low_confidence_leaves_answer_unsure():
    # Two shapes whose labels disagree at the same features: no tree can be confident there.
    base = {"n": 1024, "k": 1024, "tp": 2, "source": "predicted"}
    rows = pl.DataFrame(
        [{**base, "m": m, "fused_us": 1.0, "unfused_us": 2.0} for m in (1024, 2048, 4096)]  # fuse: 2x faster
        + [{**base, "m": m, "fused_us": 9.0, "unfused_us": 2.0} for m in (1, 2, 4)]  # no_fuse: 4.5x slower
        + [{**base, "m": 8, "fused_us": f, "unfused_us": 2.0} for f in (1.0, 1.0, 9.0)]  # a mixed leaf
    )
    labelled = T.label_rows(rows)
    x = T.feature_matrix(labelled, ["m"])
    from sklearn.tree import DecisionTreeClassifier

    tree = DecisionTreeClassifier(max_depth=1, random_state=0).fit(x, labelled["label"].to_numpy())
    threshold, table = T.choose_confidence_threshold(tree, x, labelled, max_wrong=0.0)
    assert 0.5 < threshold <= 1.0 and table["wrong_fraction"].min() == 0.0
    rule = T.tree_to_rule(tree, ["m"], min_confidence=threshold)
    choices = {rule.decide(m, 1024, 1024, 2) for m in (1, 2, 4, 8, 1024)}
    assert "unsure" in choices


def test_evaluate_rule_regret_by_hand():
    rows = pl.DataFrame({"m": [1, 4096], "n": [8, 8], "k": [8, 8], "tp": [2, 2],
                         "fused_us": [30.0, 50.0], "unfused_us": [10.0, 100.0], "source": ["predicted"] * 2})
    always = T.evaluate_rule(MatmulRule.always("fuse"), rows)
    assert always.regret_total_us == pytest.approx(20.0)  # wrong only at m=1: 30 - 10
    assert always.regret_rel == pytest.approx(20.0 / 60.0) == pytest.approx(always.baselines["always_fuse"])
    never = T.evaluate_rule(MatmulRule.always("unsure"), rows)  # unsure -> the default, no_fuse
    assert never.unsure_fraction == 1.0 and never.regret_total_us == pytest.approx(50.0)
    assert never.wrong_fraction == 0.0 and never.accuracy == 0.5
    # wrong answers over every row, answered or not: unsure at m=1, a wrong "no_fuse" at m=4096 -> 1 of 2 rows
    half = MatmulRule(Split("m", 2, Leaf("unsure"), Leaf("no_fuse")))
    report = T.evaluate_rule(half, rows)
    assert (report.unsure_fraction, report.wrong_fraction) == (0.5, 0.5)
    fuse_default = T.evaluate_rule(MatmulRule.always("unsure"), rows, default="fuse")
    assert fuse_default.regret_total_us == pytest.approx(20.0)


def test_training_refuses_mixed_sources_and_too_few_shapes(rows):
    mixed = pl.concat([rows.head(20), rows.tail(20).with_columns(source=pl.lit("measured"))])
    with pytest.raises(ValueError, match="mix sources"):
        T.train_rule(mixed)
    one_shape = rows.filter((pl.col("n") == 1280) & (pl.col("k") == 8192) & (pl.col("tp") == 8))
    with pytest.raises(ValueError, match="at least 3 distinct"):
        T.train_rule(one_shape)
    with pytest.raises(ValueError, match="unknown features"):
        T.feature_matrix(rows.head(2), ["m", "flops"])
    assert np.isfinite(T.feature_matrix(rows.head(3))).all()


def test_no_split_answers_the_same_on_both_sides_and_unsure_stays_possible():
    """A split whose two leaves both say no_fuse is one leaf; a leaf whose samples agree only 6 to 4 is "unsure"
    (the confidence threshold never drops to where no leaf can fall under it)."""
    from sklearn.tree import DecisionTreeClassifier

    from sp_lab.rules import Leaf, Split

    # M <= 8: 10 x no_fuse; M > 8: 6 x no_fuse, 4 x fuse. The tree splits (the right half is less pure),
    # but both halves answer no_fuse.
    m = np.array([[1.0]] * 10 + [[64.0]] * 10)
    y = np.array(["no_fuse"] * 10 + ["no_fuse"] * 6 + ["fuse"] * 4)
    tree = DecisionTreeClassifier(max_depth=1).fit(m, y)
    assert tree.tree_.node_count == 3  # sklearn did split
    rule = T.tree_to_rule(tree, ["m"], min_confidence=0.5)  # both halves answer no_fuse

    def splits_with_equal_leaves(node):
        if isinstance(node, Leaf):
            return 0
        same = isinstance(node.left, Leaf) and isinstance(node.right, Leaf) and node.left.choice == node.right.choice
        return int(same) + splits_with_equal_leaves(node.left) + splits_with_equal_leaves(node.right)

    assert not isinstance(rule.root, Split) and splits_with_equal_leaves(rule.root) == 0
    assert rule.root.choice == "no_fuse" and rule.root.samples == 20 and rule.root.confidence == pytest.approx(0.8)
    # the 6:4 leaf on its own, kept as a split from a clean one, is unsure at the least threshold
    y2 = np.array(["fuse"] * 10 + ["no_fuse"] * 6 + ["fuse"] * 4)
    split = T.tree_to_rule(DecisionTreeClassifier(max_depth=1).fit(m, y2), ["m"], min_confidence=T.MIN_CONFIDENCE)
    assert split.decide(64, 1, 1) == "unsure" and split.decide(1, 1, 1) == "fuse"
    # a validation set with no costly mistakes still gets a threshold a leaf can fall under
    labelled = pl.DataFrame({"fused_us": [1.0] * 20, "unfused_us": [1.0] * 20})
    threshold, _ = T.choose_confidence_threshold(tree, m, labelled)
    assert threshold >= T.MIN_CONFIDENCE > 0.5
