"""Which program runs at which token count: the reference variants, policies over them, and the config gates.

A **reference variant** is one program run at every token count (:data:`PROGRAMS`, from least to most
rewriting): ``baseline`` (plain TP), ``sp`` (sequence parallelism alone), ``sp+async_tp`` (SP with the fused
kernels). A :class:`~sp_lab.config.LabConfig`'s gates (``enable_sp``, ``sp_min_tokens``,
``async_tp_min_tokens``, ``enable_async_tp``) pick one of them at each token count; a :class:`Policy` writes
the same choice as steps. Every question "what runs at ``T`` tokens" is answered here, from the one table:

- :func:`variant_config`: the config a sweep measures for a variant (``tuned``: the given config as is);
- :func:`variant_run`: the variant whose program a config runs at ``T`` (what a regret compares);
- :func:`expectation`: what the compile report of that config should show at ``T``;
- :meth:`Policy.of` (a config's gates as steps) and :meth:`Policy.to_config` (steps as gates).

Adding a variant is one row of :data:`PROGRAMS`. This module imports no torch and reads configs only
through their public gates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sp_lab.vocabulary import ALWAYS, BASELINE, NEVER, SP, SP_ASYNC_TP, TUNED

if TYPE_CHECKING:
    from sp_lab.config import LabConfig

__all__ = ["PROGRAMS", "REFERENCE_VARIANTS", "REWRITE_LEVEL", "VARIANTS", "Expectation", "Policy", "Program",
           "closest_policy", "expectation", "variant_config", "variant_run"]


@dataclasses.dataclass(frozen=True)
class Program:
    """A reference variant: which passes run, at every token count."""

    variant: str
    """The variant's name in rows, plots and files (:mod:`sp_lab.vocabulary`)."""
    sp: bool
    """SP rewrites the summing ``all_reduce``s into ``reduce_scatter`` / ``all_gather``."""
    async_tp: bool
    """AsyncTP fuses those collectives with their matmuls (needs ``sp``)."""


PROGRAMS = (
    Program(BASELINE, sp=False, async_tp=False),
    Program(SP, sp=True, async_tp=False),
    Program(SP_ASYNC_TP, sp=True, async_tp=True),
)
"""The reference variants, from least to most rewriting (a policy only ever moves down this list)."""

REFERENCE_VARIANTS = tuple(p.variant for p in PROGRAMS)
"""The programs a policy chooses among at a token count, from least to most rewriting."""
VARIANTS = (*REFERENCE_VARIANTS, TUNED)
"""Every variant a sweep measures."""
REWRITE_LEVEL = {p.variant: level for level, p in enumerate(PROGRAMS)}
"""How much of the graph a variant rewrites: among choices the data cannot tell apart, less is preferred."""

_BY_NAME = {p.variant: p for p in PROGRAMS}

_PLAIN = {"heuristic": None, "sp_min_tokens": None}
"""What a reference variant resets: no per-matmul rule (fused means fused everywhere), no second gate."""


# ------------------------------------------------------------------------------------------ config -> program
def _program_at(config: LabConfig, num_tokens: int) -> Program:
    """The reference program ``config``'s gates run at ``num_tokens`` (its per-matmul rule set aside)."""
    compile_range = config.range_for(num_tokens)
    sp = config.tp_size > 1 and config.sp_active_for(compile_range)
    async_tp = sp and config.async_tp_active_for(compile_range)
    (program,) = [p for p in PROGRAMS if (p.sp, p.async_tp) == (sp, async_tp)]
    return program


def variant_run(config: LabConfig, num_tokens: int) -> str:
    """The variant whose program ``config`` runs at ``num_tokens`` tokens (from its compile-range gates).

    ``tuned`` where a per-matmul rule decides fusion: only rows of that config itself time that program.
    """
    program = _program_at(config, num_tokens)
    return TUNED if program.async_tp and config.heuristic is not None else program.variant


@dataclasses.dataclass(frozen=True)
class Expectation:
    """What a variant's config should make happen at one token count (judged against the report)."""

    sp: bool
    """SP should rewrite at least one all_reduce."""
    fusion: bool
    """At least one fused AsyncTP op should run."""
    note: str = ""
    """Why an expectation is off where one might assume it on."""


def expectation(config: LabConfig, num_tokens: int) -> Expectation:
    """What ``config`` should do at ``num_tokens`` tokens, from the program its gates run there.

    SP is expected where that program runs SP (with tp > 1); fusion where it runs AsyncTP and no per-matmul
    rule is set (a rule may legitimately refuse every matmul, so fusion is then not *expected*).
    """
    if config.tp_size <= 1:
        return Expectation(sp=False, fusion=False, note="tp=1: no collectives to rewrite")
    program = _program_at(config, num_tokens)
    if config.enable_sp and not program.sp:
        return Expectation(sp=False, fusion=False, note=f"gated off: {num_tokens} < {config.sp_start} (where SP starts)")
    if program.async_tp and config.heuristic is not None:
        return Expectation(sp=program.sp, fusion=False, note="per-matmul rule decides fusion")
    return Expectation(sp=program.sp, fusion=program.async_tp)


def variant_config(variant: str, config: LabConfig, *, tp_size: int | None = None) -> LabConfig:
    """The :class:`LabConfig` that ``variant`` measures, derived from ``config`` (which is not changed).

    ``tp_size`` (the sweep's world size) overrides ``config.tp_size`` when given. A reference variant runs
    its program at every token count and drops any per-matmul rule (``heuristic=None``), so that
    "sp+async_tp" really means "fused everywhere"; ``tuned`` is ``config`` as is.
    """
    base = config if tp_size is None else dataclasses.replace(config, tp_size=tp_size)
    if variant == TUNED:
        return base
    if variant not in _BY_NAME:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
    return Policy.constant(variant).to_config(base)


