"""MatmulRule: decisions, serialisation, validation messages, describe(), uuid()."""

import json
import math

import pytest

from sp_lab.rules import FEATURES, MAX_DEPTH, Leaf, MatmulRule, RuleError, Split, features

# Hand-written for the tests (not a trained rule): small M -> no_fuse; large M -> depends on intensity.
TREE = {
    "feature": "m",
    "threshold": 512,
    "left": {"choice": "no_fuse", "confidence": 0.98, "samples": 40},
    "right": {
        "feature": "intensity",
        "threshold": 300.5,
        "left": {"choice": "unsure", "confidence": 0.6, "samples": 3},
        "right": {"choice": "fuse", "confidence": 0.91, "samples": 31},
    },
}


@pytest.fixture
def rule() -> MatmulRule:
    return MatmulRule.from_dict({"schema": "sp_lab.rule/1", "tree": TREE, "meta": {"device": "test"}})


def test_features_definitions():
    f = features(64, 8192, 1024, tp=8)
    assert set(f) == set(FEATURES)
    assert f["m"] == 64 and f["n"] == 8192 and f["k"] == 1024 and f["tp"] == 8
    assert f["mn"] == 64 * 8192 and f["mk"] == 64 * 1024 and f["nk"] == 8192 * 1024
    assert f["m_per_rank"] == 8
    # 2*m*n*k FLOPs over 2*(mk + kn + mn) bytes of bf16.
    assert f["intensity"] == pytest.approx(2 * 64 * 8192 * 1024 / (2 * (64 * 1024 + 1024 * 8192 + 64 * 8192)))
    assert f["log2_m"] == 6 and f["log2_mnk"] == pytest.approx(math.log2(64 * 8192 * 1024))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "64"])
def test_features_reject_non_positive_ints(bad):
    with pytest.raises((TypeError, ValueError), match="m: expected"):
        features(bad, 8, 8)


def test_decide_walks_the_tree(rule):
    assert rule.decide(1, 28672, 8192, tp=8) == "no_fuse"
    assert rule.decide(512, 28672, 8192, tp=8) == "no_fuse"  # equality goes left, as in scikit-learn
    assert rule.decide(4096, 8192, 1024, tp=8) == "fuse"  # intensity ~745
    assert rule.decide(1024, 128, 128, tp=8) == "unsure"  # intensity ~51
    assert rule.decide(4096, 8192, 1024, tp=8, min_confidence=0.95) == "unsure"
    assert rule.leaf(4096, 8192, 1024, 8) == Leaf("fuse", 0.91, 31)


def test_always():
    assert MatmulRule.always("fuse").decide(1, 1, 1) == "fuse"
    assert MatmulRule.always("no_fuse").decide(16384, 8192, 8192, 8) == "no_fuse"
    assert MatmulRule.always("fuse").depth() == 0
    with pytest.raises(
        RuleError, match="root.choice: expected one of 'fuse', 'no_fuse', 'unsure', got 'yes'"
    ):
        MatmulRule.always("yes")


def test_round_trips(rule, tmp_path):
    assert MatmulRule.from_dict(rule.to_dict()) == rule
    assert MatmulRule.from_dict(rule.to_dict()).meta == {"device": "test"}
    assert MatmulRule.from_json(rule.to_json()) == rule
    path = tmp_path / "rule.json"
    rule.to_json(path)
    assert MatmulRule.from_json(path) == rule
    assert MatmulRule.from_json(str(path)) == rule
    assert MatmulRule.from_dict(TREE) == rule  # a bare tree is accepted
    assert json.loads(rule.to_json())["tree"]["right"]["threshold"] == 300.5


def test_python_built_tree_equals_loaded_one(rule):
    built = MatmulRule(
        Split(
            "m",
            512.0,
            Leaf("no_fuse", 0.98, 40),
            Split("intensity", 300.5, Leaf("unsure", 0.6, 3), Leaf("fuse", 0.91, 31)),
        )
    )
    assert built == rule and built.uuid() == rule.uuid()


