"""The SP and AsyncTP passes on plain PyTorch code, in one process under the fake group (no Inductor).

Each test writes a function the way a user would -- functional collectives, ``F.linear`` / ``@`` /
``torch.matmul``, ``F.rms_norm`` or the hand-written RMSNorm -- captures it with Dynamo and AOT autograd
exactly as the sharded backend does (token count symbolic via ``mark_dynamic``), runs a pass on the aten
graph, and counts ops. The passes must match this code, not only sp_lab's own layers. Numbers come from
the fake group, so only graphs are asserted here; numerics are in ``test_compiler_backend.py`` (gloo).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import rank_checks
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import fx
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.symbolic_shapes import statically_known_true
from tp_models import Fp8Stack

from sp_lab.compiler.inspection import op_counts
from sp_lab.compiler.passes.async_tp import apply_async_tp
from sp_lab.compiler.passes.boundary import BoundaryPolicy
from sp_lab.compiler.passes.sequence_parallel import apply_sequence_parallel
from sp_lab.config import BoundaryStrategy
from sp_lab.distributed.collectives import fake_process_group
from sp_lab.rules import Leaf, MatmulRule, Split

TP = 2
HIDDEN = 16


@pytest.fixture(scope="module")
def group():
    with fake_process_group(TP) as pg:
        yield pg


def capture(fn: Callable, transform: Callable[[fx.Graph], Any], *args: torch.Tensor,
            dynamic: tuple[tuple[int, int], ...] = ((0, 0),), keep_mutations: bool = False) -> dict[str, Any]:
    """Run ``transform`` on the aten graph of ``fn(*args)`` and call it once. ``dynamic``: the (argument,
    dimension) pairs marked symbolic (the tokens: dim 0 of ``args[0]``); ``keep_mutations``: an input updated in
    place is written back by a ``copy_`` inside the graph (the epilogue sp_lab's compiles keep), not after it.

    Returns {"before", "after": op counts, "result": what ``transform`` returned, "out": the output}.
    The transform runs inside AOT's forward compiler, i.e. in Dynamo's fake mode with the token symbol
    live, as it does in the backend.
    """
    seen: dict[str, Any] = {}

    def backend(gm: fx.GraphModule, example_inputs: list) -> Callable:
        def forward_compiler(aten_gm: fx.GraphModule, _inputs: list) -> Callable:
            seen["before"] = op_counts(aten_gm.graph)
            seen["result"] = transform(aten_gm.graph)
            aten_gm.recompile()
            seen["after"] = op_counts(aten_gm.graph)
            return make_boxed_func(aten_gm.forward)

        return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler,
                                     decompositions=select_decomp_table(), keep_inference_input_mutations=keep_mutations)

    torch._dynamo.reset()
    for index, dim in dynamic:
        torch._dynamo.mark_dynamic(args[index], dim)
    with torch.no_grad():
        seen["out"] = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen


def sequence_parallel(graph: fx.Graph):
    return apply_sequence_parallel(graph, tp_size=TP, rank=0, group_name=None,
                                   policy=BoundaryPolicy(BoundaryStrategy.SHARDED))


def async_tp(graph: fx.Graph, *, rule: MatmulRule | None = None, default: str = "fuse", m_low: int = 8):
    return apply_async_tp(graph, tp_size=TP, group_name=dist.group.WORLD.group_name, use_symm_mem=False,
                          m_low=m_low, rule=rule, default=default)


# -- plain PyTorch models -----------------------------------------------------------------------------------


def hand_written_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The usual RMSNorm spelling (HF Llama): fp32 up-cast, mean of squares, rsqrt."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def four_norms(x, w0, w1, w2, w3, n0, n1, n2, n3):
    """[T, H] -> [T, H]: four ``linear -> all_reduce -> RMSNorm`` blocks, both RMSNorm spellings."""
    h = x
    for i, (w, n) in enumerate(((w0, n0), (w1, n1), (w2, n2), (w3, n3))):
        y = funcol.all_reduce(F.linear(h, w), "sum", dist.group.WORLD)
        h = F.rms_norm(y, (y.shape[-1],), n, 1e-6) if i % 2 else hand_written_rms_norm(y, n)
    return h


def residual_blocks(x, w0, w1, n0, n1):
    """[T, H] -> [T, H]: vLLM's residual shape, ``residual = y + residual; h = norm(residual)``, twice."""
    residual = x
    h = x
    for w, n in ((w0, n0), (w1, n1)):
        y = funcol.all_reduce(h @ w, "sum", dist.group.WORLD)
        residual = y + residual
        h = hand_written_rms_norm(residual, n)
    return h + residual


def all_gather_matmul(a, b):
    """[T/tp, K] x [K, N] -> [T, N]."""
    return torch.matmul(funcol.all_gather_tensor(a, 0, dist.group.WORLD), b)


def matmul_reduce_scatter(a, b):
    """[T, K] x [K, N] -> [T/tp, N]."""
    return funcol.reduce_scatter_tensor(a @ b, "sum", 0, dist.group.WORLD)


def two_all_gather_matmuls(a, b_narrow, b_wide):
    """Two independent AG+mm pairs whose weights differ in N (8 and 64): a per-matmul rule can tell them apart."""
    return (torch.matmul(funcol.all_gather_tensor(a, 0, dist.group.WORLD), b_narrow).sum(-1)
            + torch.matmul(funcol.all_gather_tensor(a * 2, 0, dist.group.WORLD), b_wide).sum(-1))


def _four_norm_args(tokens: int = 6) -> list[torch.Tensor]:
    return ([torch.randn(tokens, HIDDEN)] + [torch.randn(HIDDEN, HIDDEN) for _ in range(4)]
            + [torch.randn(HIDDEN) for _ in range(4)])


# -- sequence parallelism ----------------------------------------------------------------------------------


def test_four_rms_norms_after_all_reduce_become_reduce_scatter_and_all_gather(group):
    seen = capture(four_norms, sequence_parallel, *_four_norm_args())
    assert seen["before"]["all_reduce"] == 4
    after = seen["after"]
    assert (after["all_reduce"], after["reduce_scatter"], after["all_gather"]) == (0, 4, 4), after
    assert after["mm"] == 4
    assert len(seen["result"].rewrites) == 4
    assert seen["out"].shape == (6, HIDDEN)


def test_sequence_parallel_with_residual_add_keeps_the_residual_sharded(group):
    args = [torch.randn(7, HIDDEN)] + [torch.randn(HIDDEN, HIDDEN) for _ in range(2)] + [torch.randn(HIDDEN)] * 2
    seen = capture(residual_blocks, sequence_parallel, *args)
    forms = [r.form for r in seen["result"].rewrites]
    # The first rewrite's residual enters full (the input); the second joins the first's sharded residual.
    assert forms == ["first", "last"], forms
    # One all_gather feeds the second matmul, one gathers the graph output; the residual itself never is.
    assert (seen["after"]["all_reduce"], seen["after"]["reduce_scatter"], seen["after"]["all_gather"]) == (0, 2, 2)
    assert seen["out"].shape == (7, HIDDEN)  # 7 tokens: padded to 8 for the scatter and sliced back


@pytest.mark.parametrize("batch", [2, 3])
def test_sequence_parallel_shards_the_token_rows_of_a_batch(group, batch):
    # [B, S, H] (token_dim=1): the B * S rows are sharded; B = 3, S = 7 pads 21 rows to 22 for the scatter.
    args = [torch.randn(batch, 7, HIDDEN)] + [torch.randn(HIDDEN, HIDDEN) for _ in range(2)] + [torch.randn(HIDDEN)] * 2
    seen = capture(residual_blocks, sequence_parallel, *args, dynamic=((0, 1),))
    assert [r.form for r in seen["result"].rewrites] == ["first", "last"]
    assert (seen["after"]["all_reduce"], seen["after"]["reduce_scatter"], seen["after"]["all_gather"]) == (0, 2, 2)
    assert seen["out"].shape == (batch, 7, HIDDEN)


def test_sequence_parallel_gathers_before_an_operand_that_varies_along_seq_only(group):
    # pos [S, H] broadcasts over the batch of y [B, S, H]: it is not token-major in B * S rows, so the add needs
    # every token (a shard of y's rows does not line up with any rows of pos).
    def add_positions(x, w, pos):
        return funcol.all_reduce(x @ w, "sum", dist.group.WORLD) + pos

    # B = 3: a shard of ceil(3 * S / 2) rows (at B = tp = 2 it would be S rows and broadcast against pos silently).
    seen = capture(add_positions, sequence_parallel, torch.randn(3, 6, HIDDEN), torch.randn(HIDDEN, HIDDEN),
                   torch.randn(6, HIDDEN), dynamic=((0, 1), (2, 0)))
    assert (seen["after"]["all_reduce"], seen["after"]["reduce_scatter"], seen["after"]["all_gather"]) == (0, 1, 1)
    assert seen["out"].shape == (3, 6, HIDDEN)


def test_sequence_parallel_ignores_a_graph_without_all_reduce(group):
    seen = capture(lambda x, w: F.linear(x, w).relu(), sequence_parallel, torch.randn(6, 8), torch.randn(8, 8))
    assert seen["after"] == seen["before"]
    assert seen["result"].rewrites == []


# -- AsyncTP ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "a_rows", "fused_key", "unfused_key"),
    [
        (all_gather_matmul, 4, "fused_all_gather_matmul", "all_gather"),
        (matmul_reduce_scatter, 8, "fused_matmul_reduce_scatter", "reduce_scatter"),
    ],
    ids=["ag_mm", "mm_rs"],
)
def test_async_tp_fuses_exactly_one_op(group, fn, a_rows, fused_key, unfused_key):
    seen = capture(fn, async_tp, torch.randn(a_rows, 8), torch.randn(8, 16))
    assert seen["before"][unfused_key] == 1 and seen["before"]["mm"] == 1
    after = seen["after"]
    assert after[fused_key] == 1, after
    assert after[unfused_key] == 0 and after["mm"] == 0, after
    other = {"fused_all_gather_matmul", "fused_matmul_reduce_scatter"} - {fused_key}
    assert after[other.pop()] == 0


