"""The vLLM model behind an sp_lab model, and the model-level SP each vLLM release from 0.32 has for it.

From vLLM 0.32 the SP and AsyncTP compile passes are gone; SP is code inside a few models, built on
``vllm/models/common/ops/sequence_parallel.py``. ``data/vllm/model_sp.json`` holds what each release's wheel has
there, read by ``benchmarks/vllm_releases/read_model_sp.py`` (each release names its wheel and sha256):

- 0.32: the helpers (``sp_all_gather``, ``sp_reduce_scatter``, ``sp_shard``, ``sp_padding_mask``) and models that
  switch SP on or off as a whole (no token gate);
- 0.33: ``is_sequence_parallel_active(is_enabled, num_tokens)``: ``num_tokens >= tp``, no threshold argument;
- 0.34: ``is_sequence_parallel_active(is_enabled, num_tokens, min_tokens=0)``: ``num_tokens >= max(tp, min_tokens)``,
  with ``num_tokens`` the whole batch (``positions.shape[0]``), so ``min_tokens`` is in tokens of the whole batch;
  the model sets it in an attribute (Muse Spark: ``self.sp_min_tokens``); and
  ``_FUSED_AG_MATMUL_MIN_TOKENS_PER_RANK = 1024``, compared with the shard's rows (per rank) for bf16 only, gates
  the fused all-gather + matmul where a model calls ``can_sp_all_gather_matmul``.

Stock Llama, Mistral and Qwen2 (``vllm/model_executor/models/llama.py`` ...) use none of it in any of these releases.
:func:`model_level_sp` says so for such a model, and for a model that has a token gate it writes the edit as a
unified diff with the tuned value converted to the release's units.
"""

from __future__ import annotations

import dataclasses
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from sp_lab.resources import DATA_DIR
from sp_lab.vllm_releases import resolve_release

__all__ = ["ModelLevelSp", "ServedModel", "model_level_sp", "model_sp_releases", "served_model"]

MODEL_SP_FILE = DATA_DIR / "vllm" / "model_sp.json"
"""Model-level SP per release, read from each wheel."""
HELPERS_FILE = "vllm/models/common/ops/sequence_parallel.py"
FUSED_AG_CONSTANT = "_FUSED_AG_MATMUL_MIN_TOKENS_PER_RANK"


@cache
def model_sp_releases() -> dict[str, dict[str, Any]]:
    """The vendored facts by release version (``"0.34.0"``)."""
    return {r["version"]: r for r in json.loads(MODEL_SP_FILE.read_text())["releases"]}


# -- which model vLLM loads --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What ``vllm serve`` loads for an sp_lab model name."""

    name: str
    """sp_lab's name: a preset, ``toy`` or a checkpoint directory."""
    serve_as: str | None
    """The Hugging Face id of a preset's public config, or the checkpoint directory's absolute path; ``None`` for a
    model vLLM cannot load (``toy``: sp_lab's own)."""
    architecture: str | None
    """The ``architectures[0]`` of its ``config.json`` (what picks vLLM's model class), ``None`` where unknown."""
    note: str | None = None
    """Why ``serve_as`` or ``architecture`` is missing."""


_HF_CONFIG_URL = re.compile(r"https://huggingface\.co/([^/]+/[^/]+)/(?:blob|resolve)/[^/]+/config\.json")


def served_model(name: str) -> ServedModel:
    """The model ``vllm serve`` loads for sp_lab's ``name``: a preset's Hugging Face id (from the public config its
    numbers come from), a checkpoint directory's absolute path, or none for ``toy``."""
    if name == "toy":
        return ServedModel(name, None, None, "toy is sp_lab's own model, which vLLM cannot load: tune a preset or "
                                             "your checkpoint for a serve line")
    preset = DATA_DIR / "models" / f"{name}.json"
    if "/" not in name and preset.is_file():
        config = json.loads(preset.read_text())
        match = _HF_CONFIG_URL.fullmatch(str(config.get("_source", "")))
        return ServedModel(name, match.group(1) if match else None, _first(config.get("architectures")),
                           None if match else f"preset {name} names no Hugging Face config")
    config_json = Path(name) / "config.json"
    if config_json.is_file():
        config = json.loads(config_json.read_text())
        return ServedModel(name, str(Path(name).resolve()), _first(config.get("architectures")))
    return ServedModel(name, name, None, f"{name!r} is neither a preset nor a checkpoint directory here: passed to "
                                         "vllm serve as written, its architecture unknown")


def _first(value: Any) -> str | None:
    return str(value[0]) if isinstance(value, list) and value else None


