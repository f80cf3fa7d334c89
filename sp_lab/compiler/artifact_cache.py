"""Compiled range artifacts kept on disk, so a second run, a kernel restart or another process skips compiling.

Per compiled range one entry: the Inductor and AOTAutograd cache artifacts its compile produced or read,
serialized with torch's portable cache API (``torch.compiler.save_cache_artifacts`` /
``load_cache_artifacts``, "Mega-Cache"). Before a range compiles, its entry (if any) is loaded into
Inductor's local caches; the range then compiles as usual, and every piece is a cache hit: no code
generation, no C++/Triton compile. What a warm entry does not skip: Dynamo's capture, the SP pass over the
whole graph (``sharded``) and the split, which sp_lab redoes to know the pieces (seconds, not minutes).

The entry is found by a key over everything that decides the artifact (:func:`range_key`): the captured
graph's code and every input's shape, dtype and layout (the weights' too), the LabConfig, the effective
config (device, process group), the range, the passes' ``uuid()`` (their sources and settings), the torch and
sp_lab versions. Inductor keys its own entries by graph and pass uuid as well, so even a wrong sp_lab key
could not make it run a stale kernel; sp_lab's key decides what is loaded and what the report calls a hit.

Where: ``$SP_LAB_CACHE_DIR``, else ``.cache/sp_lab`` in the checkout sp_lab runs from (git-ignored), else
``~/.cache/sp_lab``. ``SP_LAB_CACHE_DIR=off`` turns the cache off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

if TYPE_CHECKING:
    from sp_lab.compiler.ranges import CompileRange
    from sp_lab.compiler.report import CacheOutcome
    from sp_lab.config import LabConfig

__all__ = ["ArtifactCache", "Serving", "cache_dir", "range_key", "write_atomic"]

ENV = "SP_LAB_CACHE_DIR"


def cache_dir() -> Path | None:
    """Where entries live (see the module docstring); None when ``$SP_LAB_CACHE_DIR`` is ``off``."""
    configured = os.environ.get(ENV)
    if configured:
        return None if configured == "off" else Path(configured)
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / ".git").exists():
        return checkout / ".cache" / "sp_lab"
    return Path.home() / ".cache" / "sp_lab"


def range_key(
    gm: fx.GraphModule, example_inputs: list[Any], config: LabConfig, effective: dict[str, Any],
    compile_range: CompileRange, pass_uuid: str, *, hint: int | None = None,
) -> str:
    """The entry key of one range's artifact: a hex digest over everything that decides it.

    ``gm``/``example_inputs``: the captured graph and its inputs (fake values); ``effective``:
    ``EffectiveConfig.to_dict()``; ``pass_uuid``: the post-grad pass's ``uuid()``; ``hint``: the token count
    the range was traced at when not the default one (a count its first artifact's guards excluded).
    """
    import sp_lab

    parts = {
        "compiler": _compiler_sources(),
        "hint": hint,
        "graph": gm.code,
        "inputs": [_input_key(x) for x in example_inputs],
        "config": config.to_dict(),
        "effective": effective,
        "range": [compile_range.lo, compile_range.hi, compile_range.enable_sp, compile_range.enable_async_tp],
        "passes": pass_uuid,
        "torch": torch.__version__,
        "sp_lab": sp_lab.__version__,
        # An entry holds Inductor's generated kernel source, written for this process's ATen CPU capability: a
        # process with another (the test suite's ATEN_CPU_CAPABILITY=default beside `make run`'s AVX2) would
        # compile vectorised source without the vector headers ("'at::vec' has not been declared").
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


@functools.cache
def _compiler_sources() -> str:
    """A digest of sp_lab's compiler sources (capture, split, range strategies, piece compilers): a checkout
    changes them without a version bump."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


def _input_key(x: Any) -> Any:
    """A graph input as the artifact depends on it: a tensor's shape, stride, dtype, device (and a DTensor's
    placements), a symbolic size by its expression, anything else by value."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return ["dtensor", str(x.placements), _input_key(x._local_tensor)]
    if isinstance(x, torch.Tensor):
        return ["tensor", [str(d) for d in x.shape], [str(s) for s in x.stride()], str(x.dtype), x.device.type]
    return str(x)


@dataclass(frozen=True)
class ArtifactCache:
    """The entries under ``root``: one file per range key."""

    root: Path

    @classmethod
    def default(cls) -> ArtifactCache | None:
        root = cache_dir()
        return None if root is None else cls(root)

    def path(self, key: str) -> Path:
        return self.root / "ranges" / f"{key}.bin"

    @contextlib.contextmanager
    def serve(self, key: str) -> Iterator[Serving]:
        """Load the entry of ``key`` into Inductor's caches, run the block (the range's compile), then save
        what the compile produced or read, unless the entry was a hit and the block says nothing was new."""
        from torch.compiler._cache import CacheArtifactManager

        path = self.path(key)
        try:
            loaded = torch.compiler.load_cache_artifacts(path.read_bytes())
        except FileNotFoundError:
            loaded = None
        serving = Serving("hit" if loaded is not None else "miss")
        # Only this block's artifacts go into the entry (a sweep compiles other variants in the same process).
        with CacheArtifactManager.with_fresh_cache():
            yield serving
            if serving.outcome == "hit" and not serving.compiled_anything:
                return
            saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            write_atomic(path, saved[0])


@dataclass
class Serving:
    """What :meth:`ArtifactCache.serve` found; the block sets ``compiled_anything`` when a piece missed
    Inductor's cache (then the entry is rewritten with it)."""

    outcome: CacheOutcome
    compiled_anything: bool = True


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` whole or not at all: concurrent ranks may write the same entry, so each
    writes a file of its own, then renames it (a reader never sees half an entry)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)