def test_uuid_tracks_decisions_not_meta(rule):
    assert rule.uuid() == MatmulRule.from_dict(TREE).uuid()
    # Numbers written as ints: equal to the JSON round trip (floats), and so is the uuid.
    whole = MatmulRule(Split("m", 512, Leaf("no_fuse", 1, 40), Leaf("fuse", 1, 12)))
    again = MatmulRule.from_json(whole.to_json())
    assert again == whole and again.uuid() == whole.uuid()
    assert len(rule.uuid()) == 64
    changed = json.loads(json.dumps(TREE))
    changed["threshold"] = 256
    assert MatmulRule.from_dict(changed).uuid() != rule.uuid()
    relabelled = json.loads(json.dumps(TREE))
    relabelled["left"]["choice"] = "fuse"
    assert MatmulRule.from_dict(relabelled).uuid() != rule.uuid()
    assert MatmulRule.from_dict({"tree": TREE, "meta": {"other": 1}}).uuid() == rule.uuid()


def test_describe(rule):
    assert rule.describe() == (
        "if m <= 512:\n"
        '    return "no_fuse"  # confidence 0.98, 40 samples\n'
        "else:\n"
        "    if intensity <= 300.5:\n"
        '        return "unsure"  # confidence 0.60, 3 samples\n'
        "    else:\n"
        '        return "fuse"  # confidence 0.91, 31 samples'
    )


def test_explain_and_inspection(rule):
    assert rule.explain(64, 8192, 1024, 8) == ["m = 64 <= 512", "-> no_fuse (0.98, 40 samples)"]
    assert rule.depth() == 2
    assert rule.features_used() == ["intensity", "m"]


def _with(path: list[str], key: str, value):
    tree = json.loads(json.dumps(TREE))
    node = tree
    for step in path:
        node = node[step]
    node[key] = value
    return tree


@pytest.mark.parametrize(
    "tree, message",
    [
        (_with([], "feature", "M"), r"root.feature: unknown feature 'M'; allowed: m, n, k"),
        (_with(["right"], "threshold", "300"), r"root.right.threshold: expected a number, got str '300'"),
        (_with(["right"], "threshold", True), r"root.right.threshold: expected a number, got bool"),
        (_with(["right"], "threshold", float("nan")), r"root.right.threshold: expected a finite number"),
        (_with(["right", "left"], "choice", "maybe"), r"root.right.left.choice: expected one of"),
        (_with(["left"], "confidence", 1.5), r"root.left.confidence: expected a number in \[0, 1\]"),
        (_with(["left"], "samples", -1), r"root.left.samples: expected a non-negative int"),
        (_with(["left"], "colour", "red"), r"root.left: unknown keys \['colour'\]"),
        ({"feature": "m", "threshold": 1, "left": {"choice": "fuse"}}, r"root.right: missing"),
        ({"threshold": 1}, r"root: a node needs 'feature'"),
        (
            {"feature": "m", "threshold": 1, "left": [], "right": {"choice": "fuse"}},
            r"root.left: expected a node dict",
        ),
    ],
)
def test_validation_names_the_path(tree, message):
    with pytest.raises(RuleError, match=message):
        MatmulRule.from_dict(tree)


def test_depth_limit():
    tree: dict = {"choice": "fuse"}
    for _ in range(MAX_DEPTH + 1):
        tree = {"feature": "m", "threshold": 1.0, "left": tree, "right": {"choice": "no_fuse"}}
    with pytest.raises(RuleError, match=r"root(\.left){65}: tree deeper than 64 levels"):
        MatmulRule.from_dict(tree)
    assert MatmulRule.from_dict(tree["left"]).depth() == MAX_DEPTH


def test_wrapper_validation():
    with pytest.raises(RuleError, match="rule.schema: expected 'sp_lab.rule/1', got 'sp_lab.rule/2'"):
        MatmulRule.from_dict({"schema": "sp_lab.rule/2", "tree": TREE})
    with pytest.raises(RuleError, match=r"rule: unknown keys \['extra'\]"):
        MatmulRule.from_dict({"tree": TREE, "extra": 1})
    with pytest.raises(RuleError, match="meta: must be JSON-serialisable"):
        MatmulRule(Leaf("fuse"), meta={"x": object()})
    with pytest.raises(RuleError, match="not valid JSON"):
        MatmulRule.from_json("{not json")
    with pytest.raises(FileNotFoundError, match="no such rule file"):
        MatmulRule.from_json("/nonexistent/rule.json")


def test_docstring_examples():
    import doctest
    import inspect

    import sp_lab.rules

    results = doctest.testmod(sp_lab.rules)
    # Every example in the source ran (a docstring doctest does not collect would pass unseen), none failed.
    examples = sum(line.lstrip().startswith(">>> ") for line in inspect.getsource(sp_lab.rules).splitlines())
    assert results.attempted == examples > 0 and results.failed == 0, (results, examples)
