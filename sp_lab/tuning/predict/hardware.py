"""The hardware a prediction is for: GPUs (compute and memory peaks) and their interconnect's alpha-beta costs.

Read from ``data/hardware.json``, where every number carries its public source (vendor datasheets,
public nccl-tests figures) or says it is an assumption. Nothing here was measured by sp_lab.

Communication is an alpha-beta model: a ring collective over ``tp`` ranks on a full ``[T, H]`` tensor of
``S`` bytes costs ``alpha + f * S / busbw`` with NCCL's bus-bandwidth factors ``f = 2(tp-1)/tp``
(all_reduce) and ``(tp-1)/tp`` (reduce_scatter, all_gather) -- nccl-tests reports ``busbw`` in exactly this
convention, so a published busbw plugs straight in. One copy-engine transfer of ``S`` bytes between two
GPUs (what the fused kernels issue, one per chunk) costs ``copy_alpha + S / copy_bw``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache

from sp_lab.resources import DATA_DIR

HARDWARE_JSON = DATA_DIR / "hardware.json"
"""GPU and interconnect constants with their sources."""

RING_FACTORS = {
    "all_reduce": lambda tp: 2 * (tp - 1) / tp,
    "reduce_scatter": lambda tp: (tp - 1) / tp,
    "all_gather": lambda tp: (tp - 1) / tp,
}
"""nccl-tests' bus-bandwidth factors: bytes each rank moves per byte of the full tensor."""


@dataclass(frozen=True)
class Interconnect:
    """Alpha-beta costs of one interconnect (per GPU)."""

    name: str
    """Key in ``hardware.json`` (``"nvlink4"``, ``"nvlink5"``, ``"pcie5"``, ...)."""
    label: str
    """What a person calls it."""
    busbw_gbps: float
    """NCCL bus bandwidth of large ring collectives, GB/s (1e9 B/s)."""
    copy_gbps: float
    """Bandwidth of one peer-to-peer copy-engine transfer, GB/s."""
    alpha_us: float
    """Fixed cost of one NCCL collective (launch, synchronisation, small-message latency), us."""
    copy_alpha_us: float
    """Fixed cost of one copy-engine transfer and its signal, us."""
    sources: tuple[str, ...] = ()
    """Public sources of the numbers."""
    assumption: str = ""
    """What is assumed rather than sourced."""

    def __post_init__(self) -> None:
        if min(self.busbw_gbps, self.copy_gbps) <= 0 or min(self.alpha_us, self.copy_alpha_us) < 0:
            raise ValueError(f"interconnect {self.name!r}: bandwidths must be > 0 and alphas >= 0; got {self}")

    def collective_us(self, kind: str, nbytes: float, tp: int) -> float:
        """Time of collective ``kind`` over ``tp`` ranks on a full tensor of ``nbytes`` bytes
        (the reduce_scatter's input, the all_gather's output, the all_reduce's tensor)."""
        if kind not in RING_FACTORS:
            raise ValueError(f"unknown collective {kind!r}; expected one of {sorted(RING_FACTORS)}")
        if tp == 1:
            return 0.0
        # bytes / (GB/s) = bytes / (gbps * 1e3) microseconds
        return self.alpha_us + RING_FACTORS[kind](tp) * nbytes / (self.busbw_gbps * 1e3)

    def copy_us(self, nbytes: float) -> float:
        """One peer-to-peer copy of ``nbytes`` bytes."""
        return self.copy_alpha_us + nbytes / (self.copy_gbps * 1e3)


BOARD_GPUS = 8
"""GPUs on the one board (node) a prediction models: their interconnect is the board's NVLink / NVSwitch (or PCIe);
traffic between nodes is not modelled, so neither is a tp above this."""


@dataclass(frozen=True)
class Gpu:
    """One GPU model: peaks from its datasheet and the interconnect of its usual 8-GPU board."""

    name: str
    """Key in ``hardware.json`` (``"h100"``, ``"h200"``, ``"b200"``, ...)."""
    label: str
    """What a person calls it."""
    peak_tflops: dict[str, float]
    """Dense matmul peak per dtype (``"bfloat16"``, ``"float8"``), TFLOP/s."""
    hbm_gbps: float
    """Memory bandwidth, GB/s."""
    interconnect: Interconnect
    """How its GPUs talk to each other."""
    sources: tuple[str, ...] = ()
    """Public sources of the numbers."""
    system: str | None = None
    """The aiconfigurator-core system with collected tables for this GPU (``"h200_sxm"``); ``None``: none."""
    compute_capability: str = "9.0"
    """CUDA compute capability (``"9.0"``): picks vLLM's all-reduce size limits."""

    @property
    def nvlink(self) -> bool:
        """Whether its GPUs are connected by NVLink (vLLM's custom all-reduce needs it above 2 GPUs)."""
        return self.interconnect.name.startswith("nvlink")


@cache
def _raw() -> dict:
    return json.loads(HARDWARE_JSON.read_text())


def interconnect(name: str) -> Interconnect:
    """The interconnect ``name`` from ``hardware.json``; ``ValueError`` listing the known ones otherwise."""
    known = _raw()["interconnects"]
    if name not in known:
        raise ValueError(f"unknown interconnect {name!r}; known: {sorted(known)}")
    d = known[name]
    return Interconnect(name=name, label=d["label"], busbw_gbps=float(d["busbw_gbps"]), copy_gbps=float(d["copy_gbps"]),
                        alpha_us=float(d["alpha_us"]), copy_alpha_us=float(d["copy_alpha_us"]),
                        sources=tuple(d.get("sources", ())), assumption=d.get("assumption", ""))


def gpu_names() -> list[str]:
    """GPUs a prediction can be made for (``hardware.json`` keys)."""
    return sorted(_raw()["gpus"])


def system_aliases() -> dict[str, str]:
    """aiconfigurator system name -> ``hardware.json`` key (``"h200_sxm"`` -> ``"h200"``): both name the GPU."""
    return {d["system"]: key for key, d in _raw()["gpus"].items() if d.get("system")}


def allowed_gpu_names() -> list[str]:
    """What ``--gpu`` takes: each GPU by its aiconfigurator system name where it has one (``h200_sxm``), the others
    (no collected tables) by their ``hardware.json`` key, then the old short names as aliases."""
    aliases = system_aliases()
    named = sorted({*aliases, *(k for k in _raw()["gpus"] if k not in aliases.values())})
    old = sorted(k for s, k in aliases.items() if k != s)
    return named + [f"{k} (= {next(s for s, v in aliases.items() if v == k)})" for k in old]


def gpu(name: str) -> Gpu:
    """The GPU ``name`` (a ``hardware.json`` key such as ``"h200"``, or its aiconfigurator system name such as
    ``"h200_sxm"``); ``ValueError`` listing the allowed names otherwise."""
    known = _raw()["gpus"]
    key = str(name).lower()
    key = system_aliases().get(key, key)
    if key not in known:
        raise ValueError(f"unknown GPU {name!r}; allowed: {', '.join(allowed_gpu_names())}")
    d = known[key]
    return Gpu(name=key, label=d["label"], peak_tflops={"bfloat16": float(d["peak_bf16_tflops"]),
                                                        "float8": float(d["peak_fp8_tflops"])},
               hbm_gbps=float(d["hbm_gbps"]), interconnect=interconnect(d["interconnect"]),
               sources=tuple(d.get("sources", ())), system=d.get("system"),
               compute_capability=str(d.get("compute_capability", "9.0")))
