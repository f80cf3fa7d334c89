"""A tuned config written to disk with what it was chosen from, and what it will do where a user applies it.

One file per device / tp / model / dtype (vLLM's fused-MoE naming), holding

- ``sp_lab``: the :class:`~sp_lab.config.LabConfig` (read back by :func:`sp_lab.config.load_tuned_config`);
- ``vllm``: the config for one vLLM release (the installed one when vLLM is importable, else the newest known):
  what it does there and the ``--compilation-config`` object, or ``not_expressible`` with the reason and the
  regret of the closest expressible choices on the measured rows (:mod:`sp_lab.vllm_releases`);
- ``model_sp``: per-matmul tokens-per-rank gates for model-level SP (:mod:`sp_lab.tuning.model_sp`), also written
  beside the file as a dependency-free Python file (per rank and whole batch); for vLLM 0.32 on, what that release
  does with SP for the model (:func:`sp_lab.vllm_models.model_level_sp`) and, where it has a token gate, the edit
  as a patch beside the file (``<file>.vllm-<release>.patch``);
- ``torch_compile``: the settings that make Inductor's micro-pipeline TP fire and the tuned gate as a snippet,
  also written beside the file (``<file>.torch_compile.py``; :mod:`sp_lab.tuning.torch_compile_export`);
- ``provenance``: the policy, its regret from :func:`sp_lab.tuning.regret.regret_table` (the same table the
  tuner and the report show), the recommendation with its confidence, and :func:`sp_lab.bench.store.data_hash` of the rows;
- ``serving`` (when :func:`export_config` is given ``traffic=``): the serving answer on the same rows
  (:class:`sp_lab.serving.on_rows.ServingAnswer`: workload, scheduler limits, speedup against baseline with its
  interval, the rows' source and setup, the sentence), or why the rows could not price it.

:func:`describe_file` says all of that in a dozen lines: what runs from which token count, the command line,
the machine it was tuned on (with a warning when that machine cannot answer the question) and a next step.
"""

from __future__ import annotations

import datetime
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from sp_lab.bench.store import data_hash
from sp_lab.config import ConfigError, load_tuned_config
from sp_lab.jsonfile import read_json
from sp_lab.programs import Policy, closest_policy
from sp_lab.tuning.model_sp import ModelSpTable, model_sp_table
from sp_lab.tuning.policy import threshold_text
from sp_lab.tuning.regret import regret_table, summarize
from sp_lab.tuning.torch_compile_export import torch_compile_section
from sp_lab.vllm_models import model_level_sp, served_model
from sp_lab.vllm_releases import (
    DEFAULT_RELEASE,
    installed_release,
    installed_table_release,
    target_release,
    vllm_export,
)
from sp_lab.vocabulary import BASELINE, NEVER, PREDICTED, REHEARSAL, SIMULATED

if TYPE_CHECKING:
    from sp_lab.config import LabConfig
    from sp_lab.serving.on_rows import ServingAnswer
    from sp_lab.tuning.policy import Recommendation

__all__ = ["ExportError", "describe_file", "export_config", "export_tuned_config", "function_path",
           "patch_path", "provenance", "serving_line", "snippet_path", "threshold_text", "torch_compile_section",
           "tuned_config_filename", "vllm_section"]


class ExportError(ValueError):
    """Rows :func:`export_config` will not write a config from as they are (none, or predictions not asked for);
    the message says what to run instead."""


def provenance(rows: pl.DataFrame, config: LabConfig, *, recommendation: Recommendation | None = None,
               chosen_in: str) -> dict[str, Any]:
    """What an exported file says about how ``config`` was chosen (beyond device, torch, data hash)."""
    row = rows.row(0, named=True)
    table = regret_table(rows, config, warn=False)
    total, worst = summarize(table)
    out: dict[str, Any] = {
        "source": row.get("source"),
        "sweep_rows": rows.height,
        "backend": row.get("backend"),
        "boundary": row.get("boundary"),
        "chosen_in": chosen_in,
        "policy": Policy.of(config).name,
        "async_tp_min_tokens": threshold_text(config),
        "regret": {"worst": worst, "total": total,
                   "per_token": {str(r["num_tokens"]): {"ran": r["variant_run"], "best": r["best_variant"],
                                                        "regret_rel": r["regret_rel"]}
                                 for r in table.iter_rows(named=True)}},
    }
    if recommendation is not None:
        out["recommendation"] = recommendation.to_dict()
    return out


