"""What each vLLM release does with a ``--compilation-config``, and sp_lab's config written for it.

The facts come from the release table ``data/vllm/releases.json``, read from every release's own
wheel from 0.11.0 to the newest on the package index (``benchmarks/vllm_releases/read_releases.py``: each
release's ``vllm/config/compilation.py`` imported with pydantic, its SP pass and model SP helpers parsed;
every entry names the wheel and the file). What gates SP (``VllmRelease.sp_gate``):

- ``static_sizes`` (0.11.0): the SP pass applies only to static ``compile_sizes`` that tp divides, so SP
  runs at those exact token counts and nowhere else: a token threshold cannot be written.
- ``every_size`` (0.11.1-0.16): with ``splitting_ops: []`` SP and AsyncTP run at every token count (without
  it only at static sizes): no token gate, so only "never" and "always" can be written.
- ``sp_min_token_num`` (0.17-0.31): ``pass_config.sp_min_token_num`` gates SP, and with it AsyncTP (which
  only fuses SP's collectives); vLLM splits the compile ranges at ``sp_min_token_num - 1`` itself. The range
  field is ``compile_ranges_split_points`` in 0.17, ``compile_ranges_endpoints`` from 0.18;
  ``splitting_ops: []`` is needed up to 0.19 (from 0.20 vLLM empties it itself when SP is on).
- ``removed`` (0.32 on): the SP and AsyncTP compile passes are gone, and so are their fields (a config naming
  them is rejected). SP lives in model code (``vllm/models/common/ops/sequence_parallel.py``), in a few models
  only: :mod:`sp_lab.vllm_models` says per release and model where, and the edit that applies a tuned gate.

:func:`vllm_export` writes a :class:`~sp_lab.config.LabConfig` for one release: the ``--compilation-config``
object where the release can run the policy (SP exactly where the policy runs it), else ``not_expressible``
with the reason and the expressible policies closest to it. Up to 0.31 the CUDA-graph mode the user chose is kept
and never switched on (``cudagraph_mode`` is always written: vLLM's default would capture graphs, and SP needs the
whole graph). From 0.32 the compile config has nothing for SP, so the object is empty: the line changes nothing
(CUDA graphs included), and a model with built-in SP keeps it. A line that gates SP by token count also sets
``--max-num-batched-tokens`` (the compile ranges and vLLM's clamp of the threshold depend on it).

This module reads a config's gates only (:class:`SpGates`); it imports neither :mod:`sp_lab.config` nor
:mod:`sp_lab.programs`, so the config can write itself for a release (``LabConfig.to_vllm``) without a circle.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import warnings
from functools import cache
from importlib import metadata
from typing import Any, Literal, Protocol

from sp_lab.resources import DATA_DIR
from sp_lab.vocabulary import ALWAYS, NEVER

__all__ = ["ALWAYS", "DEFAULT_RELEASE", "SpGates", "VllmExport", "VllmRelease", "installed_release",
           "installed_table_release", "release", "releases", "resolve_release", "target_release", "unknown_fields",
           "vllm_export", "vllm_sp_min_token_num"]

RELEASES_FILE = DATA_DIR / "vllm" / "releases.json"
"""The release table, read from each release's wheel."""

SpGate = Literal["static_sizes", "every_size", "sp_min_token_num", "removed"]


