"""Where weights come from: seeded random init or a local Hugging Face safetensors checkpoint.

Both sources answer the same question, "write this slice of this full tensor here"
(:class:`~sp_lab.models.layers.TensorSlice`), and :func:`load_weights` walks the model's
``checkpoint_plan`` to ask it. So a rank only ever reads (or generates) its own shard, and the
sharding logic that the HF-parity test checks is the same one random init uses.

Random init scheme (reproducible across tp sizes by construction): every full tensor is cut along
dim 0 into blocks of :data:`BLOCK_ELEMENTS` elements (``max(1, BLOCK_ELEMENTS // row_size)`` rows; the
block size depends only on the full shape). Block ``b`` of tensor ``name`` is drawn from its own
``torch.Generator`` seeded with ``blake2b(f"{seed}/{name}/{b}")``, as N(0, 0.02) in float32, then cast to
the model dtype. A rank generates only the blocks its slice touches (for a dim-1 shard, every block,
one at a time), so peak extra memory is one block (16 MiB) and a tp=2 shard is bit-exactly a slice of
the tp=1 tensor. Norm weights are ones.

Security: only safetensors files are read. A directory holding only pickle checkpoints
(``pytorch_model.bin``, ``*.pt``) is refused: unpickling runs arbitrary code.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from sp_lab.jsonfile import read_json
from sp_lab.models.layers import ParamPlan, TensorSlice

__all__ = [
    "BLOCK_ELEMENTS",
    "INIT_STD",
    "CheckpointError",
    "RandomWeights",
    "SafetensorsWeights",
    "WeightSource",
    "is_checkpoint_dir",
    "load_weights",
    "read_hf_config",
]

BLOCK_ELEMENTS = 1 << 22
"""Elements per random-init block (4 Mi = 16 MiB of float32). Changing it changes every random model."""
INIT_STD = 0.02
"""Standard deviation of random weights (HF's ``initializer_range``): keeps fp32 and bf16 logits O(1)."""

_PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "*.pt", "*.pth", "*.ckpt", "*.bin")


class CheckpointError(ValueError):
    """A checkpoint directory is unusable: missing files, missing tensors or wrong shapes."""


class WeightSource(Protocol):
    """Anything that can fill one slice of one full tensor into a destination view."""

    def fill(self, piece: TensorSlice, out: torch.Tensor) -> None:
        """Write the values of ``piece`` into ``out`` (shape ``piece.shape``, any dtype/device)."""
        ...


# --------------------------------------------------------------------------------------------------
# Random weights
# --------------------------------------------------------------------------------------------------