def vllm_section(rows: pl.DataFrame, config: LabConfig, version: str) -> dict[str, Any]:
    """The file's ``vllm`` section for release ``version``, with each closest choice's regret on ``rows``."""
    section = vllm_export(config, version).to_dict()
    for name, choice in section.get("closest", {}).items():
        total, worst = summarize(regret_table(rows, closest_policy(config, name).to_config(config), warn=False))
        choice["regret"] = {"worst": worst, "total": total}
    return section


def tuned_config_filename(*, device_name: str, tp_size: int, model: str, dtype: str) -> str:
    """``device_name=NVIDIA_H200,tp=2,model=llama-3-8b,dtype=bfloat16.json`` (vLLM's fused-MoE naming)."""
    parts = {"device_name": device_name, "tp": str(tp_size), "model": model, "dtype": dtype}
    # Keep names portable: spaces (vLLM does the same for device names), '/', ',' and '=' become '_'.
    return ",".join(f"{k}={re.sub(r'[^A-Za-z0-9._-]+', '_', v)}" for k, v in parts.items()) + ".json"


def export_tuned_config(config: LabConfig, *, directory: str | Path, device_name: str, model_spec: dict[str, Any],
                        dtype: Any, data_hash: str, extra_provenance: dict[str, Any] | None = None,
                        vllm_release: str = DEFAULT_RELEASE, sections: dict[str, Any] | None = None,
                        torch_version: str | None = None) -> Path:
    """Write ``config`` as one JSON file per device, TP size, model shape and dtype; return its path.

    ``model_spec``: ``ModelSpec.to_dict()`` (needs a ``"name"``); ``dtype``: ``torch.bfloat16`` or ``"bfloat16"``;
    ``data_hash``: hash of the benchmark rows the config was tuned on; ``sections``: derived sections
    (``vllm`` with regrets, ``model_sp``, ``torch_compile``) computed from the rows; ``torch_version``: the torch
    the rows were measured with (default: this process's), which the file's ``torch`` names: rows measured with a
    GPU machine's torch and exported on another machine were tuned on the former.
    """
    import torch

    if hasattr(model_spec, "to_dict"):
        model_spec = model_spec.to_dict()
    if not isinstance(model_spec, dict) or not model_spec.get("name"):
        raise ConfigError(f"model_spec: expected a dict with a 'name' (ModelSpec.to_dict()), got {model_spec!r:.80}")
    dtype_name = str(dtype).removeprefix("torch.")
    prov = {
        "device": device_name,
        "tp_size": config.tp_size,
        "model": model_spec,
        "dtype": dtype_name,
        "torch": torch_version or torch.__version__,
        "data_hash": data_hash,
        "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    clash = set(extra_provenance or {}) & set(prov)
    if clash:
        raise ConfigError(f"extra_provenance: keys {sorted(clash)} are set by export_tuned_config itself")
    prov.update(extra_provenance or {})
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / tuned_config_filename(device_name=device_name, tp_size=config.tp_size,
                                             model=str(model_spec["name"]), dtype=dtype_name)
    config.to_json(path, provenance=prov, vllm_release=vllm_release, sections=sections)
    return path


def export_config(rows: pl.DataFrame, config: LabConfig, directory: str | Path, *,
                  recommendation: Recommendation | None = None, chosen_in: str, vllm_release: str | None = None,
                  matmul_rows: pl.DataFrame | None = None, allow_predicted: bool = False,
                  traffic: ServingAnswer | None = None) -> Path:
    """Write ``config`` (tuned on ``rows`` of one setup) with its provenance, and the model-level function beside
    it (``<file>.min_tokens_per_rank.py``); returns the config file's path.

    ``vllm_release``: the release the ``vllm`` section is written for (default: the installed vLLM's version,
    else the newest known; :func:`sp_lab.vllm_releases.target_release`; one the table cannot place is a
    :class:`~sp_lab.config.ConfigError` naming the supported range); ``matmul_rows``: per-matmul rows for
    per-shape model-level gates. Rows the performance model predicted (``source="predicted"``) are refused
    (:class:`ExportError`) unless ``allow_predicted``: exporting a config no GPU has confirmed is an explicit
    choice, and the file then says ``source: predicted``. ``traffic``: the serving answer on these same rows
    (:func:`sp_lab.serving.on_rows.serving_answer`), written as the ``serving`` section; one computed from other
    rows is refused (:class:`ExportError`).
    """
    if rows.height == 0:
        raise ExportError("no rows: run a sweep (python -m sp_lab run) or replay recorded rows before exporting")
    if not allow_predicted and "source" in rows.columns and (rows["source"] == PREDICTED).any():
        raise ExportError("these rows are predictions (source='predicted'), not measurements; export them only on "
                         "purpose: allow_predicted=True (CLI: python -m sp_lab predict --export-predicted DIR)")
    try:  # before any work: an unknown release (or an installed vLLM the table cannot place) fails first
        release = target_release(vllm_release)
    except KeyError as e:
        raise ConfigError(f"vLLM release: {e.args[0]}; name a release to write for with vllm_release=") from None
    # The section is written for the release as named (a build, a patch the table lacks), so its notes say how
    # the table read it; the file's vllm_release is the table's.
    requested = vllm_release if vllm_release is not None else installed_release() or release
    row = rows.row(0, named=True)
    rows_hash = data_hash(rows)
    if traffic is not None and traffic.rows_hash != rows_hash:
        raise ExportError(f"the serving answer was computed from rows {traffic.rows_hash}, not these ({rows_hash}): "
                          "compute it from the rows exported (sp_lab.serving.on_rows.serving_answer(rows))")
    model_sp = model_sp_table(rows, config, matmul_rows=matmul_rows, data_hash=rows_hash)
    served = served_model(str(row["model"]))
    vllm = vllm_section(rows, config, requested)
    vllm["serve"] = _serve_line(vllm_export(config, requested), vllm, served.serve_as, config.tp_size)
    # toy has no vLLM model class at all: no model-level statement to make
    level = None if served.serve_as is None else _model_level(model_sp, release, served.architecture, str(row["dtype"]))
    tuned_on = (f"{Policy.of(config).name}, tuned on {row['device_name']}, tp {config.tp_size}, {row['dtype']}, "
                f"torch {row.get('torch_version')}, rows {rows_hash}")
    path = export_tuned_config(
        config,
        directory=directory,
        device_name=str(row["device_name"]),
        model_spec={"name": str(row["model"]), "hidden_size": int(row["hidden_size"]),
                    "num_layers": int(row["num_layers"]), "vllm_model": served.serve_as,
                    "architecture": served.architecture},
        dtype=str(row["dtype"]),
        data_hash=rows_hash,
        extra_provenance=provenance(rows, config, recommendation=recommendation, chosen_in=chosen_in),
        vllm_release=release,
        torch_version=row.get("torch_version"),
        sections={"vllm": vllm, "model_sp": {**model_sp.to_dict(), **({"vllm": level.to_dict()} if level else {})},
                  "torch_compile": torch_compile_section(config, provenance=tuned_on),
                  **({"serving": traffic.to_dict()} if traffic is not None else {})},
    )
    function_path(path).write_text(model_sp.function_source())
    snippet_path(path).write_text(torch_compile_section(config, provenance=tuned_on)["snippet"])
    if level is not None and level.patch:
        patch_path(path, level.release).write_text(level.patch)
    return path


def _serve_line(export: Any, section: dict[str, Any], model: str | None, tp: int) -> str | None:
    """The ``vllm serve`` line for the section (the closest choice with least regret where the policy cannot be
    written), naming what vLLM loads; ``None`` where there is no such model (``toy``)."""
    if model is None:
        return None
    return export.serve_line(model, tp, choice=_closest_choice(section)) or None


def _closest_choice(section: dict[str, Any]) -> str | None:
    """The closest choice (``never`` / ``always``) with the least total regret that the release runs where it cannot
    write the policy; ``None`` where it writes the policy itself."""
    closest = section.get("closest", {})
    return min(closest, key=lambda k: closest[k].get("regret", {}).get("total", 0.0), default=None)


def _model_level(table: ModelSpTable, release: str, architecture: str | None, dtype: str) -> Any:
    """What vLLM ``release`` (0.32 on) does with SP for the model, with the edit for the table's gates."""
    qkv = next((m.min_tokens_per_rank for m in table.matmuls if m.name == "qkv" and m.side == "ag"), None)
    return model_level_sp(release, architecture, sp_min_tokens=table.sp_min_tokens,
                          fused_ag_min_tokens_per_rank=qkv, dtype=dtype)


def function_path(config_path: str | Path) -> Path:
    """Where :func:`export_config` writes the model-level ``min_tokens_per_rank`` function for a config file."""
    config_path = Path(config_path)
    return config_path.with_name(config_path.stem + ".min_tokens_per_rank.py")


def snippet_path(config_path: str | Path) -> Path:
    """Where :func:`export_config` writes the torch.compile snippet (``compile_with_async_tp``) for a config file."""
    config_path = Path(config_path)
    return config_path.with_name(config_path.stem + ".torch_compile.py")


def patch_path(config_path: str | Path, release: str) -> Path:
    """Where :func:`export_config` writes the model-level edit for vLLM ``release`` (0.32 on), where there is one."""
    config_path = Path(config_path)
    return config_path.with_name(f"{config_path.stem}.vllm-{release}.patch")


def _pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def _cannot_answer(prov: dict[str, Any]) -> str | None:
    """Why the machine the rows come from cannot say whether SP + AsyncTP pays on GPUs, or ``None``."""
    if prov.get("source") in (PREDICTED, SIMULATED):
        return f"{prov.get('source')} rows (a model of the GPUs, not a run on them): no GPU measured this policy"
    if prov.get("source") == REHEARSAL:
        return "rehearsal rows (ranks sharing one GPU): no real overlap between ranks"
    if prov.get("backend") == "gloo" or str(prov.get("device", "")).lower().startswith("cpu"):
        return ("gloo on CPU: collectives do not overlap with matmuls there and the fused kernels are sp_lab's "
                "chunked CPU stand-ins, so this says nothing about GPUs")
    return None


def serving_line(section: dict[str, Any]) -> str:
    """A file's ``serving`` section in one line: its sentence (policy, verdict, speedup, interval, source), or why
    the rows could not price the workload."""
    workload, source = section.get("workload", "?"), section.get("source")
    if "sentence" not in section:
        return f"serving ({workload} traffic, {source} rows): not priced: {section.get('not_priced')}"
    scheduler = section.get("scheduler") or {}
    mine = section.get("this_config")
    this = "" if not mine else f" This config: {mine['speedup_vs_baseline']:.2f}x vs baseline."
    return (f"serving ({workload} traffic, budget {scheduler.get('max_num_batched_tokens')} tokens): "
            f"{section['sentence']}{this}")


def _installed_table_release() -> str | None:
    """The table's release for the installed vLLM, or ``None`` (none installed, or one the table cannot place)."""
    try:
        return installed_table_release()
    except KeyError:
        return None


def describe_file(path: str | Path, *, model: str | None = None) -> str:
    """What a tuned-config file will do, for a person: policy, vLLM, model code, torch.compile, next step.

    ``model``: what the ``vllm serve`` line loads (default: the file's model as vLLM loads it: a preset's Hugging
    Face id or the checkpoint directory; :func:`sp_lab.vllm_models.served_model`).
    """
    doc = read_json(path, what="tuned config", error=ConfigError)
    config, prov = load_tuned_config(path)
    policy = Policy.of(config)
    regret = prov.get("regret", {})
    model_name = model or (prov.get("model") or {}).get("name", "MODEL")
    lines = [f"tuned config -> {path}",
             (f"  policy: {policy.name}; regret on the "
              f"{' '.join(str(w) for w in (prov.get('sweep_rows', '?'), prov.get('source')) if w)} rows: "
              f"worst {_pct(regret.get('worst'))}, total {_pct(regret.get('total'))}"),
             (f"  tuned on: {prov.get('device')}{f' ({backend})' if (backend := prov.get('backend')) else ''}, "
              f"{model_name}, tp {prov.get('tp_size')}, "
              f"{prov.get('dtype')}, torch {prov.get('torch')}, rows {prov.get('data_hash')}")]
    warning = _cannot_answer(prov)
    if warning:
        lines.append(f"  WARNING: tuned on {warning}.")
    vllm = doc.get("vllm")
    if not isinstance(vllm, dict) or "release" not in vllm:
        raise ConfigError(f"{path}: no vllm section with its release (a file written by hand or by another tool); "
                          "export it again from its rows: python -m sp_lab export --store DIR ...")
    release = str(vllm["release"])
    origin = "installed here" if release == _installed_table_release() else "newest known" \
        if release == DEFAULT_RELEASE else "chosen"
    export = vllm_export(config, release)
    lines.append(f"  vLLM {release} ({origin}): {vllm.get('does', export.does)}")
    closest = vllm.get("closest", {})
    for name, choice in closest.items():
        r = choice.get("regret", {})
        lines.append(f"    closest it can run: {name} (worst {_pct(r.get('worst'))}, total {_pct(r.get('total'))})")
    for note in vllm.get("notes", []):
        lines.append(f"    note: {note}")
    spec = prov.get("model") or {}
    served = served_model(model_name)
    serve_as = model or spec.get("vllm_model", served.serve_as)
    if serve_as is None:
        flags = (_serve_line(export, vllm, "MODEL", config.tp_size) or "").removeprefix("vllm serve MODEL").strip()
        lines.append(f"    no vllm serve line: {served.note}" + (f"; its flags for a model of this shape: {flags}"
                                                                 if flags else ""))
    else:
        # where the policy cannot be written, the command line is that of the closest choice with the least regret
        serve = _serve_line(export, vllm, serve_as, config.tp_size)
        if serve:
            lines.append(f"    {serve}")
    model_sp = doc.get("model_sp")
    if model_sp:
        per_rank, whole = model_sp.get("sp_min_tokens_per_rank"), model_sp.get("sp_min_tokens")
        pays = "SP never paid per layer" if per_rank is None else (
            f"SP pays per layer from {per_rank} tokens per rank ({whole} of the whole batch)")
        lines.append(f"  model code (hand-written SP): {pays}; per matmul: min_tokens_per_rank(k, n, dtype, tp) and "
                     f"min_tokens(...) (whole batch) in {function_path(path).name}")
        level = model_sp.get("vllm")
        if level:
            lines.append(f"    vLLM {level['release']}: {level['statement']}")
            if level.get("patch"):
                lines.append(f"    the edit: {patch_path(path, level['release']).name} (in site-packages: patch -p1 < "
                             "it; read from " + level["wheel"] + ")")
    compiled = doc.get("torch_compile") or {}
    if "snippet" not in compiled:  # a file written before the snippet
        how = "sp_lab.compile(model, sp_lab.LabConfig.from_json(path)) applies this gate"
    elif compiled.get("async_tp_min_tokens") is None:
        how = f"the policy never fuses: {snippet_path(path).name} compiles without it"
    else:
        how = (f"{snippet_path(path).name} fuses from {compiled['async_tp_min_tokens']} tokens of the whole batch "
               "(two compiled programs, picked per call)")
    if "serving" in doc:
        lines.append(f"  {serving_line(doc['serving'])}")
    lines.append("  torch.compile: micro-pipeline TP needs torch._inductor.config._micro_pipeline_tp = True and "
                 f"enable_symm_mem_for_group(group_name) on the TP group, and has no token gate of its own; {how}")
    if warning:
        lines.append("  next: measure on the GPUs you serve on: torchrun --nproc-per-node "
                     f"{config.tp_size} -m sp_lab run --model {model_name} --tp {config.tp_size} --dtype bfloat16")
    elif policy.steps == Policy.constant(BASELINE).steps or _closest_choice(vllm) == NEVER:
        lines.append("  next: the line above is the 'never' line itself, so there is no other line to compare it with; "
                     "tune again if the model, the GPUs or the batch sizes change")
    else:
        lines.append("  next: serve with the line above and compare throughput with the same line for 'never'")
    return "\n".join(lines)