# ------------------------------------------------------------------------------------------------- policies
@dataclasses.dataclass(frozen=True)
class Policy:
    """Reference variant per token range: ``steps[i] = (first token count, variant)``, the first at 1."""

    steps: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        starts = [s for s, _ in self.steps]
        levels = [REWRITE_LEVEL.get(v, -1) for _, v in self.steps]
        if not self.steps or starts[0] != 1 or starts != sorted(set(starts)) or levels != sorted(set(levels)) \
                or min(levels) < 0:
            raise ValueError(
                f"a policy's steps start at 1 token and move to more rewriting variants "
                f"({' -> '.join(REFERENCE_VARIANTS)}) at increasing token counts; got {self.steps}"
            )

    @classmethod
    def constant(cls, variant: str) -> Policy:
        """``variant`` at every token count."""
        return cls(((1, variant),))

    @classmethod
    def gate(cls, below: str, above: str, threshold: int | None) -> Policy:
        """``below`` under ``threshold`` tokens, ``above`` from it on; ``None`` ("never"): ``below`` everywhere."""
        if threshold is None:
            return cls.constant(below)
        return cls.constant(above) if threshold <= 1 else cls(((1, below), (threshold, above)))

    @classmethod
    def of(cls, config: LabConfig) -> Policy:
        """The policy ``config``'s gates run (a per-matmul rule, if any, is not part of it).

        The program can only change where a gate opens, so it is read at 1 and at each gate.
        """
        steps: list[tuple[int, str]] = []
        for start in sorted({1, config.sp_start, config.async_tp_min_tokens}):
            variant = _program_at(config, start).variant
            if not steps or steps[-1][1] != variant:
                steps.append((start, variant))
        return cls(tuple(steps))

    def variant_at(self, num_tokens: int) -> str:
        """The variant this policy runs at ``num_tokens``."""
        return [v for s, v in self.steps if s <= num_tokens][-1]

    @property
    def thresholds(self) -> tuple[int, ...]:
        """Token counts where the program changes (empty for a constant policy)."""
        return tuple(s for s, _ in self.steps[1:])

    @property
    def threshold(self) -> int | None:
        """The single threshold of a one-threshold policy (``None`` for "never")."""
        return self.thresholds[0] if self.thresholds else None

    @property
    def name(self) -> str:
        """e.g. "baseline below 64, sp+async_tp from 64"; "baseline everywhere (SP and AsyncTP never)"."""
        if len(self.steps) == 1:
            variant = self.steps[0][1]
            return f"{variant} everywhere" + (" (SP and AsyncTP never)" if variant == BASELINE else "")
        parts = [f"{self.steps[0][1]} below {self.steps[1][0]}"]
        parts += [f"{v} from {s}" for s, v in self.steps[1:]]
        return ", ".join(parts)

    def rewrites(self, tokens: Sequence[int]) -> int:
        """How much rewriting this policy does over ``tokens``: the sum of its variants' rewrite levels."""
        return sum(REWRITE_LEVEL[self.variant_at(t)] for t in tokens)

    def to_config(self, base: LabConfig) -> LabConfig:
        """``base`` with its gates set to run this policy (reference variants: no per-matmul rule).

        SP starts at the first step whose program runs SP, AsyncTP at the first that fuses. A policy that
        never runs SP keeps ``base``'s ``async_tp_min_tokens``, so its compile ranges split where fusion starts
        in the runs it is compared with; like every reference variant it drops a second gate (``sp_min_tokens``),
        and with it that split.
        """
        sp_from = [s for s, v in self.steps if _BY_NAME[v].sp]
        fuse_from = [s for s, v in self.steps if _BY_NAME[v].async_tp]
        if not sp_from:
            return dataclasses.replace(base, enable_sp=False, enable_async_tp=False, **_PLAIN)
        if not fuse_from:
            return dataclasses.replace(base, enable_sp=True, enable_async_tp=False,
                                       async_tp_min_tokens=sp_from[0], **_PLAIN)
        return dataclasses.replace(base, enable_sp=True, enable_async_tp=True, **{
            **_PLAIN, "async_tp_min_tokens": fuse_from[0],
            "sp_min_tokens": None if sp_from[0] == fuse_from[0] else sp_from[0]})

    def to_dict(self) -> dict[str, object]:
        """JSON form: the name, the steps and the one-threshold value (``"never"`` when it switches nowhere)."""
        return {"name": self.name, "steps": [list(s) for s in self.steps],
                "threshold": NEVER if self.threshold is None else self.threshold}


def closest_policy(config: LabConfig, name: str) -> Policy:
    """The policy a closest choice (:attr:`sp_lab.vllm_releases.VllmExport.closest`) runs: ``never`` plain TP
    everywhere; ``always`` SP everywhere, fused with AsyncTP only where ``config`` fuses (an SP-only config's fallback
    stays SP-only). The regret written beside an exported choice comes from here, and the exporter writes the same
    programs (``sp_lab.vllm_releases``: ``always`` fuses exactly when ``config.enable_async_tp``)."""
    if name == NEVER:
        return Policy.constant(BASELINE)
    if name == ALWAYS:
        return Policy.constant(SP_ASYNC_TP if config.enable_async_tp else SP)
    raise ValueError(f"unknown closest choice {name!r}; the choices are {NEVER!r} and {ALWAYS!r}")
