"""Fuzzed equivalence: the compiled model equals the eager tp=1 reference, over drawn shapes and token counts.

A seeded generator (no hypothesis: every case must be reproducible from its seed and cheap to shrink by
hand, and compiles are far too costly for hypothesis' search) draws toy-model shapes, a residual form, a
boundary strategy and compile mode, an ``async_tp_min_tokens`` threshold and ``max_num_tokens``, and a set
of token counts in ``1..max`` that covers both sides of the threshold, odd and even counts and counts that
are not a multiple of tp. Each case builds the sharded model on every rank and the unsharded (tp=1) model
with the same seed, compiles the sharded one, and compares logits.

Expected outcome per strategy (what is asserted):

=========================== ======================================================================
``gather`` / ``sharded``     equal to the tp=1 eager reference within ``ATOL`` at every token count,
``full_graph``               no range flagged ``numerically_unsafe``, and not vacuously: the SP range
                             rewrote and fused, the range below the threshold did neither
``gather_erase``             out-of-place residual: equal, like ``gather``. In-place residual: the
                             SP range is flagged ``numerically_unsafe`` and, with two or more layers,
                             *differs* from eager (the documented finding: the erased ``copy_`` drops
                             the residual update); the range below the threshold stays exact
``none``                     raises :class:`~sp_lab.compiler.backend.BoundaryError` on every rank at
                             the first SP-range call, within the launch timeout (no hang)
=========================== ======================================================================

Tolerance: fp32 logits, ``ATOL = 1e-4`` absolute. Observed errors are ~1e-7 (reduction order differs
between one matmul and tp partial sums + all_reduce); a real bug (stale residual, wrong shard, bad pad)
shows up as 1e-2 or more.

Profiles:

- CI (default; ~40 s with a warm Inductor cache, ~80 s cold, on 2 cores): one ``sp_lab.launch`` of 2 gloo
  ranks runs ``CI_CASES``: six 2-layer cases over one drawn width (every strategy, both residual forms,
  ``gather_erase`` on an in-place residual among them; ~40 (case, token count) calls). Plus, in this process
  on the fake group, the tp=2 sharded case widened to tp=4 (op counts and logits' shapes, no numerics) and the
  regression case of a range ending at tp + 1.
- long (``pytest -m slow -s tests/test_fuzz_equivalence.py``, 6-12 min, not in CI): 40 tp=2 cases over four
  widths and 1-3 layers (four launches), 5 tp=4 cases on 4 gloo ranks, 20 cases traced at tp=4 and tp=8.
  ``SP_LAB_FUZZ_SEED=<int>`` draws another set (the default seed is fixed so CI is deterministic).

A failing case prints its ``FuzzCase`` as JSON; rerun it alone with
``python tests/test_fuzz_equivalence.py '<that json>'``.

Related coverage elsewhere (not repeated here): ``tests/test_compiler_backend.py`` compares fixed toy and
Llama-family cases with eager on 2 ranks and checks ``none``'s error text on the fake group;
``tests/test_reliability.py`` covers faults and hostile inputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import rank_checks
import torch
import torch.distributed as dist

import sp_lab
from sp_lab.compiler.backend import BoundaryError
from sp_lab.distributed.collectives import fake_process_group

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor"))

ATOL = 1e-4
"""Largest accepted max-abs difference of fp32 logits between compiled and the tp=1 eager reference."""

UNSAFE_MIN_ERROR = 1e-2
"""``gather_erase`` on an in-place residual must differ by at least this much (measured: ~0.25)."""

STRATEGIES = (
    ("gather", "piecewise"),
    ("sharded", "piecewise"),
    ("sharded", "full_graph"),
    ("gather_erase", "piecewise"),
    ("none", "piecewise"),
)
"""(boundary, compile_mode) pairs the fuzzer draws from."""

DEFAULT_SEED = 20250611
SEED = int(os.environ.get("SP_LAB_FUZZ_SEED", DEFAULT_SEED))

COUNTED = ("all_reduce", "reduce_scatter", "all_gather", "fused_all_gather_matmul", "fused_matmul_reduce_scatter")


# ---------------------------------------------------------------------------------------------------------------
# The generator


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """One drawn compile: a model shape, a strategy, a token range split and the token counts to call it with."""

    seed: int
    """Seed of the generator that drew this case (with ``index``, enough to draw it again)."""
    index: int
    """Position in its profile."""
    tp: int
    """Tensor-parallel size (ranks)."""
    shape: dict[str, int]
    """``sp_lab.models.build("toy", **shape)`` overrides: hidden/intermediate/vocab sizes, heads, layers."""
    residual_inplace: bool
    """The fused add+norm updates the residual in place (vLLM's kernel) or out of place."""
    boundary: str
    """``LabConfig.boundary``."""
    compile_mode: str
    """``LabConfig.compile_mode``."""
    async_tp_min_tokens: int
    """First token count of the SP + AsyncTP range (1 means every count, padded from 1 to tp)."""
    max_num_tokens: int
    """Last token count of the SP range."""
    token_counts: tuple[int, ...]
    """Counts to call the compiled model with, in call order."""

    def config(self) -> sp_lab.LabConfig:
        return sp_lab.LabConfig(
            tp_size=self.tp,
            async_tp_min_tokens=self.async_tp_min_tokens,
            max_num_tokens=self.max_num_tokens,
            boundary=self.boundary,
            compile_mode=self.compile_mode,
        )

    @property
    def expect(self) -> str:
        """``"equal"``, ``"unsafe"`` (gather_erase on an in-place residual) or ``"boundary_error"``."""
        if self.boundary == "none":
            return "boundary_error"
        if self.boundary == "gather_erase" and self.residual_inplace:
            return "unsafe"
        return "equal"

    @property
    def label(self) -> str:
        mode = self.boundary if self.compile_mode == "piecewise" else self.compile_mode
        residual = "inplace" if self.residual_inplace else "outofplace"
        return f"{self.index}-tp{self.tp}-{mode}-{residual}-L{self.shape['num_layers']}-min{self.async_tp_min_tokens}"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FuzzCase:
        d = json.loads(text)
        return cls(**{**d, "token_counts": tuple(d["token_counts"])})


def draw_shape(rng: random.Random, tp: int) -> dict[str, int]:
    """Toy widths every dimension of which shards over ``tp``; sizes deliberately not powers of two.

    The depth is drawn per case (:func:`draw_case`): cases of one width share Inductor's kernel cache.
    """
    num_kv_heads = tp * rng.choice([1, 2])
    num_heads = num_kv_heads * rng.choice([1, 2])  # GQA groups of 1 or 2
    head_dim = rng.choice([8, 12, 16])  # even: RoPE rotates pairs
    shape = {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": tp * rng.randint(6, 40),
        "vocab_size": tp * rng.randint(16, 96),
    }
    if rng.random() < 0.25:  # hidden unrelated to heads x head_dim (explicit head_dim, as Qwen / Gemma do)
        shape.update(hidden_size=4 * rng.randint(6, 24), head_dim=head_dim)
    else:
        shape["hidden_size"] = num_heads * head_dim
    return shape


def draw_token_counts(rng: random.Random, tp: int, lo: int, hi: int, *, low_range: bool) -> tuple[int, ...]:
    """Counts in ``1..hi`` around the threshold ``lo``: each side of it, odd/even, non-multiples of tp, ``hi``.

    Every count inside a range reuses that range's artifact, so many counts cost one compile per range. Below
    the threshold either 1 or counts in ``[2, lo)`` are drawn: both ways reach the no-SP range, 1 through the
    capture's trace hint (sp_lab's capture is symbolic from 1 token).
    """
    counts: set[int] = set()
    if lo > 1 and low_range:
        if lo == 2 or rng.random() < 0.5:
            counts.add(1)
        else:
            counts.update({lo - 1, rng.randint(2, lo - 1)})
    above = {lo, min(lo + 1, hi), hi}
    pool = [t for t in range(max(lo, 2), hi + 1)]
    above.update(rng.sample(pool, min(3, len(pool))))
    not_multiple = [t for t in pool if t % tp]
    if not_multiple and not any(t % tp for t in above if t > 1):
        above.add(rng.choice(not_multiple))
    counts.update(above)
    ordered = sorted(counts)
    rng.shuffle(ordered)  # calls in random order: an artifact must not depend on the count that built it
    return tuple(ordered)


def draw_case(
    rng: random.Random,
    *,
    seed: int,
    index: int,
    tp: int,
    shape: dict[str, int],
    strategy: tuple[str, str],
    residual_inplace: bool,
    layers: tuple[int, int],
    max_tokens: int,
) -> FuzzCase:
    boundary, mode = strategy
    lo_layers, hi_layers = layers
    if boundary == "gather_erase" and residual_inplace:
        # The stale residual only reaches a later piece with 2+ layers: keep the finding observable.
        lo_layers = max(2, lo_layers)
    shape = dict(shape, num_layers=rng.randint(lo_layers, max(lo_layers, hi_layers)))
    lo = rng.choice([1, 2, rng.randint(3, 12)]) if boundary not in ("none",) else rng.randint(2, 12)
    hi = min(max_tokens, lo + rng.randint(3, 24))
    # none fails at the first SP-range call and gather_erase's finding lives in the SP range: one count below
    # the threshold is enough for them (it shows the range without SP is unaffected).
    counts = draw_token_counts(rng, tp, lo, hi, low_range=True)
    if boundary == "none":
        below = sorted(t for t in counts if t < lo)[:1]
        counts = (*below, lo, hi)  # the first SP-range call must raise; hi is never reached
    return FuzzCase(
        seed=seed,
        index=index,
        tp=tp,
        shape=shape,
        residual_inplace=residual_inplace,
        boundary=boundary,
        compile_mode=mode,
        async_tp_min_tokens=lo,
        max_num_tokens=hi,
        token_counts=counts,
    )


def draw_profile(
    seed: int,
    *,
    tp: int,
    num_cases: int,
    num_shapes: int,
    layers: tuple[int, int],
    max_tokens: int = 40,
    start: int = 0,
) -> list[FuzzCase]:
    """Cases ``start .. start + num_cases - 1`` over ``num_shapes`` drawn widths (cases share widths: Inductor's
    kernel cache then serves the later strategies). Strategy x residual form pairs are dealt round-robin from a
    shuffled deck, so any 10 consecutive cases cover all five strategies with both residual forms. Case ``i``
    has a generator of its own: it is the same case whichever chunk of the profile draws it."""
    rng = random.Random(f"{seed}-tp{tp}")
    shapes = [draw_shape(rng, tp) for _ in range(num_shapes)]
    deck = [(strategy, inplace) for strategy in STRATEGIES for inplace in (False, True)]
    rng.shuffle(deck)
    cases = []
    for i in range(start, start + num_cases):
        strategy, inplace = deck[i % len(deck)]
        cases.append(
            draw_case(
                random.Random(f"{seed}-tp{tp}-case{i}"), seed=seed, index=i, tp=tp, shape=shapes[i % num_shapes], strategy=strategy,
                residual_inplace=inplace, layers=layers, max_tokens=max_tokens,
            )
        )  # fmt: skip
    return cases


def _ci_cases() -> list[FuzzCase]:
    """Six tp=2 cases: the five strategies and gather_erase with an in-place residual, on one shape."""
    # One width (its kernels are built once and shared by every strategy) and two layers (a middle piece).
    cases = draw_profile(SEED, tp=2, num_cases=10, num_shapes=1, layers=(2, 2))
    chosen: dict[tuple[str, str, bool], FuzzCase] = {}
    for case in cases:  # first case of each strategy, plus the in-place gather_erase one
        key = (case.boundary, case.compile_mode, case.boundary == "gather_erase" and case.residual_inplace)
        chosen.setdefault(key, case)
    return list(chosen.values())


CI_CASES = _ci_cases()


# ---------------------------------------------------------------------------------------------------------------
# Running cases (inside every rank)


def _input_ids(num_tokens: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens))