class SpGates(Protocol):
    """What the exporter reads of a config (:class:`sp_lab.config.LabConfig` has all of it)."""

    tp_size: int
    enable_sp: bool
    enable_async_tp: bool
    async_tp_min_tokens: int
    max_num_tokens: int
    heuristic: object | None
    cudagraph_mode: str | None

    @property
    def sp_start(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class VllmRelease:
    """What one vLLM release accepts in ``--compilation-config`` and what gates SP there (read from its wheel)."""

    version: str
    wheel: str
    """The wheel the facts were read from."""
    config_file: str
    """The file the config classes were imported from (``vllm/config/compilation.py``)."""
    compilation_fields: frozenset[str]
    """``CompilationConfig`` fields a user may set."""
    pass_fields: frozenset[str]
    """``PassConfig`` fields a user may set."""
    unknown_keys: Literal["rejected", "dropped"]
    """What ``TypeAdapter(CompilationConfig).validate_json`` does with a key the release does not know."""
    mode_field: str
    """``"level"`` (0.11.0) or ``"mode"``: how the release names "compile with vLLM's backend" (value 3)."""
    sp_flag: str | None
    """The ``PassConfig`` field that turns SP on (``None``: the pass is gone)."""
    async_tp_flag: str | None
    """The ``PassConfig`` field that turns AsyncTP (GEMM + collective fusion) on."""
    sp_threshold_field: str | None
    """``PassConfig`` field gating SP by token count, or ``None``."""
    ranges_field: str | None
    """``CompilationConfig`` field adding compile-range boundaries, or ``None``."""
    cudagraph_modes: tuple[str, ...]
    """``CUDAGraphMode`` names."""
    sp_gate: SpGate
    """What decides at which token counts SP runs (module docstring)."""
    sp_gate_file: str
    """The SP pass file and method the gate was read from."""
    splitting_ops_empty_needed: bool | None
    """Whether SP needs ``splitting_ops: []`` written by the user (``None``: no SP pass)."""
    sp_threshold_rule: dict[str, Any] | None
    """vLLM's built-in ``sp_min_token_num`` default: ``min_hidden_size`` and ``min_per_gpu_size_mb`` by device
    capability (``"90"``, ``"100"``) and the file."""
    model_sp: dict[str, Any] | None
    """The model-level SP helpers of ``vllm/models/common/ops/sequence_parallel.py``, where present (which models
    use them, and where their thresholds live: :mod:`sp_lab.vllm_models`)."""
    wheel_sha256: str | None = None
    """The wheel's sha256 where it was recorded when the entry was read (entries read before that have none)."""

    @property
    def minor(self) -> str:
        return ".".join(self.version.split(".")[:2])

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VllmRelease:
        sets = {"compilation_fields": frozenset(d["compilation_fields"]), "pass_fields": frozenset(d["pass_fields"]),
                "cudagraph_modes": tuple(d["cudagraph_modes"])}
        return cls(**{**d, **sets})


_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?((?:[.-]?(?:a|b|rc|post|dev)\d*)*)(\+[0-9A-Za-z._-]+)?")
"""A PEP 440 release as vLLM's wheels and ``pip`` spell it: ``0.19.1``, ``0.18`` (a minor), ``0.20.0.dev5+g1a2b``,
``0.18.1.post1``, ``0.19.1+cu128``, ``0.12.0rc1`` (packaging is not a dependency; this is all sp_lab needs)."""


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


@cache
def releases() -> dict[str, VllmRelease]:
    """Every release in the table, oldest first, by version (``"0.18.1"``)."""
    rows = json.loads(RELEASES_FILE.read_text())["releases"]
    table = sorted((VllmRelease.from_dict(r) for r in rows), key=lambda r: _version_key(r.version))
    return {r.version: r for r in table}


DEFAULT_RELEASE = next(reversed(releases()))
"""The newest release in the table: what an export targets unless told otherwise (or vLLM is installed)."""


def resolve_release(version: str) -> tuple[VllmRelease, str | None]:
    """The table's release for ``version``, and a note when it is not the one named (else ``None``).

    An exact table version is itself; a minor (``"0.18"``) its newest patch in the table. A build of a
    release (``+cu128``, ``.post1``, ``.dev5``, ``rc1``) or a patch the table lacks (``0.19.0``, where 0.19.1
    was read) is read as the table's release of the same minor: the newest patch not above it, else the
    oldest of that minor; the note says so. Anything else -- not a version, or outside the table's range
    (vLLM before 0.11 has other config classes; a release newer than the table was never read, and it
    may have renamed or removed fields) -- is a ``KeyError`` naming the supported range.
    """
    table = releases()
    text = str(version).strip().removeprefix("v")  # a git tag's spelling, v0.19.1
    if text in table:
        return table[text], None
    match = _VERSION.fullmatch(text)
    oldest, newest = next(iter(table)), DEFAULT_RELEASE
    supported = (f"supported: {oldest} to {newest}, by minor {', '.join(_minors())} (read from each release's "
                 f"wheel into {RELEASES_FILE.name} by benchmarks/vllm_releases/read_releases.py)")
    if match is None:
        raise KeyError(f"{text!r} is not a vLLM version (expected MAJOR.MINOR[.PATCH], e.g. 0.18 or 0.31.0); "
                       f"{supported}")
    major, minor, patch, suffix, local = match.groups()
    same_minor = [r for r in table.values() if r.minor == f"{int(major)}.{int(minor)}"]
    if not same_minor:
        raise KeyError(f"unknown vLLM release {text!r}: the release table has no {int(major)}.{int(minor)}; "
                       f"{supported}")
    if patch is None and not (suffix or local):
        return same_minor[-1], None
    patch_number = int(patch or 0)
    at_or_below = [r for r in same_minor if _version_key(r.version)[2] <= patch_number]
    chosen = at_or_below[-1] if at_or_below else same_minor[0]
    build = " (a pre-release, dev, post or local build)" if suffix or local else ""
    return chosen, (f"vLLM {text}{build} is not in the release table: read as {chosen.version}, the table's "
                    f"{chosen.minor} release")


def release(version: str) -> VllmRelease:
    """The release ``version`` names (:func:`resolve_release`; a mapped version warns with the note).
    ``KeyError`` naming the supported range for anything the table cannot place."""
    rel, note = resolve_release(version)
    if note is not None:
        warnings.warn(note, stacklevel=2)
    return rel


def _minors() -> list[str]:
    return sorted({r.minor for r in releases().values()}, key=_version_key)


def target_release(version: str | None = None) -> str:
    """The table version an export is written for: ``version``'s, else the installed vLLM's, else the newest known.

    ``KeyError`` (the supported range) where the installed vLLM is outside the table: a file written for a
    release the table has never read would describe another one. Callers add how to name another release.
    """
    if version is not None:
        return resolve_release(version)[0].version
    try:
        return installed_table_release() or DEFAULT_RELEASE
    except KeyError as e:
        raise KeyError(f"the installed vLLM: {e.args[0]}") from None


def installed_table_release() -> str | None:
    """The table's release for the installed vLLM (``0.19.1`` for ``0.19.1+cu128``), ``None`` without vLLM;
    ``KeyError`` where the table cannot place it (:func:`resolve_release`)."""
    installed = installed_release()
    return None if installed is None else resolve_release(installed)[0].version


def installed_release() -> str | None:
    """The version of the vLLM installed here (read from its package metadata, vLLM is not imported), or ``None``."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def unknown_fields(compilation_config: dict, version: str) -> list[str]:
    """Keys of a ``--compilation-config`` object (and its ``pass_config``) that release ``version`` does not know."""
    rel = release(version)
    bad = [k for k in compilation_config if k not in rel.compilation_fields]
    bad += [f"pass_config.{k}" for k in compilation_config.get("pass_config", {}) if k not in rel.pass_fields]
    return bad


def vllm_sp_min_token_num(hidden_size: int, dtype_bytes: int, tp_size: int, device_capability: tuple[int, int] = (9, 0),
                          *, version: str | None = None) -> int | None:
    """vLLM's built-in SP token threshold (``sp_min_token_num`` when the user sets none), for comparison.

    ``MB * tp * 2**20 // (hidden * bytes)``: SP from the token count at which one rank's share of the activation
    reaches MB MiB; MB and the smallest hidden size by device capability come from the release table (8 MiB on
    sm90, 32 on sm100 where listed, hidden size >= 8192). ``None``: SP off (small model, device not listed).
    ``version``: a release with the rule (default the newest that has it). Llama-70B in bf16 on Hopper: 1024 at
    TP=2, 2048 at TP=4, 4096 at TP=8.
    """
    if version is None:
        rule = next(r.sp_threshold_rule for r in reversed(releases().values()) if r.sp_threshold_rule)
    else:
        rule = release(version).sp_threshold_rule
        if rule is None:
            raise ValueError(f"vLLM {release(version).version} has no sp_min_token_num default (its SP gate: "
                             f"{release(version).sp_gate}); pick a release from 0.17 to 0.31")
    key = str(device_capability[0] * 10 + device_capability[1])
    mb, min_hidden = rule["min_per_gpu_size_mb"].get(key), rule["min_hidden_size"].get(key)
    if mb is None or min_hidden is None or hidden_size < min_hidden:
        return None
    return int(mb * tp_size * 2**20 // (hidden_size * dtype_bytes))


@dataclasses.dataclass(frozen=True)
class VllmExport:
    """A config written for one vLLM release: the ``--compilation-config`` object, or why there is none."""

    release: VllmRelease
    compilation_config: dict[str, Any] | None
    """The object for ``vllm serve --compilation-config`` (``{}``: nothing to pass); ``None`` when not expressible."""
    not_expressible: str | None
    """Why this release cannot run the policy (``None`` when it can)."""
    closest: dict[str, dict[str, Any]]
    """Where not expressible: the expressible policies nearest to it (``"never"``, ``"always"``: what each runs is
    :func:`closest_policy`), each with its ``compilation_config``; :func:`sp_lab.tuning.export.vllm_section` adds
    their regret on the measured rows."""
    does: str
    """What the object does in this release, in words."""
    notes: tuple[str, ...] = ()
    """What changed on the way (a version read as the table's release of its minor, a CUDA-graph mode vLLM cannot
    keep beside SP, a per-matmul rule left out)."""
    max_num_batched_tokens: int | None = None
    """The ``--max-num-batched-tokens`` the object assumes (it gates SP by token count: the compile ranges end
    there and vLLM lowers ``sp_min_token_num`` to it), ``None`` where the object does not depend on it."""

    def serve_line(self, model: str = "MODEL", tp_size: int | None = None, *, choice: str | None = None) -> str:
        """The ``vllm serve`` command that applies it; when not expressible, that of the closest choice named
        ``choice`` (default the first, ``"never"``). ``model``: what vLLM loads (a Hugging Face id or a checkpoint
        directory: :func:`sp_lab.vllm_models.served_model`). An empty object adds no ``--compilation-config``."""
        config, batched = self.compilation_config, self.max_num_batched_tokens
        if config is None:
            if not self.closest:
                return ""
            config = self.closest[choice or next(iter(self.closest))]["compilation_config"]
            batched = None  # the closest choices gate nothing by token count
        parts = ["vllm serve", shlex.quote(model)]
        if tp_size:
            parts.append(f"--tensor-parallel-size {tp_size}")
        if batched:
            parts.append(f"--max-num-batched-tokens {batched}")
        if config:
            parts.append(f"--compilation-config {shlex.quote(json.dumps(config, separators=(',', ':')))}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The exported file's ``vllm`` section (without the closest choices' regret, which needs rows)."""
        out: dict[str, Any] = {"release": self.release.version, "does": self.does}
        if self.compilation_config is not None:
            out["compilation_config"] = self.compilation_config
            if self.max_num_batched_tokens is not None:
                out["max_num_batched_tokens"] = self.max_num_batched_tokens
        else:
            out["not_expressible"] = self.not_expressible
            out["closest"] = {k: dict(v) for k, v in self.closest.items()}
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def vllm_export(config: SpGates, version: str = DEFAULT_RELEASE) -> VllmExport:
    """``config`` written for vLLM ``version`` (:class:`VllmExport`; a version read as another table entry says so in
    its notes); ``KeyError`` for a release the table cannot place (:func:`resolve_release`)."""
    rel, read_as = resolve_release(version)
    sp = config.enable_sp and config.tp_size > 1
    fused = sp and config.enable_async_tp
    start = config.sp_start
    graphs, graph_note = _cudagraph_mode(config, whole_graph=sp)
    notes = tuple(n for n in (read_as, graph_note if rel.sp_gate != "removed" else None) if n)
    if sp and fused and config.heuristic is not None:
        notes += ("the per-matmul fusion rule stays in the sp_lab section: vLLM fuses every matmul SP exposes",)
    reason = None
    if not sp:
        return VllmExport(rel, _never(rel, graphs), None, {}, _does_never(rel, graphs), notes)
    if fused and start < config.async_tp_min_tokens:
        reason = (f"SP starts at {start} tokens and AsyncTP at {config.async_tp_min_tokens}, but vLLM fuses GEMMs "
                  "with collectives wherever SP runs (one gate for both)")
    elif rel.sp_gate == "removed":
        reason = (f"vLLM {rel.version} removed the SP and AsyncTP compile passes ({_where(rel)}); SP is code inside "
                  "a few models there (vllm/models/common/ops/sequence_parallel.py): see the model-level section")
    elif rel.sp_gate == "static_sizes":
        reason = (f"vLLM {rel.version} runs SP only at static compile_sizes that tp divides ({_where(rel)}), "
                  f"not from {start} tokens on")
    elif rel.sp_gate == "every_size" and start > 1:
        reason = (f"vLLM {rel.version} has no token gate for SP ({_where(rel)}): with splitting_ops [] it runs "
                  f"at every token count, without it only at static sizes tp divides; not from {start} tokens on")
    if reason is not None:
        closest = {NEVER: {"compilation_config": _never(rel, _cudagraph_mode(config, whole_graph=False)[0])}}
        if rel.sp_gate in ("every_size", "sp_min_token_num"):
            # "always" runs SP from the first token, fused where the config fuses (programs.closest_policy)
            closest[ALWAYS] = {"compilation_config": _with_sp(rel, 1, config.enable_async_tp, graphs)}
        return VllmExport(rel, None, reason, closest, f"vLLM {rel.version} cannot run this policy: {reason}.", notes)
    gated = rel.sp_threshold_field is not None and start > 1
    return VllmExport(rel, _with_sp(rel, start, fused, graphs), None, {}, _does_sp(rel, config, fused, graphs), notes,
                      max_num_batched_tokens=config.max_num_tokens if gated else None)


def _cudagraph_mode(config: SpGates, *, whole_graph: bool) -> tuple[str, str | None]:
    """vLLM's ``cudagraph_mode`` for the user's, and a note where it cannot be kept as is.

    With SP the graph is compiled whole (no pieces): per-piece graphs cannot exist, so ``piecewise`` becomes no
    graphs at all (vLLM itself would turn it into FULL: graphs switched on) and ``full_and_piecewise`` (sp_lab:
    whole-forward graphs where SP is off, small batches) becomes ``FULL_DECODE_ONLY`` (full graphs for decode
    batches only). ``none`` stays ``NONE`` and ``full`` stays ``FULL``.
    """
    mode = config.cudagraph_mode or "none"
    if not whole_graph:
        return mode.upper(), None
    if mode == "piecewise":
        return "NONE", ("cudagraph_mode 'piecewise' needs piece boundaries and SP needs the whole graph: exported "
                        "as NONE (vLLM would turn PIECEWISE into FULL graphs, which were not chosen)")
    if mode == "full_and_piecewise":
        return "FULL_DECODE_ONLY", ("cudagraph_mode 'full_and_piecewise': full graphs where SP is off; vLLM compiles "
                                    "the whole graph for SP, so full graphs for decode batches only (FULL_DECODE_ONLY)")
    return mode.upper(), None


def _never(rel: VllmRelease, graphs: str) -> dict[str, Any]:
    """SP and AsyncTP off. From 0.32 the compile config has nothing for them: nothing to write (an object with a
    ``cudagraph_mode`` would change the user's CUDA graphs, FULL_AND_PIECEWISE by default there)."""
    if rel.sp_gate == "removed":
        return {}
    out: dict[str, Any] = {rel.mode_field: 3}
    if rel.sp_flag is not None:
        out["pass_config"] = {rel.sp_flag: False, rel.async_tp_flag: False}
    out["cudagraph_mode"] = graphs
    return out


def _with_sp(rel: VllmRelease, start: int, fused: bool, graphs: str) -> dict[str, Any]:
    """The object that runs SP (+ AsyncTP when ``fused``) from ``start`` tokens in a release that can gate it."""
    passes: dict[str, Any] = {rel.sp_flag: True, rel.async_tp_flag: fused}
    out: dict[str, Any] = {rel.mode_field: 3, "pass_config": passes}
    if rel.sp_threshold_field is not None:
        passes[rel.sp_threshold_field] = start
    # always written: needed up to 0.19, and later it keeps vLLM from turning piecewise graphs into FULL ones
    out["splitting_ops"] = []
    if rel.ranges_field is not None and start > 1:
        out[rel.ranges_field] = [start - 1]  # ranges [1, start - 1] and [start, ...] (vLLM adds it too from 0.17)
    out["cudagraph_mode"] = graphs
    return out


def _where(rel: VllmRelease) -> str:
    """The file (and method) a gate was read from, for a sentence: ``vllm/.../x.py, is_applicable``."""
    return rel.sp_gate_file.replace(" (", ", ").removesuffix(")")


def _what(fused: bool) -> str:
    return "SP + AsyncTP" if fused else "SP (no AsyncTP)"


def _graphs_text(graphs: str) -> str:
    return "no CUDA graphs" if graphs == "NONE" else f"CUDA graphs {graphs}"


def _does_never(rel: VllmRelease, graphs: str) -> str:
    if rel.sp_gate == "removed":
        return (f"vLLM {rel.version} has no SP or AsyncTP in its compile config: nothing to pass, vLLM runs as you run "
                "it (your CUDA-graph mode); a model with built-in SP keeps it (see the model-level section).")
    return f"In vLLM {rel.version} this runs plain TP (SP and AsyncTP off) at every token count, {_graphs_text(graphs)}."


def _does_sp(rel: VllmRelease, config: SpGates, fused: bool, graphs: str) -> str:
    start, top = config.sp_start, config.max_num_tokens
    if start <= 1:
        return (f"In vLLM {rel.version} this runs {_what(fused)} at every token count (one whole graph, "
                f"{_graphs_text(graphs)}).")
    return (f"In vLLM {rel.version} this runs {_what(fused)} from {start} tokens (compile ranges [1, {start - 1}] "
            f"without, [{start}, {top}] with, for --max-num-batched-tokens {top}; vLLM lowers the threshold to "
            f"max_num_batched_tokens where that is smaller), {_graphs_text(graphs)}.")