# -- model-level SP in a release ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelLevelSp:
    """What release ``release`` does with SP for one model architecture, and the edit that applies sp_lab's gate."""

    release: str
    wheel: str
    wheel_sha256: str
    architecture: str | None
    module: str | None
    """vLLM's module for the architecture (``llama``: ``vllm/model_executor/models/llama.py``; a package name)."""
    has_sp: bool
    """Whether any file of the model calls the model-level SP helpers."""
    token_gated: bool
    """Whether its SP is gated by a token count sp_lab can set (``is_sequence_parallel_active`` with ``min_tokens``)."""
    statement: str
    """In words: what the release does for this model and what applying the gate takes."""
    patch: str | None = None
    """A unified diff against the release's files (apply in site-packages with ``patch -p1``), ``None`` where there is
    nothing to edit."""
    edits: tuple[dict[str, Any], ...] = ()
    """Each edited line: ``file``, ``line``, ``attribute`` or ``constant``, ``old``, ``new``, ``value``, ``units``."""

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def _module_file(module: str) -> str:
    return module.replace(".", "/") + "/" if module.startswith("vllm.") else f"vllm/model_executor/models/{module}.py"


def model_level_sp(version: str, architecture: str | None, *, sp_min_tokens: int | None,
                   fused_ag_min_tokens_per_rank: int | None = None, dtype: str | None = None) -> ModelLevelSp | None:
    """Release ``version``'s model-level SP for ``architecture``, with the edit for sp_lab's gates.

    ``sp_min_tokens``: SP from this many tokens of the whole batch (``None``: the tuned policy never runs SP);
    ``fused_ag_min_tokens_per_rank``: the fused all-gather + matmul from this many shard rows (the qkv gate), applied
    where the model calls ``can_sp_all_gather_matmul`` and ``dtype`` is bf16 (the only dtype vLLM fuses there).
    ``None`` for a release before 0.32 (its compile config gates SP) or one the facts were not read for.
    """
    rel = resolve_release(version)[0]
    facts = model_sp_releases().get(rel.version)
    if rel.sp_gate != "removed" or facts is None:
        return None
    head = {"release": rel.version, "wheel": facts["wheel"], "wheel_sha256": facts["wheel_sha256"],
            "architecture": architecture}
    if architecture is None:
        return ModelLevelSp(**head, module=None, has_sp=False, token_gated=False, statement=(
            f"which vLLM model class this is cannot be told here (no architecture in its config), so sp_lab cannot say "
            f"whether vLLM {rel.version} has model-level SP for it"))
    target = facts["registry"].get(architecture)
    if target is None:
        return ModelLevelSp(**head, module=None, has_sp=False, token_gated=False, statement=(
            f"vLLM {rel.version}'s model registry has no {architecture}"))
    module, cls = target.split(":")
    where = f"{_module_file(module)} ({cls})"
    model = facts["models"].get(module)
    if model is None:
        return ModelLevelSp(**head, module=module, has_sp=False, token_gated=False, statement=(
            f"vLLM {rel.version} has no SP for {architecture}: {where} calls none of {HELPERS_FILE}'s helpers, and "
            "the compile config has no SP since 0.32, so nothing gates on sp_lab's threshold. SP there needs model "
            "code: shard the residual between layers (sp_shard / sp_reduce_scatter after o_proj and down, "
            "sp_all_gather before qkv and gate_up) behind " + _gate_call(facts, sp_min_tokens)
            + "; or serve with vLLM 0.17-0.31, whose compile pass does SP with the token gate (the vllm section)"))
    gates = [g for g in model["gates"] if len(g["args"]) >= 3]
    switches = sorted({f"{s['target']} = {s['rhs']}" for s in model["switches"]})[:3]
    switched = f"; switched on by {'; '.join(switches)}" if switches else ""
    if not gates:
        gated_by = ("is_sequence_parallel_active(is_enabled, num_tokens) (num_tokens >= tp, no threshold argument "
                    f"in {rel.version})") if model["gates"] else "no token count (when on, at every size)"
        return ModelLevelSp(**head, module=module, has_sp=True, token_gated=False, statement=(
            f"vLLM {rel.version} has built-in SP for {architecture} ({', '.join(sorted(model['files']))}){switched}; "
            f"it is gated by {gated_by}, so it stays on wherever it is switched on, below sp_lab's threshold too. "
            "Gating it at the tuned count needs " + _gate_call(facts, sp_min_tokens) + " around its SP branches"))
    edits = _edits(facts, model, sp_min_tokens, fused_ag_min_tokens_per_rank, dtype)
    units = "tokens of the whole batch (num_tokens = " + ", ".join(sorted({g["args"][1] for g in gates})) + ")"
    if sp_min_tokens is None:
        text = (f"vLLM {rel.version} gates {architecture}'s built-in SP with is_sequence_parallel_active(..., "
                f"min_tokens) in {where}; the tuned policy never runs SP, which this code cannot express (SP stays on "
                "from its own threshold wherever it is switched on" + switched + ")")
    else:
        text = (f"vLLM {rel.version} gates {architecture}'s built-in SP with is_sequence_parallel_active(..., "
                f"min_tokens) ({', '.join(sorted({a['attribute'] for a in model['min_tokens_assignments']}))}, in "
                f"{units}): the patch sets it to {sp_min_tokens} wherever the model assigns it"
                + (", and the fused all-gather + matmul's per-rank gate" if any("constant" in e for e in edits) else "")
                + switched)
    return ModelLevelSp(**head, module=module, has_sp=True, token_gated=True, statement=text,
                        patch=_unified_diff(edits) if edits else None, edits=tuple(edits))