def run_case(case: FuzzCase, *, rank: int, numerics: bool = True) -> dict[str, Any]:
    """Compile ``case`` on this rank and call it at every count; per count, what ran and the error vs eager.

    Returns ``{"counts": {n: {...}}, "error": None | (type name, message), "seconds": float}``. Errors from the
    compiled model are returned, not raised, so one bad case does not hide the others.
    """
    torch._dynamo.reset()  # every case re-traces the toy's forward: stay below Dynamo's recompile limit
    started = time.perf_counter()
    overrides = dict(case.shape, residual_inplace=case.residual_inplace)
    model = sp_lab.models.build("toy", tp_rank=rank, tp_size=case.tp, **overrides)
    reference = sp_lab.models.build("toy", tp_rank=0, tp_size=1, **overrides) if numerics else None
    compiled = sp_lab.compile(model, case.config())
    out: dict[str, Any] = {"counts": {}, "error": None}
    for n in case.token_counts:
        ids = _input_ids(n, case.shape["vocab_size"])
        try:
            logits = compiled(ids)
        except Exception as error:  # noqa: BLE001 - recorded and asserted on by the caller
            out["error"] = (type(error).__name__, str(error))
            break
        rng = compiled.report.range_for(n)
        record = {
            "shape": tuple(logits.shape),
            "sp_range": rng.enable_sp,
            "unsafe": rng.numerically_unsafe,
            "sp_rewrites": compiled.report.sp_rewrites(n),
            "fusion_fired": compiled.report.fusion_fired(n),
            "op_counts": {k: compiled.report.op_counts(n)[k] for k in COUNTED},
        }
        if numerics:
            with torch.no_grad():
                expected = reference(ids)
            record["max_abs_error"] = (logits - expected).abs().max().item()
        out["counts"][n] = record
    out["seconds"] = time.perf_counter() - started
    return out


