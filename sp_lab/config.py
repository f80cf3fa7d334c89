"""What to compile (:class:`LabConfig`) and the config's JSON and vLLM forms.

What will really run here is :mod:`sp_lab.effective`'s job; the two are kept apart on purpose
(docs/vllm-config.md).

This module imports no torch, so loading and editing configs (a notebook that only reads results) stays
cheap. Writing a tuned config with its provenance is :mod:`sp_lab.tuning.export`'s job.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
import json
import math
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from sp_lab.jsonfile import TypedJSON, json_kind, read_json
from sp_lab.rules import MatmulRule
from sp_lab.vllm_releases import DEFAULT_RELEASE as DEFAULT_VLLM_RELEASE

__all__ = [
    "BoundaryStrategy",
    "ConfigError",
    "LabConfig",
    "load_tuned_config",
]

CompileMode = Literal["piecewise", "full_graph"]
HeuristicDefault = Literal["fuse", "no_fuse"]
CudaGraphMode = Literal["none", "piecewise", "full", "full_and_piecewise"]

SCHEMA = "sp_lab.config/1"
DERIVED_SECTIONS = ("vllm", "model_sp", "torch_compile", "serving")
"""Sections of a tuned-config file derived from the ``sp_lab`` section (and the rows): written, never read back."""

# "namespace::op" with an optional overload ("aten::mm.default"), as torch.library names ops.
_QUALIFIED_OP = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")

# vLLM's default CUDA-graph ladder starts 1, 2, 4, 8 and grows; powers of two up to 512 keep the
# capture count (and capture memory) small while covering decode batch sizes.
_DEFAULT_CAPTURE_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class BoundaryStrategy(enum.StrEnum):
    """How the residual crosses a piece boundary once SP shards it (``LabConfig.boundary``; piecewise mode).

    Each strategy is one member; what the SP pass does at a graph's edges follows from its attributes:

    - ``sp_before_split``: SP rewrites the whole graph before it is split, so boundaries carry the shard
      and every piece is compiled for the shapes it really receives (otherwise SP runs inside each piece);
    - ``gathers_outputs``: an output whose token dimension was sharded is all-gathered before it leaves;
    - ``copies``: what happens to an epilogue ``copy_(dst [N, H], src)`` whose source became a shard:
      ``"keep"`` (the mismatched copy stays: the known failure), ``"erase"`` (dropped: silently loses an
      in-place residual update), ``"gather"`` (all-gathered into the copy: correct).

    A member compares equal to its name (``BoundaryStrategy.SHARDED == "sharded"``) and is written as it.
    """

    sp_before_split: bool
    gathers_outputs: bool
    copies: Literal["keep", "erase", "gather"]

    def __new__(cls, value: str, sp_before_split: bool, gathers_outputs: bool, copies: str) -> typing.Self:
        member = str.__new__(cls, value)
        member._value_ = value
        member.sp_before_split, member.gathers_outputs, member.copies = sp_before_split, gathers_outputs, copies
        return member

    NONE = "none", False, False, "keep"
    """No fix-up: reproduces the ``assert_size_stride`` / ``copy_`` failures (vLLM's design, SP in each piece)."""
    GATHER_ERASE = "gather_erase", False, True, "erase"
    """The unmerged vLLM draft: all-gather shrunken outputs, erase mismatched ``copy_`` (wrong for in-place
    residuals)."""
    GATHER = "gather", False, True, "gather"
    """All-gather at every boundary output and into the ``copy_``."""
    SHARDED = "sharded", True, True, "gather"
    """SP on the whole graph before splitting: the residual crosses boundaries as a shard."""

    @classmethod
    def _missing_(cls, value: object) -> BoundaryStrategy:
        raise ConfigError(f"boundary: unknown strategy {value!r}; choose from {cls.names()}")

    @classmethod
    def names(cls) -> str:
        """``"none, gather_erase, gather, sharded"``: the accepted values, for messages and help texts."""
        return ", ".join(m.value for m in cls)


class ConfigError(ValueError):
    """A configuration value, combination or file is invalid. The message names the field and the fix."""


@dataclasses.dataclass(kw_only=True)
class LabConfig:
    """How to compile a TP model with Sequence Parallelism (SP) and AsyncTP.

    Token counts are split into inclusive compile ranges (:meth:`compile_ranges`); each range gets
    its own compiled artifact; SP is applied only to ranges at or above :attr:`sp_start` (``sp_min_tokens``,
    else ``async_tp_min_tokens``) and AsyncTP only at or above ``async_tp_min_tokens`` (:meth:`sp_active_for`,
    :meth:`async_tp_active_for`).
    """

    tp_size: int = 2
    """Tensor-parallel group size; must equal the world size of the process group at compile time."""

    enable_sp: bool = True
    """Rewrite ``all_reduce -> norm`` into ``reduce_scatter -> norm on 1/tp of the tokens -> all_gather``."""

    enable_async_tp: bool = True
    """Fuse SP's all_gather/reduce_scatter with the neighbouring matmuls (needs ``enable_sp``)."""

    async_tp_min_tokens: int = 128
    """Smallest token count that gets SP and AsyncTP; below it both are off for that token range.
    128 is the draft's hand-picked default; ``sp_lab.tuning.policy`` recommends a measured one."""

    sp_min_tokens: int | None = None
    """Smallest token count that gets SP when SP should start before AsyncTP (SP alone in between);
    ``None``: SP starts together with AsyncTP at ``async_tp_min_tokens``. ``1`` with AsyncTP gated
    runs SP everywhere and fuses from ``async_tp_min_tokens`` on."""

    compile_mode: CompileMode = "piecewise"
    """``"piecewise"``: split the graph at ``splitting_ops`` and compile each piece (vLLM's default);
    ``"full_graph"``: compile one graph, no piece boundaries."""

    splitting_ops: list[str] = dataclasses.field(default_factory=lambda: ["sp_lab::attention"])
    """Qualified custom ops (``"namespace::name"``) the graph is split at in piecewise mode."""

    boundary: BoundaryStrategy = BoundaryStrategy.SHARDED
    """How the residual crosses a piece boundary once SP shards it (piecewise mode only): one of
    :class:`BoundaryStrategy` (``"none"``, ``"gather_erase"``, ``"gather"``, ``"sharded"``), given as the member
    or its name."""

    compile_range_split_points: list[int] = dataclasses.field(default_factory=list)
    """Extra token boundaries: each point ``p`` starts a new compile range ``[p, ...]``. Sorted and
    de-duplicated on construction; every point must lie in ``(1, max_num_tokens]``."""

    max_num_tokens: int = 16384
    """Largest token count any call may have (the top of the last compile range)."""

    cudagraphs: bool = False
    """Capture CUDA graphs (GPU only; dropped with a reason on CPU). A shorthand kept from before
    ``cudagraph_mode``: ``True`` alone means ``"piecewise"``; once ``cudagraph_mode`` is given this field
    follows it (``cudagraph_mode != "none"``)."""

    cudagraph_mode: CudaGraphMode | None = None
    """How CUDA graphs are captured at the capture sizes, as vLLM's ``cudagraph_mode``: ``"none"``;
    ``"piecewise"`` (one graph per compiled piece, attention eager between them); ``"full"`` (the whole
    forward as one graph); ``"full_and_piecewise"`` (full graphs where the range has SP off, piecewise where
    it is on; see :mod:`sp_lab.compiler.cudagraphs`). ``None`` follows ``cudagraphs``."""

    cudagraph_capture_sizes: list[int] | None = None
    """Token counts to capture; ``None`` means :meth:`resolved_capture_sizes`' default ladder
    (1, 2, 4, ..., 512, capped at ``max_num_tokens``)."""

    heuristic: MatmulRule | None = None
    """Per-matmul fusion rule, consulted for every AsyncTP candidate in an SP range; ``None`` fuses
    every candidate. Filled in by tuning (``sp_lab.tuning.train``)."""

    heuristic_default: HeuristicDefault = "fuse"
    """What the AsyncTP gate does when the rule answers ``"unsure"`` or a matmul's shapes cannot be read."""

    token_dim: int = 0
    """Which dimension of the model's first forward argument holds the tokens: 0 for sp_lab's models
    (``input_ids [N]``, activations ``[N, H]``), 1 for ``[batch, seq]`` inputs (torchtitan, Hugging Face).

    The dimensions before it are a batch: a call's token count is every token it holds, ``batch * seq``
    (:meth:`num_tokens`), as vLLM counts the flattened tokens of a batch. Compile ranges,
    ``async_tp_min_tokens``, ``sp_min_tokens``, ``max_num_tokens`` and the report's per-count lookups
    (``report.op_counts(n)``) all compare against that product; a ``[2, 64]`` call is 128 tokens. SP shards
    the ``batch * seq`` rows of each activation (``[B, S, H]`` viewed as ``[B*S, H]``). The batch size is
    static: another batch size is another Dynamo graph (its own compiles)."""

    def __post_init__(self) -> None:
        # The fields' types checked by the one strict loader of typed JSON: a tuple is held as a list, a
        # strategy given by name as the member.
        hints = _field_types(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, _FIELDS.decode(hints[f.name], getattr(self, f.name), f.name))
        self._check_values()
        # Normalise so that equal configs compare equal and serialise identically.
        if self.cudagraph_mode is None:
            self.cudagraph_mode = "piecewise" if self.cudagraphs else "none"
        self.cudagraphs = self.cudagraph_mode != "none"
        self.compile_range_split_points = sorted(set(self.compile_range_split_points))
        if self.cudagraph_capture_sizes is not None:
            self.cudagraph_capture_sizes = sorted(set(self.cudagraph_capture_sizes))

    def _check_values(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"tp_size: must be >= 1, got {self.tp_size}")
        if self.token_dim < 0:
            raise ConfigError(f"token_dim: must be >= 0 (a dimension of the model input), got {self.token_dim}")
        if self.enable_async_tp and not self.enable_sp:
            raise ConfigError(
                "enable_async_tp=True needs enable_sp=True: AsyncTP fuses the reduce_scatter/all_gather "
                "that SP creates: set enable_sp=True (or enable_async_tp=False)"
            )
        if self.max_num_tokens < 1:
            raise ConfigError(f"max_num_tokens: must be >= 1, got {self.max_num_tokens}")
        if not 1 <= self.async_tp_min_tokens <= self.max_num_tokens:
            raise ConfigError(
                f"async_tp_min_tokens: must be in [1, max_num_tokens={self.max_num_tokens}], got "
                f"{self.async_tp_min_tokens}; to keep SP off for every size set enable_sp=False instead"
            )
        if self.sp_min_tokens is not None and not 1 <= self.sp_min_tokens <= self.async_tp_min_tokens:
            raise ConfigError(
                f"sp_min_tokens: must be in [1, async_tp_min_tokens={self.async_tp_min_tokens}], got "
                f"{self.sp_min_tokens}; SP has to run wherever AsyncTP does (None: start both together)"
            )
        for i, ops in enumerate(self.splitting_ops):
            if not _QUALIFIED_OP.match(ops):
                raise ConfigError(
                    f"splitting_ops[{i}]: {ops!r} is not a qualified op name 'namespace::name' "
                    "(e.g. 'sp_lab::attention', 'vllm::unified_attention')"
                )
        for i, p in enumerate(self.compile_range_split_points):
            if not 1 < p <= self.max_num_tokens:
                raise ConfigError(
                    f"compile_range_split_points[{i}]: {p} is outside (1, max_num_tokens={self.max_num_tokens}]; "
                    "a split point p starts the range [p, ...], so it must be in 2..max_num_tokens"
                )
        if self.cudagraphs and self.cudagraph_mode == "none":
            raise ConfigError(
                "cudagraphs=True contradicts cudagraph_mode='none': set cudagraph_mode to 'piecewise', 'full' or "
                "'full_and_piecewise' (cudagraphs then follows it), or cudagraphs=False"
            )
        if self.cudagraph_capture_sizes is not None:
            if not self.cudagraph_capture_sizes:
                raise ConfigError(
                    "cudagraph_capture_sizes: empty list; use None for the default ladder or cudagraphs=False"
                )
            for i, size in enumerate(self.cudagraph_capture_sizes):
                if not 1 <= size <= self.max_num_tokens:
                    raise ConfigError(
                        f"cudagraph_capture_sizes[{i}]: {size} is outside [1, max_num_tokens={self.max_num_tokens}]"
                    )

    def notes(self) -> list[str]:
        """Settings that are valid but have no effect in this combination (reported, never rejected)."""
        notes = []
        if self.compile_mode == "full_graph":
            if self.boundary != "sharded":
                notes.append(
                    f"boundary='{self.boundary}' has no effect with compile_mode='full_graph': "
                    "there are no piece boundaries"
                )
            if self.splitting_ops != ["sp_lab::attention"]:
                notes.append("splitting_ops are ignored with compile_mode='full_graph'")
        elif not self.splitting_ops:
            notes.append(
                "splitting_ops is empty: compile_mode='piecewise' compiles one piece, as 'full_graph'"
            )
        if self.heuristic is not None and not self.enable_async_tp:
            notes.append("heuristic is unused: enable_async_tp=False")
        if self.cudagraph_capture_sizes is not None and not self.cudagraphs:
            notes.append("cudagraph_capture_sizes is unused: cudagraphs=False")
        return notes

    # -- compile ranges -----------------------------------------------------------------------------

    def compile_ranges(self) -> list[tuple[int, int]]:
        """Inclusive token ranges ``[(lo, hi), ...]`` covering ``1..max_num_tokens``, in order.

        ``[1, async_tp_min_tokens - 1]`` and ``[async_tp_min_tokens, max_num_tokens]``, each further
        split at :attr:`sp_start` (where ``sp_min_tokens`` starts SP earlier) and at
        ``compile_range_split_points``. The ``async_tp_min_tokens`` boundary is kept even with
        ``enable_sp=False`` so an SP-off baseline compiles exactly the ranges of the run it is compared with.

        >>> LabConfig(async_tp_min_tokens=128, compile_range_split_points=[1024], max_num_tokens=4096).compile_ranges()
        [(1, 127), (128, 1023), (1024, 4096)]
        """
        starts = sorted({1, self.async_tp_min_tokens, self.sp_start, *self.compile_range_split_points})
        ends = [s - 1 for s in starts[1:]] + [self.max_num_tokens]
        return list(zip(starts, ends, strict=True))

    def num_tokens(self, shape: Sequence[Any]) -> Any:
        """The token count of a call whose first argument has ``shape``: the product of its dimensions up to
        and including ``token_dim`` (``batch * seq`` for ``[batch, seq]``; ints or SymInts).

        >>> LabConfig(token_dim=1).num_tokens((2, 64))
        128
        """
        if len(shape) <= self.token_dim:
            raise ValueError(
                f"token_dim={self.token_dim} but the first argument has shape {tuple(shape)}: set LabConfig.token_dim "
                "to the dimension that holds the tokens (0 for [N] / [N, H], 1 for [batch, N])"
            )
        return math.prod(shape[: self.token_dim + 1])

    def range_for(self, num_tokens: int) -> tuple[int, int]:
        """The compile range ``(lo, hi)`` that serves a call with ``num_tokens`` tokens."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise TypeError(f"num_tokens: expected int, got {type(num_tokens).__name__} {num_tokens!r}")
        if num_tokens < 1:
            raise ValueError(f"num_tokens={num_tokens}: a call needs at least 1 token")
        if num_tokens > self.max_num_tokens:
            raise ValueError(
                f"num_tokens={num_tokens} exceeds max_num_tokens={self.max_num_tokens}: "
                "raise LabConfig.max_num_tokens or split the batch"
            )
        ranges = self.compile_ranges()
        return ranges[bisect.bisect_right([lo for lo, _ in ranges], num_tokens) - 1]

    @property
    def sp_start(self) -> int:
        """The smallest token count SP runs at when enabled (``sp_min_tokens`` or ``async_tp_min_tokens``)."""
        return self.async_tp_min_tokens if self.sp_min_tokens is None else self.sp_min_tokens

    def _check_range(self, compile_range: tuple[int, int]) -> None:
        lo, hi = compile_range
        if lo > hi:
            raise ValueError(f"compile range {compile_range} ends before it starts; use a range from "
                             f"compile_ranges(): {self.compile_ranges()}")
        for name, gate in (("async_tp_min_tokens", self.async_tp_min_tokens), ("sp_min_tokens", self.sp_start)):
            if lo < gate <= hi:
                raise ValueError(
                    f"compile range {compile_range} straddles {name}={gate}; "
                    f"use a range from compile_ranges(): {self.compile_ranges()}"
                )

    def sp_active_for(self, compile_range: tuple[int, int]) -> bool:
        """Whether SP is applied to the artifact for ``compile_range`` (a member of :meth:`compile_ranges`)."""
        self._check_range(compile_range)
        return self.enable_sp and compile_range[0] >= self.sp_start

    def async_tp_active_for(self, compile_range: tuple[int, int]) -> bool:
        """Whether AsyncTP fusion is attempted in the artifact for ``compile_range``."""
        return (self.enable_async_tp and self.sp_active_for(compile_range)
                and compile_range[0] >= self.async_tp_min_tokens)

    def resolved_capture_sizes(self) -> list[int]:
        """``cudagraph_capture_sizes``, or the default ladder 1, 2, 4, ..., 512 capped at ``max_num_tokens``."""
        if self.cudagraph_capture_sizes is not None:
            return list(self.cudagraph_capture_sizes)
        return [s for s in _DEFAULT_CAPTURE_LADDER if s <= self.max_num_tokens]

    # -- serialisation ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON types (``heuristic`` as :meth:`MatmulRule.to_dict` or ``None``)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["heuristic"] = None if self.heuristic is None else self.heuristic.to_dict()
        d["boundary"] = self.boundary.value
        return {k: list(v) if isinstance(v, list) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LabConfig:
        """Inverse of :meth:`to_dict`. Unknown fields and wrong types raise :class:`ConfigError`."""
        if not isinstance(d, dict):
            raise ConfigError(f"LabConfig: expected a dict of fields, got {type(d).__name__}")
        return _FILE.decode(cls, d)

    def to_vllm(self, version: str = DEFAULT_VLLM_RELEASE) -> dict[str, Any]:
        """This config as a vLLM ``--compilation-config`` object for vLLM release ``version``.

        :func:`sp_lab.vllm_releases.vllm_export` writes it from the release table (field names, what gates SP
        there, CUDA-graph modes; read from each release's wheel). A policy the release cannot run (a token
        threshold before 0.17, anything with SP from 0.32, SP before AsyncTP at a second threshold) raises
        :class:`ConfigError` with the reason, as does an unknown ``version`` (the message lists the known ones).
        """
        export = self._vllm_export(version)
        if export.compilation_config is None:
            raise ConfigError(f"to_vllm: {export.not_expressible}; the closest vLLM {export.release.version} can "
                              f"run: {', '.join(export.closest)}")
        return export.compilation_config

    def vllm_section(self, version: str = DEFAULT_VLLM_RELEASE) -> dict[str, Any]:
        """The exported file's ``vllm`` section: the release, what the config does there and its
        ``--compilation-config`` object, or why this release cannot express it (``not_expressible``) and the
        closest choices it can."""
        return self._vllm_export(version).to_dict()

    def _vllm_export(self, version: str):
        from sp_lab.vllm_releases import vllm_export

        try:
            return vllm_export(self, version)
        except KeyError as e:
            raise ConfigError(f"vLLM release: {e.args[0]}") from None

    def to_json(self, path: str | Path | None = None, *, provenance: dict[str, Any] | None = None,
                vllm_release: str = DEFAULT_VLLM_RELEASE, sections: dict[str, Any] | None = None) -> str:
        """The tuned-config file as JSON text; also written to ``path`` when given.

        ``{"schema": "sp_lab.config/1", "vllm": vllm_section(), "sp_lab": to_dict(), "provenance": {...}}``
        (``provenance`` only when given). ``sections`` replaces or adds derived sections (the exporter's
        ``vllm`` section with regrets, ``model_sp``, ``torch_compile``). The ``vllm`` section is derived;
        :meth:`from_json` reads ``sp_lab`` and checks that ``vllm`` still agrees with it.
        """
        doc: dict[str, Any] = {"schema": SCHEMA, "vllm": self.vllm_section(vllm_release),
                               "sp_lab": self.to_dict()}
        unknown = set(sections or {}) - set(DERIVED_SECTIONS)
        if unknown:
            raise ConfigError(f"sections: {sorted(unknown)} are not sections of the file; known: {DERIVED_SECTIONS}")
        doc.update(sections or {})
        if provenance is not None:
            doc["provenance"] = provenance
        text = json.dumps(doc, indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> LabConfig:
        """Load a file written by :meth:`to_json` / :func:`export_tuned_config`, or a bare dict of fields,
        from a path or from JSON text."""
        return load_tuned_config(path_or_text)[0]


def load_tuned_config(path_or_text: str | Path) -> tuple[LabConfig, dict[str, Any]]:
    """Like :meth:`LabConfig.from_json`, also returning the file's ``provenance`` (``{}`` if none)."""
    doc = read_json(path_or_text, what="config", error=ConfigError)
    if not isinstance(doc, dict):
        raise ConfigError(f"config: expected a JSON object, got {type(doc).__name__}")
    if "schema" not in doc:
        return LabConfig.from_dict(doc), {}
    if doc["schema"] != SCHEMA:
        raise ConfigError(f"schema: expected {SCHEMA!r}, got {doc['schema']!r}")
    unknown = set(doc) - {"schema", "sp_lab", "provenance", *DERIVED_SECTIONS}
    if unknown:
        raise ConfigError(
            f"unknown top-level keys {sorted(unknown)}; expected schema, sp_lab, provenance, {', '.join(DERIVED_SECTIONS)}"
        )
    if "sp_lab" not in doc:
        raise ConfigError("sp_lab: missing; the 'sp_lab' section holds the LabConfig fields")
    config = LabConfig.from_dict(doc["sp_lab"])
    # The vllm section is derived from sp_lab: its vLLM object (or reason) must still follow from it. Files
    # written before sections named an exact release ("0.11", "2026.03" or none) are not checked.
    section = doc.get("vllm")
    if isinstance(section, dict) and str(section.get("release")) in _known_releases():
        derived = config.vllm_section(str(section["release"]))
        keys = ("compilation_config", "not_expressible")
        for path, got, want in _diff({k: section.get(k) for k in keys}, {k: derived.get(k) for k in keys}, "vllm"):
            raise ConfigError(
                f"{path}: the file says {got!r} but its sp_lab section gives {want!r}; the vllm section is "
                "derived from sp_lab -- edit the sp_lab section (or delete the vllm section)"
            )
    provenance = doc.get("provenance", {})
    if not isinstance(provenance, dict):
        raise ConfigError(f"provenance: expected a dict, got {type(provenance).__name__}")
    return config, provenance


# -- validation helpers ------------------------------------------------------------------------------


def _known_releases() -> dict:
    from sp_lab.vllm_releases import releases

    return releases()


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _rule(value: Any) -> MatmulRule:
    """A ``heuristic`` given as a rule or as its JSON form (a RuleError names the bad node)."""
    if isinstance(value, MatmulRule):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"expected a MatmulRule or its JSON object, got {json_kind(value)}")
    return MatmulRule.from_dict(value)


_FIELDS = TypedJSON(ConfigError, built=True)
"""LabConfig's fields checked by the one strict loader of typed JSON (``"<field>: expected ..."``)."""
_FILE = TypedJSON(ConfigError, hooks={MatmulRule: _rule})
"""The same for a config read from JSON, where a rule is its JSON object."""


def _diff(got: Any, want: Any, path: str):
    """Yield ``(path, got, want)`` for every leaf where two JSON values differ."""
    if isinstance(got, dict) and isinstance(want, dict):
        for key in sorted(set(got) | set(want)):
            yield from _diff(got.get(key), want.get(key), f"{path}.{key}")
    elif got != want or type(got) is not type(want):
        yield path, got, want
