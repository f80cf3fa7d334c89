"""The policies a traffic is priced under: which variant's program runs at each step's token count.

Each is a :class:`ServingPolicy` over :mod:`sp_lab.programs` (the one owner of "which program runs at which token
count"): a :class:`~sp_lab.programs.Policy` of reference variants, or a :class:`~sp_lab.config.LabConfig` whose
gates :func:`~sp_lab.programs.variant_run` reads. :func:`standard_policies` lists the ones the report compares:

- ``baseline``: plain TP everywhere;
- ``sp``: sequence parallelism everywhere, no fused kernels;
- ``sp+async_tp always``: fused everywhere (what an ungated AsyncTP does; the decode regression);
- ``sp+async_tp from T``: baseline below ``T`` tokens, SP + AsyncTP from it (``T``: the rows' own crossover);
- ``per-matmul rule``: SP everywhere, each matmul fused or not by a rule (the rows' ``tuned`` curve embodies the
  rule: a given :class:`~sp_lab.rules.MatmulRule` for measured rows, the one the model implies for predicted rows);
- ``draft: per-matmul rule from 128``: the unmerged vLLM draft's own setting, baseline below
  ``LabConfig().async_tp_min_tokens`` (its hand-picked 128) and the per-matmul rule from there -- what the seed's
  serving benchmark ran;
- ``tuned config``: a config the user tuned and exported, through its own gates.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sp_lab.programs import Policy, variant_run
from sp_lab.vocabulary import BASELINE, SP, SP_ASYNC_TP, TUNED, describe_threshold

if TYPE_CHECKING:
    from sp_lab.config import LabConfig

__all__ = ["ServingPolicy", "standard_policies"]


@dataclass(frozen=True)
class ServingPolicy:
    """A named program per token count: ``plan`` (reference variants by range), or ``config``'s gates, or
    baseline below ``rule_from`` and the rows' ``tuned`` curve from it (``plan`` and ``config`` both ``None``)."""

    name: str
    """How the report names it."""
    plan: Policy | None = None
    """Reference variant per token range."""
    config: LabConfig | None = None
    """A config whose gates choose (``tuned`` where its per-matmul rule decides fusion)."""
    threshold: int | None = None
    """Where SP + AsyncTP starts, for threshold policies (``None``: not one)."""
    rule_from: int = 1
    """Without a plan or config: the per-matmul rule (``tuned`` rows) from this count, baseline below."""

    def __post_init__(self) -> None:
        if self.plan is not None and self.config is not None:
            raise ValueError(f"policy {self.name!r}: give a plan or a config, not both")
        if self.rule_from < 1:
            raise ValueError(f"policy {self.name!r}: rule_from must be >= 1, got {self.rule_from}")

    def variant_at(self, num_tokens: int) -> str:
        """The variant whose rows price a step of ``num_tokens`` tokens."""
        if self.plan is not None:
            return self.plan.variant_at(num_tokens)
        if self.config is not None:
            return variant_run(self.config, num_tokens)
        return TUNED if num_tokens >= self.rule_from else BASELINE

    def variants(self, max_tokens: int) -> list[str]:
        """``variant_at`` for ``0..max_tokens`` (index 0 is a placeholder), the form prices are built from."""
        return [""] + [self.variant_at(t) for t in range(1, max_tokens + 1)]

    @classmethod
    def constant(cls, variant: str) -> ServingPolicy:
        """``variant`` at every token count."""
        return cls(variant, plan=Policy.constant(variant))

    @classmethod
    def from_threshold(cls, threshold: int | None) -> ServingPolicy:
        """Baseline below ``threshold`` tokens, SP + AsyncTP from it (``None``: never)."""
        name = (f"{SP_ASYNC_TP} from {describe_threshold(threshold)}" if threshold is not None
                else f"{SP_ASYNC_TP} {describe_threshold(threshold)} (baseline at every step)")
        return cls(name, plan=Policy.gate(BASELINE, SP_ASYNC_TP, threshold), threshold=threshold)


def standard_policies(threshold: int | None, *, variants: Collection[str], config: LabConfig | None = None
                      ) -> list[ServingPolicy]:
    """The policies the report compares (module docstring), baseline first, for rows of ``variants``.
    ``threshold``: where the threshold policy starts (the rows' crossover). A policy whose variant has no rows is
    left out (``sp`` without ``sp`` rows, the per-matmul rule without a ``tuned`` curve); the tuned config only
    when one is given."""
    policies = [ServingPolicy.constant(BASELINE)]
    if SP in variants:
        policies.append(ServingPolicy.constant(SP))
    policies += [ServingPolicy(f"{SP_ASYNC_TP} always", plan=Policy.constant(SP_ASYNC_TP)),
                 ServingPolicy.from_threshold(threshold)]
    if TUNED in variants:
        from sp_lab.config import LabConfig

        draft_gate = LabConfig().async_tp_min_tokens
        policies += [ServingPolicy("per-matmul rule"),
                     ServingPolicy(f"draft: per-matmul rule from {draft_gate}", rule_from=draft_gate)]
    if config is not None:
        policies.append(ServingPolicy("tuned config", config=config))
    return policies