def _run_cases_on_rank(cases: list[FuzzCase]) -> dict[int, dict[str, Any]]:
    """Each case by its index; one that raises is recorded as such and the next runs (rank_checks.run_cases)."""
    rank = dist.get_rank()
    return rank_checks.run_cases(cases, lambda case: case.index, lambda case: run_case(case, rank=rank))


def _launch(cases: list[FuzzCase], *, timeout: float = 580.0) -> list[dict[int, dict[str, Any]]]:
    world = {case.tp for case in cases}
    assert len(world) == 1, "one launch runs one tp size"
    return sp_lab.launch(_run_cases_on_rank, cases, world_size=world.pop(), backend="gloo", timeout=timeout)


# ---------------------------------------------------------------------------------------------------------------
# Checking results (in the caller)


def check_op_counts(case: FuzzCase, num_tokens: int, counts: dict[str, int]) -> None:
    """What the report says ran at ``num_tokens``, for any width, depth and tp (L = layers):

    - below the threshold, plain TP: ``2L + 1`` all_reduces (embedding, o_proj and down_proj per layer) and the
      logits' vocab all_gather, nothing else;
    - in the SP range, no all_reduce left: one reduce_scatter (the embedding's), ``2L + 1`` all_gather+matmul
      fusions (qkv and gate_up per layer, the LM head) and ``2L`` matmul+reduce_scatter fusions (o_proj, down_proj);
      with ``sharded`` / ``full_graph`` the only plain all_gather is the logits' (the residual crosses every
      boundary as a shard), the in-piece strategies gather at boundaries too.
    """
    layers, where = case.shape["num_layers"], (case.label, num_tokens, counts)
    if num_tokens < case.async_tp_min_tokens:
        assert counts == {"all_reduce": 2 * layers + 1, "reduce_scatter": 0, "all_gather": 1,
                          "fused_all_gather_matmul": 0, "fused_matmul_reduce_scatter": 0}, where  # fmt: skip
        return
    assert counts["all_reduce"] == 0 and counts["reduce_scatter"] == 1, where
    assert counts["fused_all_gather_matmul"] == 2 * layers + 1, where
    assert counts["fused_matmul_reduce_scatter"] == 2 * layers, where
    if case.boundary == "sharded":
        assert counts["all_gather"] == 1, where
    else:
        assert counts["all_gather"] > 1, where


