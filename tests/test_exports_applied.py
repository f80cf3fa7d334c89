"""Each export target applied the way a user applies it, checked to gate at the tuned token count in its own units.

- vLLM <= 0.31: the printed ``vllm serve`` line is split as a shell splits it, its ``--compilation-config`` parsed,
  and the SP gate evaluated as vLLM 0.31 evaluates it (``SequenceParallelismPass.is_applicable_for_range``: the
  compile range's start ``>= sp_min_token_num``, ranges from ``compile_ranges_endpoints`` up to
  ``--max-num-batched-tokens``);
- vLLM 0.32+ model code: the generated file is executed as pasted and called with real torch dtypes; its whole-batch
  gate is fed to ``is_sequence_parallel_active``'s expression as read from the 0.34.0 wheel; the printed edit is
  checked against the vendored release facts (file, line, attribute, old text) and its new value evaluated;
- torch.compile: the exported snippet is executed and its ``compile_with_async_tp`` run on a small TP model under
  the fake process group: the micro-pipeline TP pass is reached only from the tuned count, with the group's
  symmetric memory registered, and fuses both matmuls (torch's CPU build has no NCCL, where the pass stops before
  rewriting; the test lets it through to see the graph it returns, and never runs the fused kernels, which are
  CUDA-only).
"""

import json
import re
import shlex
import types

import polars as pl
import pytest
import torch

from sp_lab.config import LabConfig
from sp_lab.tuning.export import describe_file, export_config, patch_path, snippet_path
from sp_lab.tuning.model_sp import model_sp_table
from sp_lab.vllm_models import ServedModel, model_level_sp, model_sp_releases, served_model


def _rows(threshold: int, tp: int, *, model: str = "llama-3-70b", dtype: str = "bfloat16") -> pl.DataFrame:
    """A layer sweep on GPUs where sp+async_tp is fastest from ``threshold`` tokens on (the rest: baseline)."""
    rows = []
    for t in (threshold // 4, threshold // 2, threshold - tp, threshold, 2 * threshold, 8 * threshold):
        for variant, base in (("baseline", 100.0), ("sp", 105.0), ("sp+async_tp", 110.0)):
            faster = variant == "sp+async_tp" and t >= threshold
            rows.append({"num_tokens": t, "variant": variant, "latency_us": 80.0 if faster else base,
                         "source": "measured", "tp": tp, "model": model, "dtype": dtype, "hidden_size": 8192,
                         "num_layers": 80, "device_name": "NVIDIA H200", "torch_version": "2.11.0", "backend": "nccl"})
    return pl.DataFrame(rows)


TUNED = 256  # the tuned count, whole batch, at tp 4: 64 rows per rank
CONFIG = LabConfig(tp_size=4, async_tp_min_tokens=TUNED, max_num_tokens=8192)


def _serve_args(text: str) -> dict[str, str]:
    """The printed ``vllm serve`` line, split as a shell splits it, as ``{flag: value}`` (the model under ``model``)."""
    (line,) = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("vllm serve")]
    words = shlex.split(line)
    assert words[:2] == ["vllm", "serve"]
    return {"model": words[2], **dict(zip(words[3::2], words[4::2], strict=True))}


def _vllm_031_runs_sp(compilation_config: dict, max_num_batched_tokens: int, num_tokens: int) -> bool:
    """Whether vLLM 0.17-0.31 runs SP at ``num_tokens``: ranges split at ``compile_ranges_endpoints`` up to
    max_num_batched_tokens, SP where the range's start >= sp_min_token_num (vLLM lowers it to max_num_batched_tokens)."""
    passes = compilation_config["pass_config"]
    if not passes.get("enable_sp"):
        return False
    ends = sorted([*compilation_config.get("compile_ranges_endpoints", []), max_num_batched_tokens])
    start = next(ends[i - 1] + 1 if i else 1 for i, end in enumerate(ends) if num_tokens <= end)
    assert compilation_config["splitting_ops"] == []  # else SP runs only at single concrete sizes
    return start >= min(passes["sp_min_token_num"], max_num_batched_tokens)