def test_sequence_parallel_then_async_tp_on_plain_code_fuses_every_pair(group):
    seen = capture(four_norms, lambda g: (sequence_parallel(g), async_tp(g))[1], *_four_norm_args())
    after = seen["after"]
    assert after["all_reduce"] == 0 and after["mm"] == 0, after
    # Every matmul but the first reads a gathered shard (AG+mm); the first reads the full input and feeds a
    # reduce_scatter (mm+RS). The last norm's output leaves the graph through a plain all_gather.
    assert after["fused_all_gather_matmul"] == 3 and after["fused_matmul_reduce_scatter"] == 1, after
    assert after["all_gather"] == 1


def _drop_matmul_shapes(graph: fx.Graph) -> list[str]:
    """Delete ``meta['val']`` of every mm's operands (as a pass that forgot to set it would); return the mm names."""
    names = []
    for node in graph.nodes:
        if node.target is torch.ops.aten.mm.default:
            names.append(node.name)
            for arg in node.args:
                arg.meta.pop("val", None)
    return names


@pytest.mark.parametrize("default", ["fuse", "no_fuse"])
def test_gate_warns_and_applies_the_default_when_shapes_are_unreadable(group, caplog, default):
    def transform(graph):
        mm_names = _drop_matmul_shapes(graph)
        return mm_names, async_tp(graph, default=default)

    with caplog.at_level(logging.WARNING, logger="sp_lab.compiler.passes.async_tp"):
        seen = capture(all_gather_matmul, transform, torch.randn(4, 8), torch.randn(8, 16))
    mm_names, decisions = seen["result"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(mm_names[0] in w and default in w for w in warnings), warnings
    assert [c.decision for c in decisions.candidates] == [default]
    assert decisions.candidates[0].m is None
    assert seen["after"]["fused_all_gather_matmul"] == (1 if default == "fuse" else 0), seen["after"]


def test_heuristic_is_applied_per_matmul(group):
    # Fuse only wide outputs: N = 8 stays unfused, N = 64 fuses, in one graph and one range.
    rule = MatmulRule(Split("n", 32.0, Leaf("no_fuse"), Leaf("fuse")))
    seen = capture(two_all_gather_matmuls, lambda g: async_tp(g, rule=rule),
                   torch.randn(4, 8), torch.randn(8, 8), torch.randn(8, 64))
    decisions = {c.n: c.decision for c in seen["result"].candidates}
    assert decisions == {8: "no_fuse", 64: "fuse"}
    assert all(c.m == 8 for c in seen["result"].candidates)  # judged at the range's low end
    assert seen["after"]["fused_all_gather_matmul"] == 1
    assert seen["after"]["all_gather"] == 1 and seen["after"]["mm"] == 1


def test_unsure_rule_answers_take_heuristic_default(group):
    seen = capture(all_gather_matmul, lambda g: async_tp(g, rule=MatmulRule.always("unsure"), default="no_fuse"),
                   torch.randn(4, 8), torch.randn(8, 16))
    (candidate,) = seen["result"].candidates
    assert candidate.decision == "no_fuse" and "unsure" in candidate.why
    assert seen["after"]["fused_all_gather_matmul"] == 0 and seen["after"]["all_gather"] == 1


# -- matmuls with bias and FP8 scaled matmuls ------------------------------------------------------------------


def biased_projections(x, w_out, w_in, bias, n, spelling):
    """Qwen2's shape: a row-parallel matmul's all_reduce -> RMSNorm -> a column-parallel projection *with a bias*
    (``F.linear(h, w, b)`` reaches the graph as ``addmm``; ``h @ w.t() + b`` as ``mm`` then ``add``)."""
    h = F.rms_norm(funcol.all_reduce(x @ w_out, "sum", dist.group.WORLD), (HIDDEN,), n, 1e-6)
    return F.linear(h, w_in, bias) if spelling == "addmm" else h @ w_in.t() + bias


@pytest.mark.parametrize("spelling", ["addmm", "mm_add"])
def test_matmul_with_bias_fuses_with_its_all_gather(group, spelling):
    seen = capture(lambda *a: biased_projections(*a, spelling), lambda g: (sequence_parallel(g), async_tp(g))[1],
                   torch.randn(6, HIDDEN), torch.randn(HIDDEN, HIDDEN), torch.randn(8, HIDDEN), torch.randn(8),
                   torch.randn(HIDDEN))
    after = seen["after"]
    # Both matmuls fuse: the first with the reduce_scatter, the biased one with the all_gather (bias added after).
    assert after["fused_all_gather_matmul"] == 1 and after["fused_matmul_reduce_scatter"] == 1, after
    assert (after["mm"], after["all_gather"], after["all_reduce"]) == (0, 0, 0), after
    assert seen["out"].shape == (6, 8)


def _fp8_graph_dtypes(graph: fx.Graph) -> list[str]:
    """The dtypes every all_gather in ``graph`` moves; asserts each shard is a multiple of 4 rows (the rowwise
    scales' alignment, sequence_parallel._row_align) or, tensorwise, of no particular size."""
    gathers = [n.args[0].meta["val"] for n in graph.nodes
               if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    rows_of_4 = [statically_known_true(v.shape[0] % 4 == 0) for v in gathers]
    return [str(v.dtype) for v in gathers] + [f"rows of 4: {all(rows_of_4)}"]


@pytest.mark.parametrize("tensorwise", [False, True], ids=["rowwise", "tensorwise"])
def test_sequence_parallel_gathers_fp8_bytes_and_token_local_scales(group, tensorwise):
    model = Fp8Stack(tp=TP, tensorwise=tensorwise)
    seen = capture(model, lambda g: (sequence_parallel(g), _fp8_graph_dtypes(g))[1], torch.randn(7, 32).bfloat16())
    after = seen["after"]
    assert (after["all_reduce"], after["reduce_scatter"]) == (0, 2), after
    # Layer 2's up projection reads the shard: its FP8 rows cross as bytes (uint8, 1 byte a value where the
    # bf16 activations would take 2), with their per-token float32 scales (rowwise); nothing gathers bf16 into it.
    # The last gather is the graph output (the residual, bf16).
    expected = ["torch.uint8", "torch.float32"] if not tensorwise else ["torch.uint8"]
    assert seen["result"] == [*expected, "torch.bfloat16", f"rows of 4: {not tensorwise}"], seen["result"]
    assert seen["out"].dtype == torch.bfloat16 and seen["out"].shape == (7, 32)


@pytest.mark.parametrize("tensorwise", [False, True], ids=["rowwise", "tensorwise"])
def test_async_tp_fuses_every_scaled_matmul_next_to_a_collective(group, tensorwise):
    model = Fp8Stack(tp=TP, tensorwise=tensorwise)
    seen = capture(model, lambda g: (sequence_parallel(g), async_tp(g))[1], torch.randn(7, 32).bfloat16())
    before, after = seen["before"], seen["after"]
    assert before["all_reduce"] == 2 and before["mm"] == 4, before
    # Layer 1's up projection reads the full input (no collective next to it): it stays a _scaled_mm. The other
    # three: both down projections into their reduce_scatter, layer 2's up projection with its gather.
    assert (after["fused_matmul_reduce_scatter"], after["fused_all_gather_matmul"], after["mm"]) == (2, 1, 1), after
    assert (after["all_reduce"], after["reduce_scatter"], after["all_gather"]) == (0, 0, 1), after
    assert {c.dtype for c in seen["result"].candidates} == {"float8_e4m3fn"}
@pytest.mark.parametrize("strategy", list(BoundaryStrategy), ids=str)
def test_each_boundary_strategy_hands_the_graph_output_over_as_documented(group, strategy):
    # The residual graph's output is token-sharded after SP: "none" lets the shard leave (the failure it exists to
    # show), every other strategy gathers it back to all 6 tokens.
    args = [torch.randn(6, HIDDEN)] + [torch.randn(HIDDEN, HIDDEN) for _ in range(2)] + [torch.randn(HIDDEN)] * 2
    seen = capture(residual_blocks, lambda g: apply_sequence_parallel(
        g, tp_size=TP, rank=0, group_name=None, policy=BoundaryPolicy(strategy)), *args)
    assert seen["out"].shape == ((3, HIDDEN) if strategy == "none" else (6, HIDDEN))


def in_place_residual(residual, h, w, n):
    """[T, H] -> [T, H], ``residual`` updated in place as vLLM's fused add + norm does."""
    residual.add_(funcol.all_reduce(h @ w, "sum", dist.group.WORLD))
    return hand_written_rms_norm(residual, n)


@pytest.mark.parametrize("strategy, action", [("gather", "gathered"), ("gather_erase", "erased"), ("none", "kept")])
def test_the_in_place_residuals_copy_writes_back_what_its_strategy_records(group, strategy, action):
    """The epilogue ``copy_(residual, updated)`` after SP, whose ``updated`` is a token shard: ``gather`` copies the
    gathered rows (all of them), ``gather_erase`` drops the copy, ``none`` keeps the shard (the failure it shows)."""
    copies: list[tuple[str, str]] = []

    def transform(graph: fx.Graph):
        result = apply_sequence_parallel(graph, tp_size=TP, rank=0, group_name=None,
                                         policy=BoundaryPolicy(BoundaryStrategy(strategy)))
        copies.extend((str(n.args[0].meta["val"].shape), str(n.args[1].meta["val"].shape))
                      for n in graph.nodes if n.target is torch.ops.aten.copy_.default)
        return result

    residual = torch.randn(6, HIDDEN)
    args = [residual, torch.randn(6, HIDDEN), torch.randn(HIDDEN, HIDDEN), torch.randn(HIDDEN)]
    if strategy == "none":  # the shard cannot be written into all 6 rows: the failure the strategy exists to show
        with pytest.raises(RuntimeError, match=r"size of tensor a \(6\) must match the size of tensor b \(3\)"):
            capture(in_place_residual, transform, *args, dynamic=((0, 0), (1, 0)), keep_mutations=True)
        assert len(copies) == 1 and copies[0][0] != copies[0][1], copies
        return
    before = residual.clone()
    seen = capture(in_place_residual, transform, *args, dynamic=((0, 0), (1, 0)), keep_mutations=True)
    assert [c.action for c in seen["result"].boundary.copies] == [action]
    if strategy == "gather":
        assert len(copies) == 1 and copies[0][0] == copies[0][1], copies  # the full residual's shape, not the shard's
        assert residual.shape == (6, HIDDEN) and not torch.equal(residual, before)  # written back, every row
    else:
        assert copies == [] and torch.equal(residual, before)  # erased: the in-place update is lost (its defect)
    assert seen["out"].shape == (6, HIDDEN)


# -- numerics on 2 gloo ranks: every rank's own shard ----------------------------------------------------------
#
# The fake group above answers every collective with rank 0's view, so a pass that took rank 0's rows on every
# rank would pass there. Here the same aten graphs run on 2 real gloo ranks, eagerly (no Inductor: seconds), each
# rank with its own offset, against the untransformed function on the same ranks. Every input is replicated
# (the same seed on each rank), so the residual each rank slices is the full tensor and a wrong offset shows.

NUMERIC_PASS_CASES = {
    # name: (function, argument shapes, dynamic (argument, dimension) pairs)
    "residual_blocks_6": (residual_blocks, [(6, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN,), (HIDDEN,)],
                          ((0, 0),)),
    "residual_blocks_7_padded": (residual_blocks, [(7, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN,),
                                                   (HIDDEN,)], ((0, 0),)),
    "residual_blocks_batch_3x7": (residual_blocks, [(3, 7, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN,),
                                                    (HIDDEN,)], ((0, 1),)),
    "four_norms_7": (four_norms, [(7, HIDDEN)] + [(HIDDEN, HIDDEN)] * 4 + [(HIDDEN,)] * 4, ((0, 0),)),
}


PASS_CASE_IDS = [f"{n}/{t}" for n in NUMERIC_PASS_CASES for t in ("sp", "sp+async_tp")]


def _pass_numerics_worker() -> dict[str, dict[str, Any]]:
    """On each rank: each case's graph after SP (and after SP + AsyncTP) against the function run as written."""
    rank = dist.get_rank()
    group_name = dist.group.WORLD.group_name

    def sp(graph: fx.Graph):
        return apply_sequence_parallel(graph, tp_size=TP, rank=rank, group_name=group_name,
                                       policy=BoundaryPolicy(BoundaryStrategy.SHARDED))

    transforms = {"sp": sp, "sp+async_tp": lambda g: (sp(g), async_tp(g, m_low=1))[1]}

    def run_case(case: str) -> dict[str, Any]:
        name, _, label = case.partition("/")
        fn, shapes, dynamic = NUMERIC_PASS_CASES[name]
        g = torch.Generator().manual_seed(len(name))
        args = [torch.randn(*s, generator=g) / (s[-1] ** 0.5 if len(s) == 2 and s[0] == s[1] else 1) for s in shapes]
        with torch.no_grad():
            want = fn(*args)
        seen = capture(fn, transforms[label], *[a.clone() for a in args], dynamic=dynamic)
        return {"diff": (seen["out"] - want).abs().max().item(), "after": dict(seen["after"])}

    return rank_checks.run_cases(PASS_CASE_IDS, lambda case: case, run_case)  # a case that raises fails its own test


rank_checks.register(__name__, _pass_numerics_worker, timeout=300.0)


@pytest.fixture(scope="module")
def gloo_passes(gloo_checks) -> list[dict[str, dict[str, Any]]]:
    return rank_checks.results_of(gloo_checks, __name__)


@pytest.mark.parametrize("case", PASS_CASE_IDS)
def test_passes_match_the_untransformed_function_on_each_ranks_shard(gloo_passes, case):
    for rank, got in enumerate(rank_checks.case_results(gloo_passes, case)):
        assert got["diff"] < 1e-5, f"rank {rank}: {case} differs from the function as written by {got['diff']:.3g}"
        after = got["after"]
        assert after["all_reduce"] == 0, (rank, after)  # the rewrite ran: not a comparison of identical graphs
        if case.endswith("sp+async_tp"):
            assert after["fused_all_gather_matmul"] + after["fused_matmul_reduce_scatter"] > 0, (rank, after)


def test_gate_reads_the_operand_width_of_a_scaled_matmul(group):
    # A rule that fuses 2-byte (bf16) matmuls only: the FP8 stack's scaled matmuls stay unfused, judged as 1-byte.
    rule = MatmulRule(Split("dtype_bytes", 1.5, Leaf("no_fuse"), Leaf("fuse")))
    seen = capture(Fp8Stack(tp=TP), lambda g: (sequence_parallel(g), async_tp(g, rule=rule))[1],
                   torch.randn(7, 32).bfloat16())
    assert [c.decision for c in seen["result"].candidates] == ["no_fuse"] * 3
    assert seen["after"]["fused_all_gather_matmul"] + seen["after"]["fused_matmul_reduce_scatter"] == 0