def check_case(case: FuzzCase, per_rank: list[dict[str, Any]]) -> None:
    """Assert ``case``'s expected outcome on every rank (see the module docstring's table)."""
    where = f"case {case.label}; rerun alone with: python tests/{Path(__file__).name} '{case.to_json()}'"
    for rank, got in enumerate(per_rank):
        counts, error = got["counts"], got["error"]
        raised = f"rank {rank} raised {error[0]}: {error[1]}" if error else f"rank {rank} raised nothing"
        if case.expect == "boundary_error":
            assert error is not None and error[0] == BoundaryError.__name__, f"{raised}\n{where}"
            assert "boundary='none'" in error[1], f"{raised}\n{where}"
            # It failed at the first SP-range count called, after every count called before it (all below the
            # threshold) had run cleanly.
            before = list(itertools.takewhile(lambda n: n < case.async_tp_min_tokens, case.token_counts))
            assert list(counts) == before, (rank, list(counts), before, where)
            assert all(r["max_abs_error"] <= ATOL for r in counts.values()), (rank, counts, where)
            continue
        assert error is None, f"{raised} after counts {list(counts)}\n{where}"
        assert set(counts) == set(case.token_counts), where
        vocab = case.shape["vocab_size"]
        for n, r in counts.items():
            assert r["shape"] == (n, vocab), (rank, n, r["shape"], where)
            in_sp = n >= case.async_tp_min_tokens
            assert r["sp_range"] == in_sp, (rank, n, where)
            check_op_counts(case, n, r["op_counts"])
            if not in_sp:  # below the threshold: plain TP, exact, never flagged
                assert r["max_abs_error"] <= ATOL and not r["unsafe"], (rank, n, r, where)
                assert r["sp_rewrites"] == 0 and not r["fusion_fired"], (rank, n, r, where)
                continue
            # The SP range really ran SP + AsyncTP: not a vacuous comparison.
            assert r["sp_rewrites"] > 0 and r["fusion_fired"], (rank, n, r, where)
            if case.expect == "equal":
                assert r["max_abs_error"] <= ATOL, (rank, n, r["max_abs_error"], where)
                assert not r["unsafe"], (rank, n, where)
            else:  # "unsafe": gather_erase dropped the in-place residual update, and says so
                assert r["unsafe"], (rank, n, where)
                assert r["max_abs_error"] > UNSAFE_MIN_ERROR, (rank, n, r["max_abs_error"], where)