def test_vllm_031_serve_line_gates_sp_at_the_tuned_count(tmp_path):
    path = export_config(_rows(TUNED, 4), CONFIG, tmp_path, chosen_in="test", vllm_release="0.31")
    args = _serve_args(describe_file(path))
    assert args["model"] == "meta-llama/Meta-Llama-3-70B"  # the preset's Hugging Face id: vLLM can load it
    assert args["--tensor-parallel-size"] == "4" and args["--max-num-batched-tokens"] == "8192"
    obj = json.loads(args["--compilation-config"])
    batched = int(args["--max-num-batched-tokens"])
    assert [_vllm_031_runs_sp(obj, batched, t) for t in (1, TUNED - 1, TUNED, 8192)] == [False, False, True, True]
    assert obj["pass_config"]["fuse_gemm_comms"] is True  # AsyncTP with it
    assert json.loads(path.read_text())["vllm"]["serve"] == " ".join(
        ln.strip() for ln in describe_file(path).splitlines() if ln.strip().startswith("vllm serve"))


def test_serve_lines_name_what_vllm_loads(tmp_path):
    assert served_model("qwen2.5-7b").serve_as == "Qwen/Qwen2.5-7B"
    assert served_model("mistral-7b").architecture == "MistralForCausalLM"
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert served_model(str(checkpoint)) == ServedModel(str(checkpoint), str(checkpoint.resolve()), "Qwen2ForCausalLM")
    toy_rows = _rows(16, 2, model="toy").with_columns(device_name=pl.lit("cpu"), backend=pl.lit("gloo"))
    text = describe_file(export_config(toy_rows, LabConfig(tp_size=2, async_tp_min_tokens=16, max_num_tokens=128), tmp_path / "toy",
                                       chosen_in="test", vllm_release="0.31"))
    assert not [ln for ln in text.splitlines() if ln.strip().startswith("vllm serve")]
    assert "no vllm serve line: toy is sp_lab's own model" in text


def test_vllm_034_closest_line_changes_nothing_but_sp(tmp_path):
    """0.32+: no SP in the compile config, so the closest line passes none (CUDA graphs stay as the user has them)."""
    graphs = LabConfig(tp_size=4, async_tp_min_tokens=TUNED, max_num_tokens=8192, cudagraph_mode="full")
    path = export_config(_rows(TUNED, 4), graphs, tmp_path, chosen_in="test", vllm_release="0.34")
    args = _serve_args(describe_file(path))
    assert args == {"model": "meta-llama/Meta-Llama-3-70B", "--tensor-parallel-size": "4"}


