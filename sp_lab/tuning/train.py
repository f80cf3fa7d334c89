"""Train the per-matmul fusion rule from fused-vs-unfused rows, AutoHeuristic style.

Rows (from :func:`sp_lab.tuning.microbench.measure_matmuls` or the performance model's
:func:`~sp_lab.tuning.predict.layer.matmul_rows`) hold, per matmul
shape and token count, ``m, n, k, tp, unfused_us, fused_us`` and a ``source``. Training:

1. **Label** each row with the faster choice: ``"fuse"`` when ``fused_us < unfused_us * (1 - margin)``,
   else ``"no_fuse"`` -- a near-tie is not worth the fused kernel's risks, so it counts as no_fuse.
2. **Split by shape**: the groups are ``(n, k, tp)``, so every validation and test shape is unseen in
   training (a random row split would leak the same shape at a neighbouring M and flatter the tree).
3. **Fit** a small scikit-learn ``DecisionTreeClassifier`` on :func:`sp_lab.rules.features`.
4. **Confidence threshold** (PyTorch's AutoHeuristic, ``torchgen/_autoheuristic``): each leaf's
   confidence is the training fraction of its majority label. On validation, take the smallest
   threshold at which at most ``max_wrong`` (1%) of answers are wrong; leaves below it answer
   ``"unsure"`` and the compiler falls back to ``LabConfig.heuristic_default``.
5. **Export** the tree's structure (``tree_.feature``, ``threshold``, children, ``value``) as a
   :class:`~sp_lab.rules.MatmulRule`: data, interpreted by the compiler, never code.
6. **Judge** it by regret on the held-out test shapes: chosen latency minus the per-shape oracle
   (:func:`evaluate_rule`), beside the regret of "always fuse" and "never fuse".
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl
from sklearn.model_selection import GroupShuffleSplit
from sklearn.tree import DecisionTreeClassifier

from sp_lab.rules import FEATURES, Leaf, MatmulRule, Split, features
from sp_lab.tuning.predict.kernels import dtype_bytes
from sp_lab.tuning.regret import one_source

#: Features the tree may split on: every feature of :data:`sp_lab.rules.FEATURES` -- M, N, K, M*N, M*K,
#: arithmetic intensity, the TP size and rows per chunk (the fused kernel's chunking penalty depends on
#: them) and the weight size N*K / M*N*K (a memory-bound chunked matmul re-reads the weight per chunk).
#: On the fixture, dropping N*K and M*N*K left trees that failed the 1%-wrong check on unseen shapes.
#: ``dtype_bytes`` is left out: rows of one dtype (the usual training set) hold it constant. Rows mixing bf16
#: and FP8 matmuls are refused unless it is asked for (:func:`_check_rows`).
DEFAULT_FEATURES = tuple(f for f in FEATURES if f != "dtype_bytes")
LABELS = ("fuse", "no_fuse")
REQUIRED_COLUMNS = ("m", "n", "k", "tp", "unfused_us", "fused_us")


def _row_widths(rows: pl.DataFrame) -> list[int]:
    """:func:`~sp_lab.tuning.predict.kernels.dtype_bytes` of every row (2, bf16, without a dtype column)."""
    return [dtype_bytes(d) for d in rows["dtype"].to_list()] if "dtype" in rows.columns else [2] * rows.height


def _check_rows(rows: pl.DataFrame, feature_names: Sequence[str] = DEFAULT_FEATURES) -> pl.DataFrame:
    if "dtype" in rows.columns and "dtype_bytes" not in feature_names:
        widths = {dtype_bytes(d) for d in rows["dtype"].unique().to_list()}
        if len(widths) > 1:
            raise ValueError(
                f"rows mix matmul dtypes {sorted(rows['dtype'].unique().to_list())}: bf16 and FP8 matmuls cross "
                "over at different M, so one rule must not pool them blindly. Train one rule per dtype "
                "(rows.filter(pl.col('dtype') == ...)) or add 'dtype_bytes' to feature_names"
            )
    missing = [c for c in REQUIRED_COLUMNS if c not in rows.columns]
    if missing:
        raise ValueError(f"training rows lack columns {missing}; need {REQUIRED_COLUMNS}, got {rows.columns}")
    rows = one_source(rows)  # train on measured or predicted rows, never both
    bad = rows.filter(pl.col("unfused_us").is_null() | pl.col("fused_us").is_null())
    if bad.height:
        warnings.warn(f"dropping {bad.height} rows without both timings (failed measurements)", stacklevel=3)
        rows = rows.filter(pl.col("unfused_us").is_not_null() & pl.col("fused_us").is_not_null())
    if rows.height == 0:
        raise ValueError("no rows with both fused_us and unfused_us to train on")
    return rows


def label_rows(rows: pl.DataFrame, margin: float = 0.02,
               feature_names: Sequence[str] = DEFAULT_FEATURES) -> pl.DataFrame:
    """Add ``label`` ("fuse" | "no_fuse"), ``oracle_us`` = min(fused, unfused) and ``shape`` (the group key:
    ``(n, k, tp)`` and the operand width, so a bf16 shape and its FP8 twin are different shapes)."""
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    rows = _check_rows(rows, feature_names)
    return rows.with_columns(
        label=pl.when(pl.col("fused_us") < pl.col("unfused_us") * (1 - margin)).then(pl.lit("fuse"))
        .otherwise(pl.lit("no_fuse")),
        oracle_us=pl.min_horizontal("fused_us", "unfused_us"),
        shape=pl.format("N{}_K{}_tp{}_b{}", "n", "k", "tp", pl.Series(_row_widths(rows))),
    )


def feature_matrix(rows: pl.DataFrame, names: Sequence[str] = DEFAULT_FEATURES) -> np.ndarray:
    """``[len(rows), len(names)]`` float matrix built with :func:`sp_lab.rules.features` (the compiler's own)."""
    unknown = [f for f in names if f not in FEATURES]
    if unknown:
        raise ValueError(f"unknown features {unknown}; allowed: {list(FEATURES)}")
    widths = _row_widths(rows)
    return np.array([[features(m, n, k, tp, b)[f] for f in names]
                     for (m, n, k, tp), b in zip(rows.select("m", "n", "k", "tp").iter_rows(), widths)],
                    dtype=np.float64)


# ------------------------------------------------------------------------------------- tree -> rule


def tree_to_rule(tree: DecisionTreeClassifier, feature_names: Sequence[str], *, min_confidence: float = 0.0,
                 meta: dict | None = None) -> MatmulRule:
    """Translate a fitted tree into a :class:`MatmulRule` (leaves below ``min_confidence`` become "unsure").

    scikit-learn sends ``x[feature] <= threshold`` left, the same convention as :class:`~sp_lab.rules.Split`.
    """
    t, classes = tree.tree_, list(tree.classes_)

    def node(i: int):
        if t.children_left[i] == -1:
            dist = t.value[i][0] / t.value[i][0].sum()  # class fractions (weighted) at this leaf
            best = int(np.argmax(dist))
            conf = float(dist[best])
            choice = classes[best] if conf >= min_confidence else "unsure"
            return Leaf(choice=choice, confidence=round(conf, 6), samples=int(t.n_node_samples[i]))
        return _merged(Split(feature=feature_names[t.feature[i]], threshold=float(t.threshold[i]),
                             left=node(t.children_left[i]), right=node(t.children_right[i])))

    return MatmulRule(node(0), dict(meta or {}))


def _merged(split: Split) -> Split | Leaf:
    """A split whose two sides answer the same is one leaf: the tree found purer halves, but the rule's answer
    does not depend on the feature (drawn as is, it reads "no_fuse if M <= 96 else no_fuse")."""
    left, right = split.left, split.right
    if not (isinstance(left, Leaf) and isinstance(right, Leaf) and left.choice == right.choice):
        return split
    samples = left.samples + right.samples
    confidence = ((left.confidence * left.samples + right.confidence * right.samples) / samples if samples
                  else min(left.confidence, right.confidence))
    return Leaf(choice=left.choice, confidence=round(confidence, 6), samples=samples)


MIN_CONFIDENCE = 0.75
"""The least confidence threshold a trained rule gets: a leaf whose training samples agree less than 3 to 1
answers "unsure" whatever the validation shapes say (they may simply not reach it)."""


def choose_confidence_threshold(tree: DecisionTreeClassifier, x_val: np.ndarray, val: pl.DataFrame,
                                max_wrong: float = 0.01, wrong_tolerance: float = 0.05) -> tuple[float, pl.DataFrame]:
    """Smallest leaf-confidence threshold at which at most ``max_wrong`` of validation answers are wrong.

    As in AutoHeuristic, an answer is *wrong* only when the chosen variant is more than
    ``wrong_tolerance`` slower than the faster one: at a crossover both choices are near-ties, and
    counting them would make the threshold hinge on noise. An "unsure" answer is never wrong (the
    fallback decides there). Returns the threshold and the candidates table
    (``threshold, wrong_fraction, unsure_fraction``) it was chosen from.
    """
    proba = tree.predict_proba(x_val)
    conf, pred = proba.max(axis=1), tree.classes_[proba.argmax(axis=1)]
    fused, unfused = val["fused_us"].to_numpy(), val["unfused_us"].to_numpy()
    chosen = np.where(pred == "fuse", fused, unfused)
    costly = chosen > np.minimum(fused, unfused) * (1 + wrong_tolerance)
    candidates = sorted({0.0, *np.unique(conf).tolist(), 1.0 + 1e-9})
    table = []
    for thr in candidates:
        answered = conf >= thr
        table.append({"threshold": thr, "wrong_fraction": float(np.mean(answered & costly)),
                      "unsure_fraction": float(np.mean(~answered))})
    table = pl.DataFrame(table)
    ok = table.filter(pl.col("wrong_fraction") <= max_wrong)
    # 1+eps (all unsure) always qualifies. Never below MIN_CONFIDENCE: a threshold a leaf cannot fall under
    # (any two-class leaf has at least 0.5) would make "unsure" impossible by construction.
    return max(float(ok["threshold"].min()), MIN_CONFIDENCE), table


# -------------------------------------------------------------------------------------- evaluation


@dataclass
class RuleReport:
    """How a rule's decisions compare with the per-shape oracle on a set of rows."""

    regret_total_us: float
    """Sum over rows of (latency of the chosen variant - latency of the faster one), microseconds."""
    regret_rel: float
    """``regret_total_us / sum(oracle_us)``: the fraction of matmul(+collective) time lost to wrong choices."""
    accuracy: float
    """Fraction of rows whose effective choice (unsure -> default) equals the label."""
    unsure_fraction: float
    """Fraction of rows the rule answered "unsure"."""
    wrong_fraction: float
    """Fraction of all rows whose definite answer ("fuse"/"no_fuse") disagrees with the label: divided by every
    row, answered or not, like the validation table's ``wrong_fraction`` (an "unsure" is never wrong)."""
    baselines: dict[str, float]
    """Relative regret of constant rules on the same rows: ``{"always_fuse": .., "never_fuse": ..}``."""
    per_shape: pl.DataFrame = field(repr=False)
    """One row per input row: ``m, n, k, tp, name, label, decision, effective, chosen_us, oracle_us, regret_us``."""

    def summary(self) -> str:
        """One line for logs and notebooks."""
        return (f"regret {self.regret_total_us:.1f} us ({100 * self.regret_rel:.2f}% of oracle); "
                f"accuracy {100 * self.accuracy:.1f}%, unsure {100 * self.unsure_fraction:.1f}%, "
                f"wrong {100 * self.wrong_fraction:.1f}%; always-fuse {100 * self.baselines['always_fuse']:.2f}%, "
                f"never-fuse {100 * self.baselines['never_fuse']:.2f}% ({self.per_shape.height} rows)")


def evaluate_rule(rule: MatmulRule, rows: pl.DataFrame, *, default: str = "no_fuse",
                  margin: float = 0.02) -> RuleReport:
    """Regret of ``rule`` against the per-shape oracle on ``rows`` ("unsure" takes ``default``)."""
    if default not in LABELS:
        raise ValueError(f"default must be one of {LABELS} (what the compiler does when unsure), got {default!r}")
    rows = label_rows(rows, margin, feature_names=tuple(FEATURES))  # the rule itself tells dtypes apart, or not
    widths = _row_widths(rows)
    decisions = [rule.decide(m, n, k, tp, dtype_bytes=b)
                 for (m, n, k, tp), b in zip(rows.select("m", "n", "k", "tp").iter_rows(), widths)]
    df = rows.with_columns(decision=pl.Series(decisions, dtype=pl.Utf8)).with_columns(
        effective=pl.when(pl.col("decision") == "unsure").then(pl.lit(default)).otherwise(pl.col("decision"))
    ).with_columns(
        chosen_us=pl.when(pl.col("effective") == "fuse").then(pl.col("fused_us")).otherwise(pl.col("unfused_us"))
    ).with_columns(regret_us=pl.col("chosen_us") - pl.col("oracle_us"))
    oracle = float(df["oracle_us"].sum())

    def rel(col: str) -> float:
        return float((df[col] - df["oracle_us"]).sum()) / oracle

    definite = df.filter(pl.col("decision") != "unsure")
    cols = [c for c in ("m", "n", "k", "tp", "name", "side", "label", "decision", "effective", "fused_us",
                        "unfused_us", "chosen_us", "oracle_us", "regret_us") if c in df.columns]
    return RuleReport(
        regret_total_us=float(df["regret_us"].sum()),
        regret_rel=float(df["regret_us"].sum()) / oracle,
        accuracy=float((df["effective"] == df["label"]).mean()),
        unsure_fraction=float((df["decision"] == "unsure").mean()),
        wrong_fraction=float((definite["decision"] != definite["label"]).sum()) / df.height,
        baselines={"always_fuse": rel("fused_us"), "never_fuse": rel("unfused_us")},
        per_shape=df.select(cols),
    )


# ---------------------------------------------------------------------------------------- training


@dataclass
class TrainedRule:
    """A trained rule and the evidence for it."""

    rule: MatmulRule
    """The exported rule (leaves under ``confidence_threshold`` answer "unsure")."""
    confidence_threshold: float
    """Leaf confidence below which the rule answers "unsure" (chosen on the validation shapes)."""
    test_report: RuleReport
    """Regret on the held-out test shapes, never seen in training or threshold selection."""
    train_report: RuleReport
    """The same on the training rows (how well the tree reproduces its data)."""
    thresholds: pl.DataFrame = field(repr=False)
    """Validation candidates: ``threshold, wrong_fraction, unsure_fraction``."""
    splits: dict[str, list[str]] = field(repr=False, default_factory=dict)
    """Shape groups (``N.._K.._tp..``) in ``train``, ``val`` and ``test``."""


def train_rule(
    rows: pl.DataFrame,
    *,
    feature_names: Sequence[str] = DEFAULT_FEATURES,
    max_depth: int = 5,
    min_samples_leaf: int = 3,
    margin: float = 0.02,
    max_wrong: float = 0.01,
    wrong_tolerance: float = 0.05,
    val_fraction: float = 0.2,
    test_fraction: float = 0.2,
    default: str = "no_fuse",
    seed: int = 0,
) -> TrainedRule:
    """Fit a fusion rule on ``rows`` and report its regret on unseen shapes (see module docstring).

    Args:
        rows: ``m, n, k, tp, unfused_us, fused_us`` (+ ``source``, ``name``, provenance columns).
        feature_names: features from :data:`sp_lab.rules.FEATURES` the tree may split on.
        max_depth, min_samples_leaf: tree size; small trees stay readable and generalise.
        margin: fusion must win by this fraction to be labelled "fuse".
        max_wrong: largest fraction of wrong validation answers the confidence threshold allows.
        wrong_tolerance: an answer is wrong when it is more than this fraction slower than the oracle.
        val_fraction, test_fraction: fractions of *shapes* (groups ``(n, k, tp)``) held out.
        default: what "unsure" means when the rule is evaluated (the compiler's fallback).
    """
    if not 1 <= max_depth <= 12:
        raise ValueError(f"max_depth={max_depth}: use 1..12 (a readable rule; 4-6 is typical)")
    rows = label_rows(rows, margin, feature_names)
    groups = rows["shape"].to_numpy()
    n_groups = len(set(groups))
    if n_groups < 3:
        raise ValueError(f"need at least 3 distinct (n, k, tp) shapes to split train/val/test; got {n_groups}")

    idx = np.arange(rows.height)
    outer = GroupShuffleSplit(n_splits=1, test_size=test_fraction, random_state=seed)
    trval, test = next(outer.split(idx, groups=groups))
    inner = GroupShuffleSplit(n_splits=1, test_size=val_fraction / (1 - test_fraction), random_state=seed)
    tr, val = (trval[i] for i in next(inner.split(trval, groups=groups[trval])))

    x = feature_matrix(rows, feature_names)
    y = rows["label"].to_numpy()

    def take(ids: np.ndarray) -> pl.DataFrame:
        return rows[ids.tolist()]

    tree = DecisionTreeClassifier(max_depth=max_depth, min_samples_leaf=min_samples_leaf, random_state=seed)
    tree.fit(x[tr], y[tr])
    threshold, thr_table = choose_confidence_threshold(tree, x[val], take(val), max_wrong, wrong_tolerance)

    source = rows["source"][0] if "source" in rows.columns else "unknown"
    meta = {
        "trainer": "sp_lab.tuning.train.train_rule (sklearn DecisionTreeClassifier)",
        "source": source,
        "device": str(rows["device_name"][0] if "device_name" in rows.columns
                      else rows["device"][0] if "device" in rows.columns else "unknown"),
        "features": list(feature_names),
        "max_depth": max_depth,
        "margin": margin,
        "max_wrong": max_wrong,
        "wrong_tolerance": wrong_tolerance,
        "confidence_threshold": threshold,
        "rows": {"train": len(tr), "val": len(val), "test": len(test)},
    }
    rule = tree_to_rule(tree, feature_names, min_confidence=threshold, meta=meta)
    test_report = evaluate_rule(rule, take(test), default=default, margin=margin)
    train_report = evaluate_rule(rule, take(tr), default=default, margin=margin)
    rule = MatmulRule(rule.root, {**meta, "test_regret_rel": round(test_report.regret_rel, 6),
                                  "test_unsure_fraction": round(test_report.unsure_fraction, 6)})
    return TrainedRule(
        rule=rule,
        confidence_threshold=threshold,
        test_report=test_report,
        train_report=train_report,
        thresholds=thr_table,
        splits={name: sorted(set(groups[ids])) for name, ids in (("train", tr), ("val", val), ("test", test))},
    )


def export_rule(trained: TrainedRule | MatmulRule, path_prefix: str) -> tuple[str, str]:
    """Write ``<prefix>.json`` (the rule as data) and ``<prefix>.txt`` (readable rules + test regret)."""
    rule = trained.rule if isinstance(trained, TrainedRule) else trained
    json_path, txt_path = f"{path_prefix}.json", f"{path_prefix}.txt"
    rule.to_json(json_path)
    header = [f"# {k}: {v}" for k, v in rule.meta.items()]
    if isinstance(trained, TrainedRule):
        header.append(f"# held-out shapes: {trained.test_report.summary()}")
    with open(txt_path, "w") as f:
        f.write("\n".join([*header, rule.describe(), ""]))
    return json_path, txt_path
