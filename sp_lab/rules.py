"""The per-matmul AsyncTP fusion rule, stored as data.

AsyncTP replaces ``all_gather -> mm`` and ``mm -> reduce_scatter`` with fused kernels that split the
token dimension into ``tp`` chunks. That pays only when the communication it hides outweighs the cost
of running ``tp`` small matmuls instead of one (docs/measured-h200.md: 8.5x slower at 8 tokens, break-even
only near thousands of tokens on an H200). Whether it pays depends on the matmul's shape, so the
compiler asks a :class:`MatmulRule` once per candidate matmul.

A rule is a binary decision tree held as plain data and *interpreted* here; it is never turned into
code and executed. Its JSON form::

    split: {"feature": "m", "threshold": 1024.0, "left": <node>, "right": <node>}
           go left when features[feature] <= threshold (scikit-learn's convention), else right
    leaf:  {"choice": "fuse" | "no_fuse" | "unsure", "confidence": 0.97, "samples": 120}

Training a rule (scikit-learn) lives in :mod:`sp_lab.tuning.train`, above the compiler, so that the
compile path never imports scikit-learn. This module ships no pre-trained rule: a tree must be judged
by its regret on held-out shapes measured on the device it will run on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import operator
from pathlib import Path
from typing import Any, Literal, get_args

from sp_lab.jsonfile import read_json

__all__ = [
    "CHOICES",
    "FEATURES",
    "MAX_DEPTH",
    "Leaf",
    "MatmulRule",
    "RuleError",
    "Split",
    "features",
]

Choice = Literal["fuse", "no_fuse", "unsure"]
CHOICES: tuple[str, ...] = get_args(Choice)

#: Deepest tree accepted. scikit-learn trees trained on a few thousand shapes stay far below this;
#: the limit exists so a malformed (or cyclic-by-copy) file fails with a message, not a RecursionError.
MAX_DEPTH = 64

SCHEMA = "sp_lab.rule/1"

#: Every feature a split may test, with its definition. ``m`` is the token (row) count of the whole,
#: unfused matmul -- the gathered rows for ``all_gather -> mm``, the rows fed to the matmul before
#: ``reduce_scatter`` for ``mm -> reduce_scatter``; ``n`` its output columns (this rank's weight shard);
#: ``k`` the reduction dimension. All values are floats so thresholds compare uniformly.
FEATURES: dict[str, str] = {
    "m": "tokens (rows) of the unfused matmul",
    "n": "output columns of the matmul (this rank's weight shard)",
    "k": "reduction dimension",
    "tp": "tensor-parallel group size = number of chunks the fused kernel splits m into",
    "m_per_rank": "m / tp: rows of each chunk matmul inside the fused kernel",
    "mn": "m * n: elements of the output",
    "mk": "m * k: elements of the activation",
    "nk": "n * k: elements of the weight",
    "mnk": "m * n * k: half the FLOPs of the matmul",
    "dtype_bytes": "bytes of one operand element: 2 for bf16/fp16 matmuls, 1 for FP8 scaled matmuls",
    "intensity": (
        "arithmetic intensity of the unfused matmul in FLOP/byte, operands of dtype_bytes and a 2-byte output: "
        "2*m*n*k / (dtype_bytes*(m*k + k*n) + 2*m*n)"
    ),
    "log2_m": "log2(m)",
    "log2_n": "log2(n)",
    "log2_k": "log2(k)",
    "log2_mnk": "log2(m * n * k)",
}


class RuleError(ValueError):
    """A rule file or dict is malformed. The message names the path in the tree (``root.left.threshold``)."""


def features(m: int, n: int, k: int, tp: int = 1, dtype_bytes: int = 2) -> dict[str, float]:
    """All features of :data:`FEATURES` for one matmul ``[m, k] @ [k, n]`` in a TP group of ``tp`` ranks,
    with ``dtype_bytes``-byte operands (1: FP8, whose crossover differs from bf16's).

    The training code (``sp_lab.tuning.train``) calls this same function, so a trained threshold and
    the value the compiler compares it with are computed identically.
    """
    m, n, k, tp, dtype_bytes = (_positive_int(name, value) for name, value in
                                (("m", m), ("n", n), ("k", k), ("tp", tp), ("dtype_bytes", dtype_bytes)))
    mnk = m * n * k
    return {
        "m": float(m),
        "n": float(n),
        "k": float(k),
        "tp": float(tp),
        "m_per_rank": m / tp,
        "mn": float(m * n),
        "mk": float(m * k),
        "nk": float(n * k),
        "mnk": float(mnk),
        "dtype_bytes": float(dtype_bytes),
        # FLOPs 2mnk over bytes moved: operands of dtype_bytes, a 2-byte (bf16) output. For bf16 the 2s cancel.
        "intensity": 2 * mnk / (dtype_bytes * (m * k + k * n) + 2 * m * n),
        "log2_m": math.log2(m),
        "log2_n": math.log2(n),
        "log2_k": math.log2(k),
        "log2_mnk": math.log2(mnk),
    }


def _positive_int(name: str, value: Any) -> int:
    try:
        as_int = operator.index(value)  # accepts int and numpy integers, rejects floats
    except TypeError:
        raise TypeError(
            f"{name}: expected a concrete positive int, got {type(value).__name__} {value!r}; "
            "for symbolic shapes pass a size hint or fall back to LabConfig.heuristic_default"
        ) from None
    if isinstance(value, bool) or as_int < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return as_int


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A decision: what to do with every matmul whose features reach this leaf."""

    choice: Choice
    """"fuse", "no_fuse", or "unsure" (the caller then applies ``LabConfig.heuristic_default``)."""
    confidence: float = 1.0
    """Fraction of the training samples at this leaf whose best choice was ``choice``, in [0, 1]."""
    samples: int = 0
    """Training samples that reached this leaf (0 for hand-written rules)."""


@dataclasses.dataclass(frozen=True)
class Split:
    """An internal node: ``left`` when ``features[feature] <= threshold``, else ``right``."""

    feature: str
    """One of :data:`FEATURES`."""
    threshold: float
    """Finite threshold; equality goes left, as in scikit-learn."""
    left: Node
    """Subtree for ``feature <= threshold``."""
    right: Node
    """Subtree for ``feature > threshold``."""


Node = Split | Leaf


@dataclasses.dataclass(frozen=True)
class MatmulRule:
    """A per-matmul fusion decision tree. Build with :meth:`always`, :meth:`from_dict` or the tuner.

    Two rules compare equal when their trees are equal; ``meta`` (training provenance, scores) is
    carried along but does not change decisions, so it takes part in neither equality nor :meth:`uuid`.
    """

    root: Node
    """The tree."""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)
    """Free-form JSON-able notes, e.g. ``{"device": "NVIDIA H200", "tp": 8, "regret_pct": 0.4}``."""

    def __post_init__(self) -> None:
        # Validate trees built in Python the same way as trees loaded from JSON.
        _node_from_dict(_node_to_dict(self.root), "root", 0)
        try:
            json.dumps(self.meta)
        except TypeError as e:
            raise RuleError(f"meta: must be JSON-serialisable ({e})") from None

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def always(cls, choice: Choice) -> MatmulRule:
        """A constant rule: every matmul gets ``choice``."""
        return cls(_leaf_from_dict({"choice": choice}, "root"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MatmulRule:
        """Inverse of :meth:`to_dict`. Also accepts a bare tree node (``{"feature": ...}`` / ``{"choice": ...}``)."""
        if not isinstance(d, dict):
            raise RuleError(f"rule: expected a dict, got {type(d).__name__} {d!r:.80}")
        if "tree" not in d:
            return cls(_node_from_dict(d, "root", 0))
        unknown = set(d) - {"schema", "tree", "meta"}
        if unknown:
            raise RuleError(f"rule: unknown keys {sorted(unknown)}; expected 'schema', 'tree', 'meta'")
        if d.get("schema", SCHEMA) != SCHEMA:
            raise RuleError(f"rule.schema: expected {SCHEMA!r}, got {d['schema']!r}")
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise RuleError(f"rule.meta: expected a dict, got {type(meta).__name__}")
        return cls(_node_from_dict(d["tree"], "root", 0), dict(meta))

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> MatmulRule:
        """Load from a JSON file path or from JSON text."""
        return cls.from_dict(read_json(path_or_text, what="rule", error=RuleError))

    # -- serialisation ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """``{"schema": "sp_lab.rule/1", "tree": {...}, "meta": {...}}`` (plain JSON types only)."""
        return {"schema": SCHEMA, "tree": _node_to_dict(self.root), "meta": dict(self.meta)}

    def to_json(self, path: str | Path | None = None) -> str:
        """The JSON text of :meth:`to_dict`; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    def uuid(self) -> str:
        """Stable hash of the tree (sha256 of its canonical JSON).

        The compiler puts this in its ``CustomGraphPass.uuid()``: Inductor's FX-graph cache keys on it,
        so a changed rule invalidates cached graphs instead of silently reusing stale fusion decisions.
        """
        canonical = json.dumps(_node_to_dict(self.root), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    # -- evaluation ---------------------------------------------------------------------------------

    def leaf(self, m: int, n: int, k: int, tp: int = 1, dtype_bytes: int = 2) -> Leaf:
        """The leaf that matmul ``[m, k] @ [k, n]`` (``dtype_bytes``-byte operands) with ``tp`` ranks reaches."""
        feats = features(m, n, k, tp, dtype_bytes)
        node = self.root
        while isinstance(node, Split):
            node = node.left if feats[node.feature] <= node.threshold else node.right
        return node

    def decide(self, m: int, n: int, k: int, tp: int = 1, *, dtype_bytes: int = 2,
               min_confidence: float = 0.0) -> Choice:
        """``"fuse"``, ``"no_fuse"`` or ``"unsure"`` for matmul ``[m, k] @ [k, n]`` with ``tp`` ranks.

        Leaves whose training confidence is below ``min_confidence`` answer ``"unsure"``, so the
        caller's fallback (``LabConfig.heuristic_default``) decides there instead.
        """
        leaf = self.leaf(m, n, k, tp, dtype_bytes)
        return "unsure" if leaf.confidence < min_confidence else leaf.choice

    def explain(self, m: int, n: int, k: int, tp: int = 1, dtype_bytes: int = 2) -> list[str]:
        """The conditions on the path to the decision, e.g. ``["m = 64 <= 512", "-> no_fuse (0.98, 40 samples)"]``."""
        feats = features(m, n, k, tp, dtype_bytes)
        steps, node = [], self.root
        while isinstance(node, Split):
            value = feats[node.feature]
            went_left = value <= node.threshold
            steps.append(
                f"{node.feature} = {_fmt(value)} {'<=' if went_left else '>'} {_fmt(node.threshold)}"
            )
            node = node.left if went_left else node.right
        steps.append(f"-> {node.choice} ({node.confidence:.2f}, {node.samples} samples)")
        return steps

    # -- inspection ---------------------------------------------------------------------------------

    def depth(self) -> int:
        """Number of splits on the longest root-to-leaf path (0 for a constant rule)."""
        return _depth(self.root)

    def features_used(self) -> list[str]:
        """Sorted names of the features this rule tests."""
        used: set[str] = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            if isinstance(node, Split):
                used.add(node.feature)
                stack += [node.left, node.right]
        return sorted(used)

    def describe(self) -> str:
        """Readable if/else rules, one condition per line, each leaf with its confidence and samples.

        >>> print(MatmulRule.from_dict({"feature": "m", "threshold": 512,
        ...     "left": {"choice": "no_fuse", "confidence": 0.98, "samples": 40},
        ...     "right": {"choice": "fuse", "confidence": 0.91, "samples": 31}}).describe())
        if m <= 512:
            return "no_fuse"  # confidence 0.98, 40 samples
        else:
            return "fuse"  # confidence 0.91, 31 samples
        """
        lines: list[str] = []
        _describe(self.root, 0, lines)
        return "\n".join(lines)


# -- tree <-> dict ----------------------------------------------------------------------------------


def _node_to_dict(node: Node) -> dict[str, Any]:
    if isinstance(node, Leaf):
        # Floats as floats: a rule and its JSON round trip are equal, and so must their uuids be.
        return {"choice": node.choice, "confidence": float(node.confidence), "samples": node.samples}
    if isinstance(node, Split):
        return {
            "feature": node.feature,
            "threshold": float(node.threshold),
            "left": _node_to_dict(node.left),
            "right": _node_to_dict(node.right),
        }
    raise RuleError(f"rule: expected a Split or Leaf node, got {type(node).__name__} {node!r:.80}")


def _node_from_dict(d: Any, path: str, depth: int) -> Node:
    if depth > MAX_DEPTH:
        raise RuleError(f"{path}: tree deeper than {MAX_DEPTH} levels; retrain with a max_depth limit")
    if not isinstance(d, dict):
        raise RuleError(f"{path}: expected a node dict, got {type(d).__name__} {d!r:.80}")
    if "choice" in d:
        return _leaf_from_dict(d, path)
    if "feature" not in d:
        raise RuleError(
            f"{path}: a node needs 'feature', 'threshold', 'left', 'right' (a split) "
            f"or 'choice' (a leaf); got keys {sorted(d)}"
        )
    _reject_unknown_keys(d, {"feature", "threshold", "left", "right"}, path)
    feature = d["feature"]
    if feature not in FEATURES:
        raise RuleError(f"{path}.feature: unknown feature {feature!r}; allowed: {', '.join(FEATURES)}")
    for key in ("threshold", "left", "right"):
        if key not in d:
            raise RuleError(f"{path}.{key}: missing (a split needs feature, threshold, left, right)")
    threshold = d["threshold"]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise RuleError(f"{path}.threshold: expected a number, got {type(threshold).__name__} {threshold!r}")
    if not math.isfinite(threshold):
        raise RuleError(f"{path}.threshold: expected a finite number, got {threshold!r}")
    return Split(
        feature=feature,
        threshold=float(threshold),
        left=_node_from_dict(d["left"], f"{path}.left", depth + 1),
        right=_node_from_dict(d["right"], f"{path}.right", depth + 1),
    )


def _leaf_from_dict(d: dict[str, Any], path: str) -> Leaf:
    _reject_unknown_keys(d, {"choice", "confidence", "samples"}, path)
    choice = d["choice"]
    if choice not in CHOICES:
        raise RuleError(f"{path}.choice: expected one of {', '.join(map(repr, CHOICES))}, got {choice!r}")
    confidence = d.get("confidence", 1.0)
    if (
        isinstance(confidence, bool)
        or not isinstance(confidence, (int, float))
        or not 0.0 <= confidence <= 1.0
    ):
        raise RuleError(f"{path}.confidence: expected a number in [0, 1], got {confidence!r}")
    samples = d.get("samples", 0)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
        raise RuleError(f"{path}.samples: expected a non-negative int, got {samples!r}")
    return Leaf(choice=choice, confidence=float(confidence), samples=samples)


def _reject_unknown_keys(d: dict[str, Any], allowed: set[str], path: str) -> None:
    unknown = set(d) - allowed
    if unknown:
        raise RuleError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")


def _depth(node: Node) -> int:
    return 0 if isinstance(node, Leaf) else 1 + max(_depth(node.left), _depth(node.right))


def _describe(node: Node, indent: int, lines: list[str]) -> None:
    pad = "    " * indent
    if isinstance(node, Leaf):
        lines.append(
            f'{pad}return "{node.choice}"  # confidence {node.confidence:.2f}, {node.samples} samples'
        )
        return
    lines.append(f"{pad}if {node.feature} <= {_fmt(node.threshold)}:")
    _describe(node.left, indent + 1, lines)
    lines.append(f"{pad}else:")
    _describe(node.right, indent + 1, lines)


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:.6g}"