def _gate_call(facts: dict[str, Any], sp_min_tokens: int | None) -> str:
    active = (facts.get("helpers") or {}).get("is_sequence_parallel_active")
    value = "SP_MIN_TOKENS" if sp_min_tokens is None else str(sp_min_tokens)
    if active is None:
        return f"a check num_tokens >= {value} (num_tokens the whole batch; this release has no is_sequence_parallel_active)"
    if "min_tokens" in active["args"]:
        return f"is_sequence_parallel_active(enabled, positions.shape[0], min_tokens={value}) (whole-batch tokens)"
    return (f"a check num_tokens >= {value} beside is_sequence_parallel_active(enabled, num_tokens), which has no "
            "threshold argument in this release (0.34 adds min_tokens)")


def _edits(facts: dict[str, Any], model: dict[str, Any], sp_min_tokens: int | None,
           fused_ag_per_rank: int | None, dtype: str | None) -> list[dict[str, Any]]:
    edits = []
    if sp_min_tokens is not None:
        for a in model["min_tokens_assignments"]:
            if a["attribute"] in a["rhs"]:  # self.self_attn.sp_min_tokens = self.sp_min_tokens: passes it on
                continue
            rhs = str(sp_min_tokens) if a["literal"] is not None else f"max({a['rhs']}, {sp_min_tokens})"
            indent = a["text"][:len(a["text"]) - len(a["text"].lstrip())]
            edits.append({"file": a["file"], "line": a["line"], "attribute": a["target"], "old": a["text"],
                          "new": f"{indent}{a['target']} = {rhs}", "value": sp_min_tokens,
                          "units": "whole batch", "before": a["before"], "after": a["after"]})
    fused = next((c for c in (facts.get("helpers") or {}).get("constants", []) if c["name"] == FUSED_AG_CONSTANT), None)
    if (fused is not None and model["fused_all_gather_matmul"] and fused_ag_per_rank is not None
            and str(dtype).removeprefix("torch.") in ("bfloat16", "bf16")):
        edits.append({"file": HELPERS_FILE, "line": fused["line"], "constant": FUSED_AG_CONSTANT, "old": fused["text"],
                      "new": f"{FUSED_AG_CONSTANT} = {fused_ag_per_rank}", "value": fused_ag_per_rank,
                      "units": "per rank (shard rows, x.shape[0])", "before": fused["before"], "after": fused["after"]})
    return edits


def _unified_diff(edits: list[dict[str, Any]]) -> str:
    """One-line replacements with their vendored context as a unified diff (``patch -p1`` in site-packages)."""
    out = []
    for file in sorted({e["file"] for e in edits}):
        known: dict[int, str] = {}
        changed: dict[int, str] = {}
        for e in (e for e in edits if e["file"] == file):
            line = e["line"]
            known.update({line - len(e["before"]) + i: t for i, t in enumerate(e["before"])})
            known.update({line + 1 + i: t for i, t in enumerate(e["after"])})
            known[line], changed[line] = e["old"], e["new"]
        out += [f"--- a/{file}", f"+++ b/{file}"]
        lines = sorted(changed)
        hunks: list[list[int]] = []
        for line in lines:  # hunks whose context windows touch are one hunk
            if hunks and line - 3 <= hunks[-1][-1] + 3 + 1:
                hunks[-1].append(line)
            else:
                hunks.append([line])
        for hunk in hunks:
            first, last = max(1, hunk[0] - 3), hunk[-1] + 3
            window = [n for n in range(first, last + 1) if n in known]
            out.append(f"@@ -{window[0]},{len(window)} +{window[0]},{len(window)} @@")
            for n in window:
                if n in changed:
                    out += [f"-{known[n]}", f"+{changed[n]}"]
                else:
                    out.append(f" {known[n]}")
    return "\n".join(out) + "\n"