def fuzz_figures(cases: list[FuzzCase], results: list[dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Cases and (case, token count) calls checked, and the largest error where equality was expected."""
    calls = sum(len(results[0][c.index]["counts"]) for c in cases)
    worst = max(
        (r["max_abs_error"] for c in cases if c.expect == "equal" for ranks in results
         for r in ranks[c.index]["counts"].values()),
        default=0.0,
    )  # fmt: skip
    return {"cases": len(cases), "calls": calls, "worst_equal_error": worst}


# ---------------------------------------------------------------------------------------------------------------
# CI profile


def test_generator_is_deterministic_and_covers_what_the_issue_asks():
    again = _ci_cases()
    assert [c.to_json() for c in again] == [c.to_json() for c in CI_CASES]
    assert {(c.boundary, c.compile_mode) for c in CI_CASES} == set(STRATEGIES)
    assert {c.residual_inplace for c in CI_CASES} == {False, True}
    assert any(c.expect == "unsafe" for c in CI_CASES)
    counts = [(c, n) for c in CI_CASES for n in c.token_counts]
    assert any(n == 1 for _, n in counts)
    assert any(n < c.async_tp_min_tokens for c, n in counts) and any(n >= c.async_tp_min_tokens for c, n in counts)
    assert any(n % c.tp for c, n in counts if n >= c.async_tp_min_tokens and n > 1), "no odd SP-range count"
    assert any(n == c.max_num_tokens for c, n in counts)
    for case in draw_profile(SEED, tp=4, num_cases=20, num_shapes=5, layers=(1, 3)):
        for key in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            assert case.shape[key] % 4 == 0, (key, case.shape)
        assert all(1 <= n <= case.max_num_tokens for n in case.token_counts)
        assert FuzzCase.from_json(case.to_json()) == case


assert {case.tp for case in CI_CASES} == {rank_checks.WORLD_SIZE}, "the CI cases run in the shared 2-rank launch"
rank_checks.register(__name__, _run_cases_on_rank, CI_CASES, timeout=580.0)


@pytest.fixture(scope="module")
def ci_results(gloo_checks) -> list[dict[int, dict[str, Any]]]:
    return rank_checks.results_of(gloo_checks, __name__)


@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c.label)
def test_compiled_matches_eager_reference(ci_results, case):
    check_case(case, rank_checks.case_results(ci_results, case.index))


def widened(case: FuzzCase, tp: int) -> FuzzCase:
    """``case`` at a larger tp with the same per-rank widths (heads, MLP and vocab shards scaled by tp).

    Inductor's kernels depend on the per-rank shapes only, so the widened case reuses the kernels the tp=2
    ranks compiled: a tp=4 trace for the price of lowering, not of a C++ build.
    """
    scale, shape = tp // case.tp, dict(case.shape)
    head_dim = shape.pop("head_dim", None) or shape["hidden_size"] // shape["num_heads"]
    for key in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        shape[key] *= scale
    rng = random.Random(case.to_json())
    counts = draw_token_counts(rng, tp, case.async_tp_min_tokens, case.max_num_tokens, low_range=True)
    return dataclasses.replace(case, tp=tp, shape={**shape, "head_dim": head_dim}, token_counts=counts)


# sp_lab's CPU fused ops call torch.distributed's all_gather_into_tensor, which torch 2.13 deprecates.
FAKE_GROUP_WARNING = "ignore:.*all_gather_into_tensor.*deprecated:FutureWarning"


@pytest.mark.filterwarnings(FAKE_GROUP_WARNING)
def test_tp4_on_the_fake_group_traces_with_the_expected_op_counts():
    """tp=4 without 4 processes: op counts per range and output shapes (the fake group returns no numbers)."""
    base = next(c for c in CI_CASES if (c.boundary, c.compile_mode) == ("sharded", "piecewise"))
    check_traced(widened(base, 4))


def check_traced(case: FuzzCase) -> None:
    """Compile ``case`` on the fake group in this process: every count runs, logits have the right shape and
    the op counts follow :func:`check_op_counts`."""
    with fake_process_group(case.tp):
        got = run_case(case, rank=0, numerics=False)
    torch._dynamo.reset()
    raised = f"{case.label}: {got['error'][0]}: {got['error'][1]}" if got["error"] else f"{case.label}: no error"
    where = f"{raised}\ncase: {case.to_json()}"
    if case.expect == "boundary_error":
        assert got["error"] is not None and got["error"][0] == BoundaryError.__name__, where
        return
    assert got["error"] is None, f"{where}\nafter counts {list(got['counts'])}"
    assert set(got["counts"]) == set(case.token_counts), case.label
    for n, r in got["counts"].items():
        assert r["shape"] == (n, case.shape["vocab_size"]), (case.label, n)
        check_op_counts(case, n, r["op_counts"])


@pytest.mark.filterwarnings(FAKE_GROUP_WARNING)
def test_an_sp_range_ending_at_tp_plus_one_serves_every_count():
    """Regression: an SP range ending at tp + 1 compiled an artifact specialised to
    N = tp + 1, and every other count failed (piecewise with a BoundaryError blaming the residual, full_graph with
    a raw AssertionError 'expected size 2==3'). Fixed in 760dc85 (the token symbol's bounds are widened)."""
    base = next(c for c in CI_CASES if (c.boundary, c.compile_mode) == ("sharded", "piecewise"))
    case = dataclasses.replace(base, async_tp_min_tokens=1, max_num_tokens=base.tp + 1, token_counts=(2, 3))
    check_traced(case)


# ---------------------------------------------------------------------------------------------------------------
# Long profile (outside CI): pytest -m slow tests/test_fuzz_equivalence.py -s

LONG_TP2_CHUNKS = 4
"""tp=2 chunks, one launch each (each launch stays well inside pytest's 600 s per-test timeout)."""
LONG_CASES_PER_CHUNK = 10
"""Ten consecutive cases: all five strategies with both residual forms."""


def _check_all(cases: list[FuzzCase], results: list[dict[int, dict[str, Any]]], what: str) -> None:
    for case in cases:
        check_case(case, rank_checks.case_results(results, case.index))
    print(f"\n{what}: {fuzz_figures(cases, results)}")


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(LONG_TP2_CHUNKS))
def test_long_profile_tp2(chunk):
    cases = draw_profile(
        SEED + 1, tp=2, num_cases=LONG_CASES_PER_CHUNK, num_shapes=LONG_TP2_CHUNKS, layers=(1, 3), max_tokens=64,
        start=chunk * LONG_CASES_PER_CHUNK,
    )  # fmt: skip
    _check_all(cases, _launch(cases), f"long tp2 chunk {chunk}")


@pytest.mark.slow
def test_long_profile_tp4_on_four_gloo_ranks():
    """tp=4 numerics: 4 ranks on 2 cores is slow, hence few cases over one width."""
    cases = draw_profile(SEED + 1, tp=4, num_cases=5, num_shapes=1, layers=(1, 2), max_tokens=32)
    _check_all(cases, _launch(cases), "long tp4")


@pytest.mark.slow
@pytest.mark.filterwarnings(FAKE_GROUP_WARNING)
@pytest.mark.parametrize("tp", [4, 8])
def test_long_profile_traced(tp):
    for case in draw_profile(SEED + 2, tp=tp, num_cases=10, num_shapes=2, layers=(1, 3), max_tokens=64):
        check_traced(case)


if __name__ == "__main__":
    # python tests/test_fuzz_equivalence.py '<FuzzCase JSON>': that one case on its tp gloo ranks, checked.
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/test_fuzz_equivalence.py '<FuzzCase JSON from a failure message>'")
    # Run through the importable module, so the ranks unpickle its functions by name, not by value.
    sys.path.insert(0, str(Path(__file__).parent))
    import test_fuzz_equivalence as fuzz

    one = fuzz.FuzzCase.from_json(sys.argv[1])
    results = fuzz._launch([one])
    fuzz.check_case(one, fuzz.rank_checks.case_results(results, one.index))
    errors = {n: r["max_abs_error"] for n, r in results[0][one.index]["counts"].items()}
    print(f"{one.label}: as expected ({one.expect}); max abs error per token count: {errors}")