@pytest.mark.parametrize(("rows_dtype", "spellings"), [
    ("fp8-rowwise", (torch.float8_e4m3fn, "torch.float8_e4m3fn", "float8_e4m3fn", "fp8", "fp8-rowwise",
                     torch.float8_e5m2, "FP8")),
    ("bfloat16", (torch.bfloat16, "torch.bfloat16", "bfloat16", "bf16")),
    ("float16", (torch.float16, "half", "fp16")),
])
def test_generated_file_runs_as_pasted_with_real_dtypes_and_vllms_units(rows_dtype, spellings):
    table = model_sp_table(_rows(TUNED, 4, dtype=rows_dtype), CONFIG)
    ns: dict = {}
    exec(table.function_source(), ns)  # noqa: S102  (the file as a user pastes it: no imports)
    qkv = next(m for m in table.matmuls if m.name == "qkv")  # llama-3-70b at tp 4: w is [2560, 8192] on a rank
    weight = torch.empty(2560, 8192, dtype=torch.bfloat16)
    k, n = weight.shape[1], weight.shape[0]
    assert (qkv.k, qkv.n) == (k, n)
    for dtype in spellings:
        assert ns["min_tokens_per_rank"](k, n, dtype, 4) == TUNED // 4, dtype
        assert ns["min_tokens"](k, n, dtype, 4) == TUNED, dtype  # vLLM's unit: the whole batch
    assert ns["min_tokens_per_rank"](k, 4 * n, spellings[0], 4) is None  # the unsharded N is not a rank's matmul
    assert ns["min_tokens_per_rank"](k, n, torch.float32, 4) is None  # another dtype: not measured
    with pytest.raises(ValueError, match=r"dtype 'int8': not a matmul operand type .*bf16"):
        ns["min_tokens_per_rank"](k, n, "int8", 4)
    assert (ns["SP_MIN_TOKENS_PER_RANK"], ns["SP_MIN_TOKENS"]) == (TUNED // 4, TUNED)
    # vLLM 0.34's gate, as read from its wheel, with the file's whole-batch value: SP from the tuned count on
    facts = model_sp_releases()["0.34.0"]["helpers"]["is_sequence_parallel_active"]
    assert facts["args"] == ["is_enabled", "num_tokens", "min_tokens"]
    gate = eval(f"lambda is_enabled, num_tokens, min_tokens: {facts['returns']}",
                {"get_tensor_model_parallel_world_size": lambda: 4, "max": max})
    assert [gate(True, t, ns["SP_MIN_TOKENS"]) for t in (TUNED - 4, TUNED - 1, TUNED, 4096)] == [
        False, False, True, True]


def test_llama_on_vllm_034_is_told_plainly_there_is_no_model_level_sp(tmp_path):
    path = export_config(_rows(TUNED, 4), CONFIG, tmp_path, chosen_in="test", vllm_release="0.34")
    level = json.loads(path.read_text())["model_sp"]["vllm"]
    assert (level["has_sp"], level["token_gated"], level["patch"]) == (False, False, None)
    assert level["wheel_sha256"] == model_sp_releases()["0.34.0"]["wheel_sha256"]
    text = describe_file(path)
    assert ("vLLM 0.34.0 has no SP for LlamaForCausalLM: vllm/model_executor/models/llama.py (LlamaForCausalLM) calls "
            "none of vllm/models/common/ops/sequence_parallel.py's helpers") in text
    assert f"is_sequence_parallel_active(enabled, positions.shape[0], min_tokens={TUNED})" in text
    assert not patch_path(path, "0.34.0").exists()
    for release in ("0.32.0", "0.33.0", "0.34.0"):  # stock Llama, Mistral, Qwen2: never in any release read
        for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
            assert not model_level_sp(release, arch, sp_min_tokens=TUNED).has_sp


def _apply(patch: str, files: dict[str, dict[int, str]]) -> dict[str, dict[int, str]]:
    """Apply a unified diff of one-for-one line replacements to ``{file: {line: text}}``, checking every context and
    removed line against what is there (what ``patch`` would refuse)."""
    out = {f: dict(lines) for f, lines in files.items()}
    current = None
    for text in patch.splitlines():
        if text.startswith("+++ b/"):
            current = text.removeprefix("+++ b/")
        elif text.startswith("@@"):
            line = int(re.match(r"@@ -(\d+),\d+ \+\d+,\d+ @@", text).group(1))
        elif text.startswith((" ", "-")) and not text.startswith("---"):
            assert out[current].get(line) == text[1:], (current, line, text)
            removed = text.startswith("-")
            line += 0 if removed else 1
        elif text.startswith("+") and not text.startswith("+++"):
            out[current][line] = text[1:]
            line += 1
    return out


def test_muse_spark_edit_matches_the_wheel_and_gates_at_the_tuned_count():
    """vLLM 0.34.0's Muse Spark gates SP with is_sequence_parallel_active(..., self.sp_min_tokens): the printed edit
    sets every assignment, in whole-batch units, and the fused all-gather + matmul's per-rank constant."""
    table = model_sp_table(_rows(TUNED, 4), CONFIG)
    level = model_level_sp("0.34", "MuseSparkForConditionalGeneration", sp_min_tokens=table.sp_min_tokens,
                           fused_ag_min_tokens_per_rank=table.lookup(8192, 2560, torch.bfloat16, 4), dtype="bfloat16")
    facts = model_sp_releases()["0.34.0"]
    model = facts["models"]["vllm.models.muse_spark"]
    # the release's own text around every assignment and the constant: what the patch must find
    files: dict[str, dict[int, str]] = {}
    for a in [*model["min_tokens_assignments"], *facts["helpers"]["constants"]]:
        file = a.get("file", facts["helpers"]["file"])
        lines = files.setdefault(file, {})
        lines.update({a["line"] - len(a["before"]) + i: t for i, t in enumerate(a["before"])})
        lines.update({a["line"] + 1 + i: t for i, t in enumerate(a["after"])})
        lines[a["line"]] = a["text"]
    patched = _apply(level.patch, files)
    scope = {"get_trtllm_token_threshold": lambda config: 128, "vllm_config": None, "threshold": 128, "max": max,
             "self": types.SimpleNamespace(trtllm_token_threshold=128)}  # tp 4 with the hybrid MoE: its own 129
    gate = eval(f"lambda is_enabled, num_tokens, min_tokens: {facts['helpers']['is_sequence_parallel_active']['returns']}",
                {"get_tensor_model_parallel_world_size": lambda: 4, "max": max})
    for a in model["min_tokens_assignments"]:
        new = patched[a["file"]][a["line"]]
        if a["attribute"] in a["rhs"]:
            assert new == a["text"]  # passes the model's value on: untouched
            continue
        target, rhs = (part.strip() for part in new.split("=", 1))
        assert target == a["target"] and target.endswith(".sp_min_tokens")
        value = eval(rhs, scope)
        assert value == TUNED  # whole batch: 64 rows per rank at tp 4
        assert [gate(True, t, value) for t in (TUNED - 1, TUNED)] == [False, True]
    constant = facts["helpers"]["constants"][0]
    assert constant["compared_in"] == [{"function": "can_sp_all_gather_matmul",
                                        "condition": "x.shape[0] >= _FUSED_AG_MATMUL_MIN_TOKENS_PER_RANK"}]
    assert patched[facts["helpers"]["file"]][constant["line"]] == f"{constant['name']} = {TUNED // 4}"  # per rank
    assert {e["units"] for e in level.edits} == {"whole batch", "per rank (shard rows, x.shape[0])"}
    # 0.33 has no min_tokens argument: said so, no patch
    older = model_level_sp("0.33", "MuseSparkForConditionalGeneration", sp_min_tokens=TUNED)
    assert older.has_sp and not older.token_gated and older.patch is None and "no threshold argument" in older.statement


class _Stop(Exception):
    """Ends a compile once the post-grad passes ran (the CPU build cannot run the fused CUDA kernels)."""


def _stopped(error: BaseException | None) -> bool:
    """Whether ``error`` is :class:`_Stop` as Dynamo and Inductor pass it on (wrapped, as cause or inner exception)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, _Stop):
            return True
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return False


def test_torch_compile_snippet_fuses_from_the_tuned_count_on_the_registered_group(tmp_path):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch._inductor import compile_fx
    from torch._inductor import config as inductor_config
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group

    from sp_lab.distributed.collectives import fake_process_group

    config = LabConfig(tp_size=2, async_tp_min_tokens=16, max_num_tokens=128)
    path = export_config(_rows(16, 2), config, tmp_path, chosen_in="test", vllm_release="0.31")
    ns: dict = {}
    exec(snippet_path(path).read_text(), ns)  # noqa: S102  (pasted as printed)
    assert ns["ASYNC_TP_MIN_TOKENS"] == 16

    class SpMlp(torch.nn.Module):  # SP as torchtitan's plan leaves it: gather before up, reduce-scatter after down
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 16, bias=False)

        def forward(self, tokens):
            group = dist.group.WORLD.group_name
            shard = tokens[: tokens.shape[0] // 2]
            full = funcol.all_gather_tensor(shard, 0, group)
            return funcol.reduce_scatter_tensor(self.down(torch.relu(self.up(full))), "sum", 0, group)

    seen = []
    original = compile_fx._recursive_post_grad_passes

    def post_grad(gm, is_inference=False):
        nccl = dist.is_nccl_available
        dist.is_nccl_available = lambda: True  # the pass looks for NCCL before it rewrites
        try:
            original(gm, is_inference)
        finally:
            dist.is_nccl_available = nccl
        ops = sorted({str(n.target) for n in gm.graph.nodes if "symm_mem" in str(n.target)})
        seen.append((inductor_config._micro_pipeline_tp, ops, is_symm_mem_enabled_for_group(group.group_name)))
        raise _Stop

    torch._dynamo.reset()
    with fake_process_group(2) as group, torch.no_grad():
        run = ns["compile_with_async_tp"](SpMlp(), group)
        compile_fx._recursive_post_grad_passes = post_grad
        try:
            for tokens in (15, 16):  # below and at the tuned count (whole batch)
                with pytest.raises(Exception) as raised:
                    run(torch.randn(tokens, 16))
                assert _stopped(raised.value), raised.value  # ended after the passes, nothing else went wrong
        finally:
            compile_fx._recursive_post_grad_passes = original
            torch._dynamo.reset()
    fused = ["symm_mem.fused_all_gather_matmul.default", "symm_mem.fused_matmul_reduce_scatter.default"]
    assert seen == [(False, [], True), (True, fused, True)]
