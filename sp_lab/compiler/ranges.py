"""Token ranges: one compiled artifact per range, chosen at run time by the number of tokens."""

from __future__ import annotations

from dataclasses import dataclass

from sp_lab.config import LabConfig
from sp_lab.effective import EffectiveConfig

__all__ = ["CompileRange", "plan_ranges"]


@dataclass(frozen=True)
class CompileRange:
    """An inclusive token range ``[lo, hi]`` and which passes its artifact gets."""

    lo: int
    hi: int
    enable_sp: bool
    enable_async_tp: bool

    def __contains__(self, num_tokens: int) -> bool:
        return self.lo <= num_tokens <= self.hi

    @property
    def label(self) -> str:
        return f"[{self.lo}, {self.hi}]"


def plan_ranges(config: LabConfig, effective: EffectiveConfig) -> list[CompileRange]:
    """The ranges of ``config`` with SP / AsyncTP switched on where the config asks and this process allows."""
    return [
        CompileRange(
            lo,
            hi,
            enable_sp=effective.enable_sp and config.sp_active_for((lo, hi)),
            enable_async_tp=effective.enable_async_tp and config.async_tp_active_for((lo, hi)),
        )
        for lo, hi in config.compile_ranges()
    ]