class RandomWeights:
    """Seeded N(0, 0.02) weights, generated per fixed block so any shard is reproducible alone."""

    def __init__(self, seed: int = 0, std: float = INIT_STD) -> None:
        self.seed = seed
        self.std = std
        # One reused float32 block: fresh 16 MiB allocations per block cost more in page faults
        # than generating the numbers.
        self._scratch = torch.empty(0)

    def _generator(self, name: str, block: int) -> torch.Generator:
        digest = hashlib.blake2b(f"{self.seed}/{name}/{block}".encode(), digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))

    def _block(self, name: str, block: int, shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        if self._scratch.numel() < numel:
            self._scratch = torch.empty(max(numel, BLOCK_ELEMENTS))
        # normal_ on a fresh view draws the same numbers as torch.randn(shape, generator=...).
        values = self._scratch[:numel].view(shape).normal_(generator=self._generator(name, block))
        return values.mul_(self.std)

    def fill(self, piece: TensorSlice, out: torch.Tensor) -> None:
        if piece.init in ("ones", "zeros"):
            out.fill_(1.0 if piece.init == "ones" else 0.0)
            return
        full = piece.full_shape
        rows, row_size = full[0], math.prod(full[1:])
        block_rows = max(1, BLOCK_ELEMENTS // max(1, row_size))
        row_lo, row_hi = (piece.start, piece.stop) if piece.dim == 0 else (0, rows)
        for block in range(row_lo // block_rows, -(-row_hi // block_rows)):
            b0, b1 = block * block_rows, min(rows, (block + 1) * block_rows)
            values = self._block(piece.name, block, (b1 - b0, *full[1:]))
            r0, r1 = max(b0, row_lo), min(b1, row_hi)
            values = values[r0 - b0 : r1 - b0]
            if piece.dim is not None and piece.dim > 0:
                values = values.narrow(piece.dim, piece.start, piece.stop - piece.start)
            out[r0 - row_lo : r1 - row_lo].copy_(values)


# --------------------------------------------------------------------------------------------------
# Hugging Face safetensors checkpoints
# --------------------------------------------------------------------------------------------------


def is_checkpoint_dir(path: str | Path) -> bool:
    """True if ``path`` is a directory with a ``config.json`` (a candidate HF checkpoint)."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def read_hf_config(path: str | Path) -> dict:
    """The parsed ``config.json`` of an HF checkpoint directory."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path} has no config.json; a Hugging Face checkpoint directory needs one")
    hf = read_json(config, what="config.json", error=CheckpointError)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config}: expected a JSON object, got {type(hf).__name__}")
    return hf


class SafetensorsWeights:
    """Slices of tensors in a local HF checkpoint, read with ``safe_open(...).get_slice(name)[...]``.

    Handles one ``model.safetensors``, several ``*.safetensors`` shards, and sharded checkpoints
    described by ``model.safetensors.index.json``. Only the requested slice is read from disk.
    """

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open  # optional dependency (pip install 'sp_lab[hf]')

        self._safe_open = safe_open
        self.path = Path(path)
        self._handles: dict[Path, object] = {}
        self.index = self._build_index()

    def _build_index(self) -> dict[str, Path]:
        index_file = self.path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = read_json(index_file, what="index", error=CheckpointError)
            if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
                raise CheckpointError(f"{index_file}: expected a JSON object with a 'weight_map' object")
            weight_map = weight_map["weight_map"]
            index = {name: self.path / file for name, file in weight_map.items()}
            absent = sorted({str(p.name) for p in index.values() if not p.is_file()})
            if absent:
                raise CheckpointError(
                    f"{index_file} names shard file(s) {absent} that are not in {self.path}"
                )
            return index
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            pickles = sorted({p.name for pattern in _PICKLE_NAMES for p in self.path.glob(pattern)})
            if pickles:
                raise CheckpointError(
                    f"{self.path} holds only pickle checkpoint file(s) {pickles}; sp_lab loads safetensors only "
                    "(unpickling can run arbitrary code). Convert with "
                    "`model.save_pretrained(dir, safe_serialization=True)` or use a *.safetensors release."
                )
            raise CheckpointError(
                f"{self.path} has no *.safetensors files (nor model.safetensors.index.json)"
            )
        index: dict[str, Path] = {}
        for file in files:
            for name in self._handle(file).keys():  # noqa: SIM118 (safe_open is not a dict)
                index[name] = file
        return index

    def _handle(self, file: Path):
        if file not in self._handles:
            from safetensors import SafetensorError

            try:
                self._handles[file] = self._safe_open(str(file), framework="pt", device="cpu")
            except SafetensorError as e:
                # safe_open checks the header and that the file is as long as the header says.
                raise CheckpointError(
                    f"{file}: not a readable safetensors file ({e}); a download cut short, or another format "
                    "renamed *.safetensors? Fetch the file again"
                ) from e
        return self._handles[file]

    def fill(self, piece: TensorSlice, out: torch.Tensor) -> None:
        out.copy_(self.read(piece))

    def read(self, piece: TensorSlice) -> torch.Tensor:
        """The slice as stored (checkpoint dtype, CPU)."""
        file = self.index.get(piece.name)
        if file is None:
            raise CheckpointError(
                f"tensor {piece.name!r} (expected shape {list(piece.full_shape)}) is missing from {self.path}"
            )
        view = self._handle(file).get_slice(piece.name)
        found = tuple(view.get_shape())
        if found == () and piece.full_shape == (1,):
            # One value stored as a 0-d scalar: FP8 checkpoints in the wild write a tensorwise weight_scale /
            # input_scale either way, and both mean the same single value.
            return self._handle(file).get_tensor(piece.name).reshape(1)
        if found != piece.full_shape:
            raise CheckpointError(
                f"tensor {piece.name!r} in {file.name} has shape {list(found)}, expected {list(piece.full_shape)} "
                "(does config.json match the weights?)"
            )
        if piece.dim is None:
            return view[:]
        index = [slice(None)] * len(found)
        index[piece.dim] = slice(piece.start, piece.stop)
        return view[tuple(index)]


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def iter_plans(model: nn.Module) -> Iterator[tuple[nn.Module, ParamPlan]]:
    """Every ``(module, plan)`` of every layer that declares a ``checkpoint_plan``."""
    for name, module in model.named_modules():
        plan_fn = getattr(module, "checkpoint_plan", None)
        if plan_fn is not None:
            for plan in plan_fn(name.rpartition(".")[0]):
                yield module, plan


@torch.no_grad()
def load_weights(model: nn.Module, source: WeightSource) -> None:
    """Fill every planned parameter of ``model`` from ``source``, this rank's slices only.

    Checkpoint problems (missing tensors, wrong shapes) are collected and raised together.
    """
    problems: list[str] = []
    for module, plan in iter_plans(model):
        param: torch.Tensor = getattr(module, plan.param)
        if sum(piece.shape[0] for piece in plan.slices) != param.shape[0]:  # a plan bug, not the checkpoint's
            raise RuntimeError(
                f"plan {[p.name for p in plan.slices]} does not cover {plan.param} {tuple(param.shape)}"
            )
        offset = 0
        for piece in plan.slices:
            # Fused parameters (qkv, gate_up) stack their parts along dim 0.
            dest = param.narrow(0, offset, piece.shape[0])
            offset += piece.shape[0]
            try:
                source.fill(piece, dest)
            except CheckpointError as e:
                problems.append(str(e))
    if problems:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise CheckpointError(
            f"checkpoint does not fit the model ({len(problems)} problem(s)):\n  {shown}{more}"
        )
