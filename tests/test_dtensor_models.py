"""Models parallelised with ``torch.distributed.tensor.parallel`` (DTensor plans), compiled by sp_lab.

``tp_models.TinyTitan`` is a torchtitan-style Llama on ``[1, seq, dim]`` activations (``token_dim=1``):

- op counts on the fake group (in process, inspect-only: every pass runs, no code generation), every plan under
  every compile mode and boundary strategy;
- numerics on 2 gloo ranks against the unsharded model run eagerly.

Plans: ``tp`` (Colwise/Rowwise, PrepareModuleInput/Output; DTensor all_reduces that sp_lab's SP rewrites),
``tp_dtensor_ffn`` (the same with ``use_local_output=False`` in the FFN), ``titan_sp`` (torchtitan's plan with
``SequenceParallel``: DTensor's own all_gather / reduce_scatter, which SP must leave alone and AsyncTP fuses once
``passes/dtensor_collectives.py`` has restated them on ``[N, H]``). ``titan_sp`` runs at token counts that tp
divides only -- ``from_local`` without a shape assumes even shards, and eagerly 13 tokens on 2 ranks abort in
gloo -- so sp_lab traces its ranges at such a count and refuses the others by name, on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import rank_checks
import torch
import torch.distributed as dist
from tp_models import ATTENTION_OP, TinyTitan, parallel_titan

import sp_lab
from sp_lab.compiler.capture import SharedCaptures
from sp_lab.distributed.collectives import fake_process_group
from sp_lab.rules import MatmulRule

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor"))

TP = 2
MIN_TOKENS = 8
MODES = [("gather_erase", "piecewise"), ("gather", "piecewise"), ("sharded", "piecewise"), ("sharded", "full_graph")]


def config(boundary: str, mode: str, **overrides: Any) -> sp_lab.LabConfig:
    return sp_lab.LabConfig(tp_size=TP, async_tp_min_tokens=MIN_TOKENS, max_num_tokens=64, token_dim=1,
                            splitting_ops=[ATTENTION_OP], boundary=boundary, compile_mode=mode, **overrides)


def _label(plan: str, boundary: str, mode: str) -> str:
    return f"{plan}-{boundary if mode == 'piecewise' else mode}"


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n))


# -- fake group: op counts ----------------------------------------------------------------------------------


# Every mode on the main plan; the use_local_output=False plan once. The SP range only, except one check below it.
FAKE_CASES = [("tp", b, m) for b, m in MODES] + [("tp_dtensor_ffn", "sharded", "piecewise")]
# torchtitan's plan: its other modes run on the gloo ranks below, with their op counts.
SP_PLAN_CASES = [("titan_sp", "sharded", "full_graph"), ("titan_sp", "gather_erase", "piecewise")]
SP_PLAN_CASE = SP_PLAN_CASES[0]


def _counts(report: Any, n: int) -> dict[str, Any]:
    """Op counts at ``n`` tokens after the passes, before them (summed over the range's pieces), and matches."""
    rng = report.range_for(n)
    before: dict[str, int] = {}
    for piece in rng.pieces:
        for key, value in piece.op_counts_before.items():
            before[str(key)] = before.get(str(key), 0) + value
    return {"after": {str(k): v for k, v in report.op_counts(n).items()}, "before": before,
            "matches": {str(k): v for k, v in rng.matches().items()}}


@pytest.fixture(scope="module")
def fake() -> dict[str, Any]:
    results = {}
    with fake_process_group(TP):
        # One Dynamo capture per plan, shared by its configs (a DTensor model's capture is the costly part).
        models = {plan: parallel_titan(plan, TP) for plan in ("tp", "tp_dtensor_ffn", "titan_sp")}
        captures = {plan: SharedCaptures(model) for plan, model in models.items()}
        for plan, boundary, mode in [*FAKE_CASES, *SP_PLAN_CASES]:
            compiled = sp_lab.compile(models[plan], config(boundary, mode), inspect_only=True,
                                      captures=captures[plan])
            counts = (12, 4) if (plan, boundary, mode) == ("tp", "sharded", "piecewise") else (12,)
            for n in counts:
                compiled(_tokens(n))
            results[_label(plan, boundary, mode)] = {
                n: (compiled.report.op_counts(n), compiled.report.sp_rewrites(n)) for n in counts}
            if plan == "titan_sp":
                results[_label(plan, boundary, mode)]["counts"] = _counts(compiled.report, 12)
            if (plan, boundary, mode) == SP_PLAN_CASE:
                results["titan_sp_guards"] = compiled.report.range_for(12).token_guards
                with pytest.raises(ValueError) as odd:
                    compiled(_tokens(13))
                results["titan_sp_odd"] = str(odd.value)
        rejected = sp_lab.compile(models["titan_sp"], config(*SP_PLAN_CASE[1:], heuristic=MatmulRule.always("no_fuse")),
                                  inspect_only=True, captures=captures["titan_sp"])
        rejected(_tokens(12))
        results["titan_sp_no_fuse"] = _counts(rejected.report, 12)
    return results


@pytest.mark.parametrize("case", FAKE_CASES, ids=lambda c: _label(*c))
def test_dtensor_all_reduces_become_sp_and_fuse(fake, case):
    counts, rewrites = fake[_label(*case)][12]
    # 2 layers x (attention wo + FFN w2): four all_reduces from RowwiseParallel, each now a fused mm+RS.
    assert rewrites == 4
    assert counts["all_reduce"] == 0 and counts["fused_matmul_reduce_scatter"] == 4, counts
    # Layer 1's q/k/v/w1/w3, layer 0's w1/w3 and the output head read the sharded residual: fused AG+mm.
    assert counts["fused_all_gather_matmul"] == 8, counts


def test_below_the_threshold_dtensor_keeps_its_all_reduces(fake):
    counts, rewrites = fake[_label("tp", "sharded", "piecewise")][4]
    assert rewrites == 0 and counts["all_reduce"] == 4 and counts["fused_matmul_reduce_scatter"] == 0, counts


@pytest.mark.parametrize("case", SP_PLAN_CASES, ids=lambda c: _label(*c))
def test_a_plan_with_sequence_parallel_is_not_rewritten_again(fake, case):
    _, rewrites = fake[_label(*case)][12]
    before = fake[_label(*case)]["counts"]["before"]
    # DTensor already placed reduce_scatters (embedding + 2 x 2 row-parallel layers) and all_gathers (2 x 2
    # PrepareModuleInput + the output head's input and its logits): SP finds no all_reduce to rewrite.
    assert rewrites == 0
    assert before["all_reduce"] == 0 and before["reduce_scatter"] == 5 and before["all_gather"] == 6, before


def test_a_plan_with_sequence_parallel_rejects_token_counts_it_cannot_shard_evenly(fake):
    # SequenceParallel's from_local (no shape) sizes the Shard(1) DTensors as 2 x the local shard: eagerly, 13
    # tokens on 2 ranks end in a gloo abort. sp_lab says so before Dynamo traces the count.
    message = fake["titan_sp_odd"]
    assert message.startswith("13 tokens:") and "multiple of 2" in message and "(here 14)" in message, message
    assert "DTensor.from_local" in message, message


def test_the_range_records_what_its_trace_assumed_about_the_token_count(fake):
    # Traced at a count Dynamo's guards accept (even), the artifact is valid for even counts only.
    assert "Eq(Mod(N, 2), 0)" in fake["titan_sp_guards"], fake["titan_sp_guards"]


def test_a_range_is_traced_at_a_count_the_captured_graph_accepts():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from sp_lab.compiler.fake_inputs import TokenGuards, _trace_hint

    env = ShapeEnv()
    n = env.create_symintnode(env.create_symbol(12, ConstantSource("n")), hint=12)
    assert _trace_hint(8, TokenGuards.of(env, n)) == 61  # nothing assumed yet: the odd default
    assert n % 2 == 0  # what DTensor's even-shard arithmetic makes Dynamo guard
    guards = TokenGuards.of(env, n)
    assert guards.violated(13) == ["Eq(Mod(N, 2), 0)"] and guards.hold(14)
    assert _trace_hint(8, guards) == 62


def _assert_seq_dim_collectives_fused(counts: dict[str, Any]) -> None:
    after, matches = counts["after"], counts["matches"]
    # DTensor's Shard(1) collectives restated on [N, H]: 5 reduce_scatters (embedding, 2 x (wo, w2)); each of the
    # 11 matmuls reading a gathered residual (2 x (q, k, v, w1, w3) + the output head) gets its own gather.
    assert matches.get("dtensor_seq_reduce_scatter") == 5 and matches.get("dtensor_seq_all_gather") == 11, matches
    assert after["fused_all_gather_matmul"] == 11 and after["fused_matmul_reduce_scatter"] == 4, after
    # Left: the embedding's reduce_scatter (no matmul before it) and the logits' gather (Shard(-1), not tokens).
    assert after["reduce_scatter"] == 1 and after["all_gather"] == 1, after


@pytest.mark.parametrize("case", SP_PLAN_CASES, ids=lambda c: _label(*c))
def test_a_plan_with_sequence_parallel_gets_its_collectives_fused(fake, case):
    _assert_seq_dim_collectives_fused(fake[_label(*case)]["counts"])


def test_gathers_the_heuristic_leaves_unfused_are_merged_back(fake):
    # Each matmul got its own gather for AsyncTP; where the rule says no_fuse, they are one gather again per shard:
    # DTensor's own six, and its five reduce_scatters.
    after = fake["titan_sp_no_fuse"]["after"]
    assert after["fused_all_gather_matmul"] == 0 and after["fused_matmul_reduce_scatter"] == 0, after
    assert after["all_gather"] == 6 and after["reduce_scatter"] == 5, after


# -- 2 gloo ranks: numerics against the unsharded model -------------------------------------------------------

# (plan, boundary, mode): gather_erase equals gather here (no in-place residual), so it is checked on the fake
# group only. torchtitan's plan (titan_sp): DTensor's SequenceParallel makes its Shard(1) DTensors with from_local
# and no global shape, so the graph holds only for token counts tp divides (Dynamo guards Eq(Mod(N, 2), 0)); sp_lab
# traces each range at a count those guards accept and refuses odd counts by name.
TITAN_SP_CASES = [("titan_sp", "sharded", "full_graph"), ("titan_sp", "sharded", "piecewise"),
                  ("titan_sp", "gather", "piecewise")]
NUMERIC_CASES = [c for c in FAKE_CASES if c[1] != "gather_erase"] + TITAN_SP_CASES
# torchtitan's plan runs at even counts only (see the fake-group test above): 13 must raise on every rank.
COUNTS = {"titan_sp": (12, 14, 13)}


def _numerics_worker(cases) -> dict[str, Any]:
    reference = TinyTitan()
    models = {plan: parallel_titan(plan, dist.get_world_size()) for plan in dict.fromkeys(c[0] for c in cases)}
    captures = {plan: SharedCaptures(model) for plan, model in models.items()}

    def run_case(case) -> dict[str, Any]:
        plan, boundary, mode = case
        compiled = sp_lab.compile(models[plan], config(boundary, mode), captures=captures[plan])
        diffs = {}
        for n in COUNTS.get(plan, (12, 13)):
            try:
                with torch.no_grad():
                    diffs[n] = (compiled(_tokens(n)) - reference(_tokens(n))).abs().max().item()
            except ValueError as e:
                diffs[n] = str(e)
        return {"diffs": diffs, "fused": compiled.report.fusion_fired(12), "counts": _counts(compiled.report, 12)}

    return rank_checks.run_cases(cases, lambda c: _label(*c), run_case)  # a case that raises fails its own test


rank_checks.register(__name__, _numerics_worker, NUMERIC_CASES, timeout=900.0)


@pytest.fixture(scope="module")
def gloo(gloo_checks) -> list[dict[str, Any]]:
    return rank_checks.results_of(gloo_checks, __name__)


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=lambda c: _label(*c))
def test_compiled_dtensor_model_matches_the_unsharded_model(gloo, case):
    for rank, got in enumerate(rank_checks.case_results(gloo, _label(*case))):
        diffs = {n: d for n, d in got["diffs"].items() if not (case[0] == "titan_sp" and n % 2)}
        assert all(isinstance(d, float) and d < 1e-4 for d in diffs.values()), (rank, got["diffs"])
        assert got["fused"], (rank, got)
        if case[0] == "titan_sp":
            _assert_seq_dim_collectives_fused(got["counts"])


@pytest.mark.parametrize("case", TITAN_SP_CASES, ids=lambda c: _label(*c))
def test_an_odd_count_is_refused_on_every_rank_instead_of_aborting_in_gloo(gloo, case):
    for rank, got in enumerate(rank_checks.case_results(gloo, _label(*case))):
        odd = got["diffs"][13]
        assert isinstance(odd, str) and odd.startswith("13 tokens:") and "multiple of 2" in odd, (rank, odd)
