"""Activations with a batch dimension: ``[B, S, H]`` with ``token_dim=1``, B > 1 (torchtitan, Hugging Face).

SP shards the ``B * S`` token rows (the batch flattened, as vLLM does), and a call's token count is ``B * S``
for the compile ranges. ``tp_models.TinyTitan`` with the ``tp`` plan (DTensor ``ColwiseParallel`` /
``RowwiseParallel``, whose all_reduces SP rewrites):

- op counts and boundary crossings on the fake group (in process, inspect-only: every pass runs, no code
  generation), every boundary strategy and full_graph, B = 2;
- numerics on 2 gloo ranks against the unsharded model, B = 2 (``B * S`` a multiple of tp) and B = 3 (``B * S``
  padded to a multiple of tp when odd), under the ``sharded`` and ``gather`` boundaries and full_graph;
- ``token_dim`` errors.
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

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor"))

TP = 2
MIN_TOKENS = 8
MODES = [("none", "piecewise"), ("gather_erase", "piecewise"), ("gather", "piecewise"), ("sharded", "piecewise"),
         ("sharded", "full_graph")]


def config(boundary: str, mode: str) -> sp_lab.LabConfig:
    return sp_lab.LabConfig(tp_size=TP, async_tp_min_tokens=MIN_TOKENS, max_num_tokens=64, token_dim=1,
                            splitting_ops=[ATTENTION_OP], boundary=boundary, compile_mode=mode)


def _label(boundary: str, mode: str) -> str:
    return boundary if mode == "piecewise" else mode


def _tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(100 * batch + seq))


# -- fake group: op counts and boundary records ---------------------------------------------------------------

# (batch, seq): 2 x 6 = 12 tokens is in the SP range although seq < MIN_TOKENS (ranges count B * S); 2 x 3 = 6 is
# below it. [1, 12] is the batch-1 layout whose boundary flags read the token dimension. [8, 1] is one token a
# sequence, which Dynamo specialises: a static graph of 8 tokens.
FAKE_CALLS = {"sharded": ((2, 6), (2, 3), (1, 12), (8, 1)), "gather": ((2, 6), (1, 12))}


@pytest.fixture(scope="module")
def fake() -> dict[str, Any]:
    results = {}
    with fake_process_group(TP):
        model = parallel_titan("tp", TP)
        shared = SharedCaptures(model)  # one Dynamo capture per batch size, shared by the modes
        for boundary, mode in MODES:
            compiled = sp_lab.compile(model, config(boundary, mode), inspect_only=True, captures=shared)
            for batch, seq in FAKE_CALLS.get(_label(boundary, mode), ((2, 6),)):
                out = compiled(_tokens(batch, seq))
                report = compiled.report
                n = batch * seq
                results[_label(boundary, mode), batch, seq] = {
                    "shape": tuple(out.shape),
                    "counts": report.op_counts(n),
                    "rewrites": report.sp_rewrites(n),
                    "boundaries": [{t.name: t for t in b.tensors} for b in report.range_for(n).boundaries],
                }
    return results


@pytest.mark.parametrize("case", [(*m, 2, 6) for m in MODES] + [("sharded", "piecewise", 8, 1)],
                         ids=lambda c: f"{_label(*c[:2])}-{c[2]}x{c[3]}")
def test_batched_activations_are_sequence_parallel_and_fuse(fake, case):
    boundary, mode, batch, seq = case
    got = fake[_label(boundary, mode), batch, seq]
    counts = got["counts"]
    assert got["shape"] == (batch, seq, 64)
    # 2 layers x (attention wo + FFN w2): the four RowwiseParallel all_reduces, each now a fused mm+RS.
    assert got["rewrites"] == 4
    assert counts["all_reduce"] == 0 and counts["fused_matmul_reduce_scatter"] == 4, counts
    # Layer 1's q/k/v/w1/w3, layer 0's w1/w3 and the output head read the sharded residual: fused AG+mm.
    assert counts["fused_all_gather_matmul"] == 8, counts


def test_the_token_count_of_a_batch_is_batch_times_seq(fake):
    # [2, 3]: 6 tokens, below async_tp_min_tokens=8 -> plain TP; [2, 6] (12 tokens, seq 6 < 8) got SP above.
    got = fake["sharded", 2, 3]
    assert got["rewrites"] == 0 and got["counts"]["all_reduce"] == 4, got["counts"]


@pytest.mark.parametrize("batch", [2, 1])
def test_boundary_records_flag_the_token_shard_on_the_token_dimension(fake, batch):
    seq = 12 // batch
    sharded, gather = fake["sharded", batch, seq]["boundaries"], fake["gather", batch, seq]["boundaries"]
    # The residual enters the first boundary full (the embedding's output) and crosses the second as this
    # rank's half of the B * S rows, viewed [1, rows, H]; the in-piece 'gather' strategy hands it over full.
    assert not sharded[0]["h"].sharded_after and sharded[1]["h"].sharded_after
    assert sharded[1]["h"].shape_after[0] == 1 and sharded[1]["h"].shape_before == sharded[0]["h"].shape_after
    assert sharded[1]["h"].bytes_per_token_after == sharded[0]["h"].bytes_per_token_after / TP == 32 * 4 / TP
    assert not any(t.sharded_after for b in gather for t in b.values())
    # q/k/v cross as [B, heads, S, head_dim]: 2 local heads x 8 floats per token.
    assert sharded[0]["q"].bytes_per_token_after == 2 * 8 * 4


# -- token_dim errors ---------------------------------------------------------------------------------------------


def test_token_dim_beyond_the_input_rank_is_named_at_the_first_call():
    compiled = sp_lab.compile(TinyTitan(), sp_lab.LabConfig(tp_size=1, token_dim=2, splitting_ops=[ATTENTION_OP]))
    with pytest.raises(ValueError, match=r"token_dim=2 but the first argument has shape \(2, 6\)"):
        compiled(_tokens(2, 6))


def test_negative_token_dim_is_rejected():
    with pytest.raises(sp_lab.ConfigError, match="token_dim: must be >= 0"):
        sp_lab.LabConfig(token_dim=-1)


def test_num_tokens_counts_every_token_of_a_batch():
    assert sp_lab.LabConfig(token_dim=1).num_tokens((2, 64)) == 128
    assert sp_lab.LabConfig().num_tokens((64, 32)) == 64


# -- 2 gloo ranks: numerics against the unsharded model -------------------------------------------------------

# (boundary, mode, batch, seq). B = 2 makes B * S a multiple of tp for every S (the pass knows it: no padding);
# B = 3 leaves it to S (padded to a multiple of tp when odd, in the graph). Every batch size is its own Dynamo
# graph, so each costs a compile: the sharded boundary gets both, gather (in-piece SP, gathered at boundaries)
# the padded one, full_graph the other. [8, 1] is the static graph of one token a sequence. 'none' fails by design (BoundaryError) and 'gather_erase' equals
# 'gather' without an in-place residual: both are on the fake group above.
NUMERIC_CASES = [("sharded", "piecewise", 2, 6), ("sharded", "piecewise", 2, 7), ("sharded", "piecewise", 3, 5),
                 ("sharded", "piecewise", 8, 1),
                 ("gather", "piecewise", 3, 4), ("gather", "piecewise", 3, 5),
                 ("sharded", "full_graph", 2, 6), ("sharded", "full_graph", 2, 7)]


def _numerics_worker() -> dict[str, Any]:
    reference = TinyTitan()
    model = parallel_titan("tp", dist.get_world_size())
    shared = SharedCaptures(model)
    results = {}
    for boundary, mode in dict.fromkeys((b, m) for b, m, _, _ in NUMERIC_CASES):
        compiled = sp_lab.compile(model, config(boundary, mode), captures=shared)
        for batch, seq in [(b, s) for bb, m, b, s in NUMERIC_CASES if (bb, m) == (boundary, mode)]:
            x = _tokens(batch, seq)
            with torch.no_grad():
                diff = (compiled(x) - reference(x)).abs().max().item()
            results[_label(boundary, mode), batch, seq] = {
                "diff": diff, "rewrites": compiled.report.sp_rewrites(batch * seq),
                "fused": compiled.report.fusion_fired(batch * seq)}
    return results


rank_checks.register(__name__, _numerics_worker, timeout=900.0)


@pytest.fixture(scope="module")
def gloo(gloo_checks) -> list[dict[str, Any]]:
    return rank_checks.results_of(gloo_checks, __name__)


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=lambda c: f"{_label(*c[:2])}-{c[2]}x{c[3]}")
def test_batched_model_matches_the_unsharded_model(gloo, case):
    boundary, mode, batch, seq = case
    for rank, results in enumerate(gloo):
        got = results[_label(boundary, mode), batch, seq]
        assert got["diff"] < 1e-4, (rank, got)
        assert got["rewrites"] == 4 and got["fused"], (rank, got)
